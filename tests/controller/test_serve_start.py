"""``ckptctl serve`` as it starts and stops: one controller per state directory, its socket
file removed on exit and reclaimed after a kill -9, and every value that passes the config
checks but that the running system refuses, refused at start naming the file and key (exit 2).
Real ``ckptctl serve`` processes throughout."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from ckpt_controller.procutil import ReadyProcess
from support import ROOT
from support.cli import CKPTCTL, ckptctl
from support.timing import scaled


def _config(folder: Path, name: str, extra: str = "", *, endpoint: str | None = None,
            state: Path | None = None) -> Path:
    """A config of its own state dir and endpoint unless given."""
    path = folder / f"{name}.toml"
    path.write_text(f'[controller]\nendpoint = "{endpoint or f"ipc://{folder}/{name}.sock"}"\n'
                    f'state_dir = "{state or folder / f"{name}-state"}"\n' + extra)
    return path


def _serve(config: Path, log: Path) -> ReadyProcess:
    return ReadyProcess([*CKPTCTL, "serve", "--config",
                         str(config)], log, "controller", cwd=ROOT)


def test_one_controller_per_state_dir_and_its_socket_file(ipc_dir):
    sock = ipc_dir / "ctl.sock"
    config = _config(ipc_dir, "c", endpoint=f"ipc://{sock}")
    first = _serve(config, ipc_dir / "first.log")
    try:
        second = ckptctl("serve", "--config", str(config))
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stdout == ""  # never announced itself ready
        assert f"pid {first.pid}" in second.stderr and "controller.state_dir" in second.stderr
        assert str(config) in second.stderr
        # the first still owns its socket and answers on it
        assert sock.is_socket()
        assert ckptctl("history", "--json", endpoint=f"ipc://{sock}").returncode == 0
        # another state directory on the same endpoint: refused too, naming the endpoint
        other = _config(ipc_dir, "other", endpoint=f"ipc://{sock}")
        third = ckptctl("serve", "--config", str(other))
        assert third.returncode == 2 and "controller.endpoint" in third.stderr, third.stderr
        assert ckptctl("history", "--json", endpoint=f"ipc://{sock}").returncode == 0
        # its PID file deleted: the state directory's own lock still refuses a second one,
        # on another endpoint (both once ran, cycling one engine into one journal)
        (ipc_dir / "c-state" / "controller.lock").unlink()
        twin = _config(ipc_dir, "twin", endpoint=f"ipc://{ipc_dir}/twin.sock",
                       state=ipc_dir / "c-state")
        fourth = ckptctl("serve", "--config", str(twin), timeout=30)  # one that runs: fails
        assert fourth.returncode == 2, fourth.stdout + fourth.stderr
        assert "in use by another controller" in fourth.stderr, fourth.stderr
        first.stop()
        assert not sock.exists()  # removed on exit
        # killed with -9, a controller leaves its socket file: the next one reclaims it
        first = _serve(config, ipc_dir / "first.log")
        assert sock.is_socket()
        first.kill9()
        assert sock.is_socket()
        again = _serve(config, ipc_dir / "again.log")
        try:
            assert again.info["pid"] != first.pid
            assert ckptctl("history", "--json", endpoint=f"ipc://{sock}").returncode == 0
        finally:
            again.stop()
        assert not sock.exists()
    finally:
        first.stop()


def test_values_the_running_system_refuses_are_refused_at_start(ipc_dir):
    """Each value passes the file's own checks but cannot work here: ``ckptctl serve`` exits
    2 at once, naming the file and the key, with no traceback."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    (ipc_dir / "a-file").write_text("")
    cases = {
        "controller.state_dir": _config(ipc_dir, "file-state", state=ipc_dir / "a-file"),
        "controller.state_dir ": _config(ipc_dir, "proc-state", state=Path("/proc/ckpt-state")),
        "controller.endpoint": _config(ipc_dir, "no-folder",
                                       endpoint=f"ipc://{ipc_dir}/missing/ctl.sock"),
        "controller.endpoint ": _config(ipc_dir, "port-taken",
                                        endpoint=f"tcp://127.0.0.1:{port}"),
        "controller.metrics_port": _config(ipc_dir, "metrics-taken",
                                           f"metrics_port = {port}\n"),
        "controller.hooks_dir": _config(ipc_dir, "no-hooks",
                                        f'hooks_dir = "{ipc_dir}/no-hooks"\n'),
        "controller.reconcile_interval_s": _config(ipc_dir, "forever",
                                                   "reconcile_interval_s = 1e12\n"),
    }
    procs = {key: subprocess.Popen([*CKPTCTL, "serve",
                                    "--config", str(path)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for key, path in cases.items()}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=scaled(60))
            assert proc.returncode == 2, (key, out, err)
            assert key.strip() in err and str(cases[key]) in err, (key, err)
            assert "Traceback" not in err and out == "", (key, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        taken.close()


def test_check_validates_a_config_without_starting(ipc_dir):
    """``serve --check`` (as ``nginx -t``): 0 and what it found for a good config, creating
    nothing; 2 naming what to fix for one the start would refuse; a running controller's
    endpoint is said to be served."""
    hooks = ipc_dir / "hooks"
    (hooks / "dump").mkdir(parents=True, mode=0o700)
    hooks.chmod(0o700)
    hook = hooks / "dump" / "10-criu-dump"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o755)
    good = _config(ipc_dir, "chk", f'hooks_dir = "{hooks}"\n')
    out = ckptctl("serve", "--config", str(good), "--check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"{good}: ok: 0 engine(s)"), out.stdout
    assert "dump 1" in out.stdout and ": free" in out.stdout and "to be created" in out.stdout
    assert not (ipc_dir / "chk-state").exists()  # nothing made
    hook.chmod(0o644)
    out = ckptctl("serve", "--config", str(good), "--check")
    assert out.returncode == 2 and "not an executable file" in out.stderr, out.stderr
    missing = _config(ipc_dir, "miss", f'hooks_dir = "{ipc_dir / "nowhere"}"\n')
    out = ckptctl("serve", "--config", str(missing), "--check")
    assert out.returncode == 2 and "controller.hooks_dir" in out.stderr, out.stderr
    bad = _config(ipc_dir, "bad", "bogus = 1\n")
    out = ckptctl("serve", "--config", str(bad), "--check")
    assert out.returncode == 2 and "bogus" in out.stderr, out.stderr
    running = _serve(_config(ipc_dir, "run"), ipc_dir / "run.log")
    try:
        out = ckptctl("serve", "--config", str(ipc_dir / "run.toml"), "--check")
        assert out.returncode == 0 and "another process serves it now" in out.stdout, out.stdout
    finally:
        running.stop()


def test_sigterm_during_crash_recovery_ends_it_at_once(spawn_engine, spawn_controller):
    """A controller killed while its agent drains a long request, started again: its recovery
    waits for that agent's step to end (up to the operation deadline). A SIGTERM then ends
    it at once (it once waited the whole step out, over a minute); the operation stays
    running in the journal, for the next start to recover."""
    import signal
    import sqlite3
    import threading
    import time

    from support.config import engines_toml
    from support.processes import wait_state

    eng = spawn_engine("rc")
    ctl = spawn_controller(engines_toml(eng) + "\n[deadlines]\ndrain = 120\noperation = 300\n")
    eng.submit("long", steps=12000)  # 120 s of steps: the wait drain holds PREPARING
    t = threading.Thread(target=lambda: ctl.ckptctl("prepare", "rc", "--drain", "wait",
                                                    "--op-id", "cut"))
    t.start()
    wait_state(eng.control, "preparing")
    ctl.kill9()
    t.join(scaled(60))
    log = (ctl.dir / "again.log").open("w")
    again = subprocess.Popen([*CKPTCTL, "serve", "--config", str(ctl.config)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        time.sleep(scaled(3.0))  # recovering: the agent's step still running, nothing ready
        assert again.poll() is None
        start = time.monotonic()
        again.send_signal(signal.SIGTERM)
        again.wait(timeout=scaled(60))
        took = time.monotonic() - start
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
        log.close()
    assert took < scaled(10, below=60), took  # not the drain's 120 s
    assert again.stdout.read() == ""  # it never said it was ready
    again.stdout.close()
    with sqlite3.connect(ctl.state_dir / "journal.sqlite3") as db:
        (status,) = db.execute("SELECT status FROM operations WHERE op_id = 'cut'").fetchone()
    assert status == "running"  # the next start recovers it
