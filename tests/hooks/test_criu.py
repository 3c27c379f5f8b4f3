"""Real CRIU: the shipped hooks dump a PREPARED reference engine and bring it back.

Needs CRIU 4.2+ from ``make criu`` (or ``CKPT_CRIU``); skips with the reason otherwise. The
engines listen on TCP loopback: CRIU closes established TCP connections on restore
(``--tcp-close``) and ZMQ peers reconnect, while a unix stream connection to a peer outside the
dump cannot be checkpointed at all."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ckpt_controller.agent import AgentClient
from ckpt_controller.endpoints import free_port
from ckpt_controller.engine.client import EngineClient
from support import ROOT
from support.config import engines_toml
from support.criu import CRIU, criu_missing, required, tcp_engine
from support.hooks import CRIU_HOOKS, link_hook, link_hooks
from support.processes import kill_naming, pids_naming
from support.timing import deadline_in, scaled

# CI sets CKPT_REQUIRE_CRIU=1: where CRIU can be installed, a CRIU test that would skip fails
_reason = required(criu_missing(), "the CRIU tests")
# the restored copies are found by their command line, which a forked engine lacks
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.exec_engines]


def dump_directly(pid: int, images: Path, timeout_s: float = 300) -> dict[str, str]:
    """Run the criu-dump hook on ``pid`` into ``images`` (made here) as the controller would,
    without one; returns the hook environment, for a criu-restore of the same image."""
    images.mkdir()
    env = dict(os.environ, CKPT_ENGINE_PID=str(pid), CKPT_IMAGE_DIR=str(images),
               CKPT_CRIU=CRIU, CKPT_ACTION="dump")
    out = subprocess.run([str(ROOT / "hooks" / "criu-dump")], env=env, capture_output=True,
                         text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr
    return env


def config_for(eng) -> str:
    return engines_toml(eng, defaults='drain = "keep"\nlevel = 2')


def test_cycle_with_a_real_dump_keeps_serving(spawn_reference, spawn_controller):
    eng = tcp_engine(spawn_reference, "crl")
    ctl = spawn_controller(config_for(eng))
    link_hook(ctl, "dump", "10-criu-dump", "criu-dump")
    with EngineClient(eng.api) as api:
        prompts = [[i, 2, 9] for i in range(4)]
        ids = [api.submit(pr, 300) for pr in prompts]
        time.sleep(0.1)
        out = ctl.ckptctl("cycle", "crl", "--json", "--op-id", "dump1")
        assert out.returncode == 0, out.stdout + out.stderr
        (o,) = json.loads(out.stdout)["engines"]
        (dump,) = [h for h in o["hooks"] if h["point"] == "dump"]
        assert dump["exit_code"] == 0 and "dumped pid" in dump["stdout_tail"]
        images = ctl.dir / "state" / "images" / "crl"
        assert (images / "dump1" / "inventory.img").exists()
        assert (images / "latest").resolve() == (images / "dump1").resolve()
        deadline = deadline_in(60)
        while not all(api.requests[i].ended for i in ids) and time.monotonic() < deadline:
            api.poll(0.2)
        assert [api.requests[i].token_ids for i in ids] == \
            [api.generate(pr, 300).token_ids for pr in prompts]


def test_a_dump_past_its_timeout_is_ended_and_the_engine_serves_on(spawn_reference,
                                                                    spawn_controller,
                                                                    monkeypatch, tmp_path):
    """``criu dump --tcp-established`` hung with the engine's tree frozen (an action script
    sleeping at post-dump): at the hook's timeout the dump is ended, CRIU's network lock
    (its nftables table) removed, the cycle rolled back, and the engine answers on the
    connection it had: it once stayed locked, and its clients' requests never ended."""
    import re
    import subprocess

    hang = tmp_path / "hang.sh"
    hang.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] && sleep 120\n'
                    'exit 0\n')
    hang.chmod(0o755)
    monkeypatch.setenv("CKPT_CRIU_EXTRA", f"--action-script {hang}")
    monkeypatch.setenv("CKPT_CRIU_TCP", "established")
    eng = tcp_engine(spawn_reference, "crhg")
    ctl = spawn_controller(config_for(eng) + "\n[deadlines]\nhook = 4\n")
    link_hook(ctl, "dump", "10-criu-dump", "criu-dump")
    with EngineClient(eng.api) as api:
        assert api.generate([1, 2, 3], 5).finish_reason == "length"  # the connection open
        out = ctl.ckptctl("cycle", "crhg", "--json")
        assert out.returncode == 3, out.stdout + out.stderr  # HookTimeoutError
        (o,) = json.loads(out.stdout)["engines"]
        assert o["status"] == "rolled_back" and o["state"] == "running", o
        (dump,) = [h for h in o["hooks"] if h["point"] == "dump"]
        assert dump["timed_out"] and "stopped (the hook's timeout)" in dump["stderr_tail"]
        table = re.search(r"removed CRIU's network lock \(table inet (CRIU-[0-9a-f-]+)\)",
                          dump["stderr_tail"])
        assert table, dump["stderr_tail"]
        nft = ROOT / ".cache" / "criu" / "bin" / "nft"
        assert subprocess.run([str(nft), "list", "table", "inet", table.group(1)],
                              capture_output=True).returncode != 0  # gone
        assert api.generate([4, 5, 6], 5, timeout_s=scaled(20)).finish_reason == "length"


def test_an_engine_on_ipc_endpoints_cannot_be_dumped_and_is_told_why(spawn_reference,
                                                                     spawn_controller):
    eng = spawn_reference("cripc")  # ipc:// endpoints: the controller's connection is a unix socket
    ctl = spawn_controller(config_for(eng))
    link_hook(ctl, "dump", "10-criu-dump", "criu-dump")
    out = ctl.ckptctl("cycle", "cripc", "--json")
    assert out.returncode == 1
    (o,) = json.loads(out.stdout)["engines"]
    assert o["status"] == "rolled_back" and o["state"] == "running"  # the engine lives on
    err = o["error"]["details"]["stderr_tail"]
    assert f"unix-socket connection ({eng.control[len('ipc://'):]})" in err
    assert "tcp://" in err
    with EngineClient(eng.api) as api:
        assert api.generate([1, 2, 3], 5).finish_reason == "length"


def test_dump_stops_the_engine_and_restore_brings_it_back(spawn_reference, spawn_controller,
                                                          monkeypatch):
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")  # hooks get the controller's environment
    eng = tcp_engine(spawn_reference, "crs")
    try:
        _stop_and_restore(eng, spawn_controller)
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])


def stop_capture_restore(ctl, eng) -> dict:
    """``prepare``, ``capture`` (the dump hooks end the engine: ``CKPT_CRIU_MODE=stop``),
    the engine reaped (its PIDs free for the restore), ``restore``: each succeeds; the
    restore's outcome for the engine."""
    assert ctl.ckptctl("prepare", eng.name).returncode == 0
    out = ctl.ckptctl("capture", eng.name, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    eng.proc.wait(timeout=scaled(10))  # the dump ended it; reaped, its PID is free again
    out = ctl.ckptctl("restore", eng.name, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    return o


def _stop_and_restore(eng, spawn_controller) -> None:
    ctl = spawn_controller(config_for(eng))
    link_hooks(ctl, CRIU_HOOKS)
    with EngineClient(eng.api) as api:
        want = api.generate([5, 6, 7], 40).token_ids
        kept = api.submit([8, 8, 8], 400)
        time.sleep(0.1)
        o = stop_capture_restore(ctl, eng)
        assert o["state"] == "running"
        with AgentClient(eng.control) as agent:
            st = agent.status()
        assert st.restored_from_image and st.incarnation >= 1 and st.pid == eng.pid
        assert api.generate([5, 6, 7], 40).token_ids == want
        deadline = deadline_in(60)
        while not api.requests[kept].ended and time.monotonic() < deadline:
            api.poll(0.2)
        assert api.requests[kept].finish_reason == "length"
        assert api.requests[kept].token_ids == api.generate([8, 8, 8], 400).token_ids


def test_restore_hook_without_an_image_says_so(tmp_path):
    env = dict(os.environ, CKPT_ENGINE_PID="999999999", CKPT_IMAGE_DIR=str(tmp_path),
               CKPT_CRIU=CRIU)
    out = subprocess.run([str(ROOT / "hooks" / "criu-restore")], env=env, capture_output=True,
                         text=True, timeout=scaled(30))
    assert out.returncode == 2 and "no CRIU image" in out.stderr
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_restore_waits_until_the_dumped_engines_pids_are_free(spawn_reference):
    """Dumped leave-running, then killed: until its parent reaps it, the original holds its
    PID (a zombie), and a restore must wait for it rather than fail."""
    eng = tcp_engine(spawn_reference, "crwait")
    try:
        with AgentClient(eng.control) as agent:
            agent.prepare(level=2)
        images = eng.log_path.parent / "crwait-img"
        env = dump_directly(eng.pid, images)
        eng.proc.kill()  # not reaped yet: the PID stays taken
        time.sleep(0.3)
        env.update(CKPT_ACTION="pre-restore", CKPT_RESTORE_FROM=str(images))
        start = time.monotonic()
        restore = subprocess.Popen([str(ROOT / "hooks" / "criu-restore")], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert restore.poll() is None  # still waiting for the PID
        eng.proc.wait(timeout=scaled(10))
        stdout, stderr = restore.communicate(timeout=scaled(120))
        assert restore.returncode == 0, stderr
        assert time.monotonic() - start >= 1.5 and "restored the engine" in stdout
        with AgentClient(eng.control) as agent:
            assert agent.status().restored_from_image
            assert agent.restore().state == "running"
        with EngineClient(eng.api) as api:
            assert api.generate([1, 2, 3], 5).finish_reason == "length"
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])


def test_under_load_dump_kill_restore_loses_nothing(spawn_reference, spawn_controller,
                                                    monkeypatch):
    """The whole migration path under load: prepare (level 2, keep), dump and stop, restore
    from the image, re-wake, serve; every request ends, outputs equal an uninterrupted run."""
    import threading

    from ckpt_controller.engine.load import replay, run_load

    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")
    eng = tcp_engine(spawn_reference, "crload")
    try:
        ctl = spawn_controller(config_for(eng))
        link_hooks(ctl, CRIU_HOOKS)
        box = {}
        load = threading.Thread(target=lambda: box.update(zip(("report", "requests"), run_load(
            eng.api, rate=30, duration_s=4.0, seed=5, settle_s=60))))
        load.start()
        time.sleep(1.5)
        out = ctl.ckptctl("prepare", eng.name)
        assert out.returncode == 0, out.stderr
        assert ctl.ckptctl("capture", eng.name).returncode == 0
        eng.proc.wait(timeout=scaled(10))  # the dump stopped it
        out = ctl.ckptctl("restore", eng.name, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        load.join(scaled(120))
        report, requests = box["report"], box["requests"]
        assert report.lost == 0 and report.sent >= 100, report
        # drain keep: nothing aborted; what was not turned away while not RUNNING completed
        assert report.aborted == 0 and report.completed == report.sent - report.rejected > 0
        completed = {rid: c.token_ids for rid, c in requests.items()
                     if c.finish_reason in ("stop", "length")}
        uncycled = spawn_reference("crload-uncycled")  # same seed and model, never dumped
        assert completed == replay(uncycled.api, 5, list(completed))
        with AgentClient(eng.control) as agent:
            assert agent.status().restored_from_image
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])


def test_prepared_image_is_much_smaller(spawn_reference, tmp_path, capsys):
    """The same engine dumped as it serves and dumped PREPARED at level 2 (weights and KV
    cache released): the sizes are printed, and the prepared one must be far smaller."""
    eng_small = spawn_reference("crsize2", "--model", "small", "--kv-blocks", "256",
                                api=f"tcp://127.0.0.1:{free_port()}",
                                control=f"tcp://127.0.0.1:{free_port()}")
    sizes = {}
    for label in ("unprepared", "prepared"):
        if label == "prepared":
            with AgentClient(eng_small.control) as agent:
                agent.prepare(level=2)
        images = tmp_path / label
        dump_directly(eng_small.pid, images)
        sizes[label] = sum(f.stat().st_size for f in images.iterdir())
    with capsys.disabled():
        print(f"\nCRIU image of a small reference engine: unprepared "
              f"{sizes['unprepared'] / 2**20:.0f} MiB, prepared at level 2 "
              f"{sizes['prepared'] / 2**20:.0f} MiB")
    released = eng_small.info["weight_bytes"] + eng_small.info["kv_bytes"]
    assert sizes["unprepared"] - sizes["prepared"] >= 0.8 * released
    assert sizes["prepared"] < sizes["unprepared"] / 2
    with AgentClient(eng_small.control) as agent:
        agent.restore()


def test_leave_running_then_a_copy_in_its_own_pid_namespace(ipc_dir, model_dir):
    """An engine started in its own PID namespace is dumped with leave-running, and a copy
    restored from the image runs beside the still-running original."""
    from ckpt_controller.procutil import ReadyProcess

    api, control = f"ipc://{ipc_dir}/pns.api", f"ipc://{ipc_dir}/pns.ctl"
    original = ReadyProcess(["unshare", "--pid", "--fork", "setsid", os.sys.executable, "-m",
                             "ckpt_controller", "engine", "serve", "--name", "pns", "--api", api,
                             "--control", control, "--model-dir", str(model_dir)],
                            ipc_dir / "pns.log", "engine in a PID namespace", cwd=ROOT)
    try:
        assert original.info["pid"] == 1  # it sees itself as its namespace's init
        kids = Path(f"/proc/{original.pid}/task/{original.pid}/children").read_text().split()
        engine_pid = int(kids[0])
        with AgentClient(control) as agent:
            agent.prepare(level=2)
        images = ipc_dir / "img"
        env = dump_directly(engine_pid, images)
        env.update(CKPT_ACTION="pre-restore", CKPT_RESTORE_FROM=str(images), CKPT_CRIU_BESIDE="1")
        out = subprocess.run([str(ROOT / "hooks" / "criu-restore")], env=env, capture_output=True,
                             text=True, timeout=scaled(120))
        assert out.returncode == 0, out.stderr
        copies = pids_naming(control) - {original.pid}  # not `unshare` itself
        assert engine_pid in copies and len(copies) == 2  # the original and its copy
        with AgentClient(control) as agent:  # the socket path now leads to the copy
            st = agent.status()
            assert st.restored_from_image and st.state == "prepared"
            assert agent.restore().state == "running"
        with EngineClient(api) as c:
            assert c.generate([1, 2, 3], 5).finish_reason == "length"
        # the original still runs (not stopped, not a zombie) beside its copy
        assert psutil.Process(engine_pid).status() in ("running", "sleeping", "disk-sleep")
    finally:  # the copy is no child of ours: its control path is this test's own
        kill_naming(control)
        original.stop()


# -------------------------------------------------------------- damaged images, hung restores

def _stopped_engine_image(eng, images: Path, monkeypatch) -> tuple[dict[str, str], Path, Path]:
    """``eng`` prepared, dumped with stop and reaped (its PIDs free); returns the restore
    hook's environment, its largest pages file and an intact copy of that file."""
    with AgentClient(eng.control) as agent:
        agent.prepare(level=2)
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")
    env = dump_directly(eng.pid, images)
    eng.proc.wait(timeout=scaled(10))
    pages = max(images.glob("pages-*.img"), key=lambda f: f.stat().st_size)
    intact = images.parent / f"{images.name}-{pages.name}"
    shutil.copyfile(pages, intact)
    os.truncate(pages, pages.stat().st_size // 2)
    env.update(CKPT_ACTION="pre-restore", CKPT_RESTORE_FROM=str(images))
    return env, pages, intact


def _left_behind(eng) -> list[str]:
    """What of ``eng`` still runs or holds its ports."""
    left = []
    if psutil.pid_exists(eng.pid) and psutil.Process(eng.pid).status() != "zombie":
        left.append(f"pid {eng.pid}")
    for endpoint in (eng.api, eng.control):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds: past
            try:  # connections in TIME_WAIT do not count, a listener does
                s.bind(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
                s.listen()
            except OSError:  # policy: taken is what this reports
                left.append(endpoint)
    return left


def _restore_serves(eng, env) -> None:
    out = subprocess.run([str(ROOT / "hooks" / "criu-restore")], env=env, capture_output=True,
                         text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stderr
    with AgentClient(eng.control) as agent:
        assert agent.status().restored_from_image
        assert agent.restore().state == "running"
    with EngineClient(eng.api) as api:
        assert api.generate([1, 2, 3], 5).finish_reason == "length"


def test_a_damaged_image_is_refused_at_once_naming_the_file(spawn_reference, monkeypatch):
    """A pages file cut short: criu-restore checks the image against the manifest criu-dump
    wrote and fails at once, naming the image and the file (`criu restore` itself would
    hang); nothing is left running and a restore of the mended image then works."""
    eng = tcp_engine(spawn_reference, "crdamaged")
    images = eng.log_path.parent / "crdamaged-img"
    try:
        env, pages, intact = _stopped_engine_image(eng, images, monkeypatch)
        assert f"./{pages.name}" in (images / "criu-manifest").read_text()
        start = time.monotonic()
        out = subprocess.run([str(ROOT / "hooks" / "criu-restore")], env=env,
                             capture_output=True, text=True, timeout=scaled(60))
        took = time.monotonic() - start
        assert out.returncode == 2 and took < scaled(10), (took, out.stderr)
        assert f"the image in {images} is damaged: ./{pages.name}" in out.stderr
        assert not (images / "restore.log").exists()  # criu never ran
        assert _left_behind(eng) == []
        os.replace(intact, pages)
        _restore_serves(eng, env)
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])


@pytest.mark.slow  # about 10 to 16 s: a dump, a 4 s hook timeout, a restore
def test_a_restore_that_hangs_is_stopped_whole_at_the_hook_timeout(spawn_reference,
                                                                   monkeypatch):
    """The same damage in an image without a manifest (an older criu-dump's) hangs `criu
    restore` with a half-restored engine spinning outside the hook's session: at the hook's
    timeout the runner stops the whole tree, the error names the image and the log's tail,
    and the engine's PID and ports are free for the next restore."""
    from ckpt_controller.controller.hooks import HookContext, run_point
    from ckpt_controller.errors import HookTimeoutError

    eng = tcp_engine(spawn_reference, "crhang")
    images = eng.log_path.parent / "crhang-img"
    try:
        env, pages, intact = _stopped_engine_image(eng, images, monkeypatch)
        (images / "criu-manifest").unlink(missing_ok=True)  # as an older criu-dump left it
        monkeypatch.setenv("CKPT_CRIU", CRIU)
        monkeypatch.setenv("CKPT_RESTORE_FROM", str(images))
        ctx = HookContext(engine=eng.name, pid=eng.pid, state="prepared", generation=1,
                          op_id="hang", image_dir=images, deadline_wall=time.time() + 120)
        hooks = eng.log_path.parent / "crhang-hooks"
        link_hook(hooks, "pre-restore", "10-criu-restore", "criu-restore")
        start, runs = time.monotonic(), []
        with pytest.raises(HookTimeoutError) as info:
            run_point(hooks, "pre-restore", ctx, 4, runs, grace_s=1)
        took = time.monotonic() - start
        (run,) = runs
        assert run.timed_out and took < scaled(4 + 1 + 5), (took, run)
        assert f"while restoring the image in {images}" in info.value.message
        deadline = deadline_in(5)
        while _left_behind(eng) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _left_behind(eng) == []
        assert f"while restoring the image in {images}" in run.stderr_tail
        assert f"last lines of {images}/restore.log" in run.stderr_tail
        assert "restoring it unchecked" in run.stdout_tail
        os.replace(intact, pages)
        _restore_serves(eng, env)
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])


@pytest.mark.slow  # about 30 s: an engine, a capture and two restores through the controller
def test_a_restore_from_a_damaged_image_fails_at_once_and_the_next_one_works(
        spawn_reference, spawn_controller, monkeypatch):
    """Through the controller: the restore of an image whose pages file was cut short fails
    in seconds (the hook timeout is 70 s), naming the image and the file; the engine's PID
    and ports stay free, and once the file is mended the next restore brings it back."""
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")
    eng = tcp_engine(spawn_reference, "crdmgctl")
    try:
        ctl = spawn_controller(config_for(eng))
        link_hooks(ctl, CRIU_HOOKS)
        assert ctl.ckptctl("prepare", eng.name).returncode == 0
        out = ctl.ckptctl("capture", eng.name, "--json", "--op-id", "snap")
        assert out.returncode == 0, out.stdout + out.stderr
        eng.proc.wait(timeout=scaled(10))
        images = ctl.dir / "state" / "images" / eng.name / "snap"
        pages = max(images.glob("pages-*.img"), key=lambda f: f.stat().st_size)
        intact = images.parent / "pages.intact"
        shutil.copyfile(pages, intact)
        os.truncate(pages, pages.stat().st_size // 2)
        start = time.monotonic()
        out = ctl.ckptctl("restore", eng.name, "--json")
        took = time.monotonic() - start
        assert out.returncode == 1 and took < scaled(20), (took, out.stdout + out.stderr)
        (o,) = json.loads(out.stdout)["engines"]
        assert o["status"] == "failed", o
        assert f"the image in {images} is damaged: ./{pages.name}" in o["error"]["message"]
        assert _left_behind(eng) == []
        os.replace(intact, pages)
        out = ctl.ckptctl("restore", eng.name, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        with EngineClient(eng.api) as api:
            assert api.generate([1, 2, 3], 5).finish_reason == "length"
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])
