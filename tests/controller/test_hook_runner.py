"""The hook runner on its own: order at a point, the first failure stopping it, the timeout's
SIGTERM-grace-SIGKILL on the whole process group, the environment contract and output tails."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from ckpt_controller.controller.hooks import TAIL_BYTES, HookContext, run_hook, run_point
from ckpt_controller.errors import ConfigError, HookError, HookTimeoutError
from support import ROOT
from support.hooks import write_hook
from support.processes import gone
from support.timing import deadline_in, scaled, wait_until


def ctx(tmp_path: Path, **kw) -> HookContext:
    image = tmp_path / "image"
    image.mkdir(mode=0o700, exist_ok=True)
    base = dict(engine="e1", pid=os.getpid(), state="prepared", generation=3, op_id="op-42",
                image_dir=image, deadline_wall=time.time() + 60)
    return HookContext(**{**base, **kw})


def test_hooks_run_in_name_order_and_the_first_failure_stops_the_point(tmp_path):
    log = tmp_path / "order.log"
    hooks = tmp_path / "hooks"
    for name in ("30-c", "10-a", "20-b"):
        write_hook(hooks, "dump", name, f'echo "$(basename "$0")" >> {log}')
    runs = []
    run_point(hooks, "dump", ctx(tmp_path), 10, runs)
    assert log.read_text().split() == ["10-a", "20-b", "30-c"]
    log.unlink()
    write_hook(hooks, "dump", "20-b", f'echo "$(basename "$0")" >> {log}; exit 4')
    runs = []
    with pytest.raises(HookError) as info:
        run_point(hooks, "dump", ctx(tmp_path), 10, runs)
    assert log.read_text().split() == ["10-a", "20-b"]  # 30-c never ran
    assert info.value.details["exit_code"] == 4 and len(runs) == 2


def test_a_hook_deaf_to_sigterm_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    path = write_hook(tmp_path / "hooks", "dump", "10-deaf",
                      f"trap '' TERM\nsleep 300 &\necho $! > {pidfile}\nwhile :; do sleep 1; done")
    start = time.monotonic()
    run = run_hook(path, "dump", ctx(tmp_path), timeout_s=0.5, grace_s=0.5)
    took = time.monotonic() - start
    assert run.timed_out and run.exit_code != 0
    assert took < scaled(5)  # SIGKILL after the grace, not the hook's own end
    child = int(pidfile.read_text())
    wait_until(lambda: gone(child), 5, f"the hook's child {child} gone")


@pytest.mark.parametrize("where", ["hook", "point folder", "hooks folder"])
@pytest.mark.parametrize("mode", [0o020, 0o002])  # group-writable, world-writable
def test_a_hook_anyone_else_may_change_is_refused(tmp_path, where, mode):
    ran = tmp_path / "ran"
    path = write_hook(tmp_path / "hooks", "dump", "10-ok", f"touch {ran}")
    target = {"hook": path, "point folder": path.parent, "hooks folder": path.parent.parent}
    target[where].chmod(target[where].stat().st_mode | mode)
    with pytest.raises(ConfigError) as info:
        run_point(tmp_path / "hooks", "dump", ctx(tmp_path), 10, [])
    assert "writable by group or others" in info.value.message
    assert info.value.details["path"] == str(target[where]) and not ran.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_hook_folder_owned_by_another_user_is_refused(tmp_path):
    path = write_hook(tmp_path / "hooks", "dump", "10-ok", "true")
    os.chown(path.parent, 65534, 65534)  # nobody
    with pytest.raises(ConfigError) as info:
        run_point(tmp_path / "hooks", "dump", ctx(tmp_path), 10, [])
    assert "owned by another user" in info.value.message and info.value.details["owner"] == 65534


def test_the_grace_period_is_the_configured_one(tmp_path):
    hooks = tmp_path / "hooks"
    write_hook(hooks, "dump", "10-deaf", "trap '' TERM\nwhile :; do sleep 0.1; done")
    for grace in (0.2, 2.0):
        runs = []
        start = time.monotonic()
        with pytest.raises(HookTimeoutError):
            run_point(hooks, "dump", ctx(tmp_path), 0.3, runs, grace_s=grace)
        took = time.monotonic() - start
        # the grace given, not the default 5 s
        limit = scaled(0.3 + grace + 1.5, below=0.3 + 5.0)
        assert runs[0].timed_out and 0.3 + grace <= took < limit, (grace, took)


def test_the_environment_contract(tmp_path):
    out = tmp_path / "env.txt"
    path = write_hook(tmp_path / "hooks", "dump", "10-env", f"env > {out}; pwd >> {out}")
    c = ctx(tmp_path)
    run = run_hook(path, "dump", c, timeout_s=10)
    assert run.exit_code == 0
    lines = out.read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    assert env["CKPT_ACTION"] == "dump" and env["CKPT_ENGINE"] == "e1"
    assert env["CKPT_ENGINE_PID"] == env["CRTOOLS_INIT_PID"] == str(os.getpid())
    assert env["CKPT_STATE"] == "prepared" and env["CKPT_GENERATION"] == "3"
    assert env["CKPT_OP_ID"] == "op-42" and env["CKPT_IMAGE_DIR"] == str(c.image_dir)
    assert abs(float(env["CKPT_DEADLINE"]) - c.deadline_wall) < 0.01
    assert env["CRTOOLS_SCRIPT_ACTION"] == "pre-dump"  # CRIU's name for the dump point
    assert "CKPT_UNDO_CAPTURE" not in env
    assert lines[-1] == str(c.image_dir)  # the image directory is the working directory
    assert (c.image_dir.stat().st_mode & 0o777) == 0o700


def test_crtools_script_action_only_where_the_moment_is_crius(tmp_path, monkeypatch):
    """CRIU's post-dump runs with the tree frozen, its post-restore with the tree stopped:
    none of our points is there, so only ``dump`` (CRIU's pre-dump moment) says an action,
    also when the controller's own environment had one; the CRIU action scripts go to the
    points where the shipped hooks run CRIU."""
    import dataclasses

    from ckpt_controller.controller.hooks import hook_env

    monkeypatch.setenv("CRTOOLS_SCRIPT_ACTION", "post-restore")  # a controller run by CRIU
    # scripts no check saw, in the controller's environment: never handed on
    monkeypatch.setenv("CKPT_CRIU_ACTION_SCRIPTS", "/tmp/not-checked")
    c = dataclasses.replace(ctx(tmp_path), criu_action_scripts=("/a/one", "/b/two"))
    for point in ("pre-prepare", "post-drain", "post-release", "dump", "post-dump",
                  "pre-restore", "post-restore", "post-resume", "on-fail"):
        env = hook_env(point, c)
        assert env.get("CRTOOLS_SCRIPT_ACTION") == ("pre-dump" if point == "dump" else None)
        assert env["CRTOOLS_INIT_PID"] == str(c.pid)
        scripts = env.get("CKPT_CRIU_ACTION_SCRIPTS")
        assert scripts == ("/a/one\n/b/two" if point in ("dump", "pre-restore") else None)
    c = dataclasses.replace(c, criu_action_scripts=())
    assert "CKPT_CRIU_ACTION_SCRIPTS" not in hook_env("dump", c)


def test_an_action_script_path_with_a_line_break_is_refused(tmp_path):
    from ckpt_controller.controller.hooks import action_scripts

    odd = tmp_path / "a\nb"
    odd.write_text("#!/bin/sh\n")
    odd.chmod(0o755)
    with pytest.raises(ConfigError) as caught:
        action_scripts([odd])
    assert "criu_action_scripts[0]" in caught.value.message and "line break" in \
        caught.value.message


def test_an_operations_own_hook_settings_reach_its_hooks_and_only_known_ones_pass(tmp_path):
    """``OperationCommand.hook_env`` (a migration's stop-and-stay dump) is added to the hooks'
    environment; a key outside ``values.HookEnvKey`` or a value with a shell's characters is
    refused before anything runs."""
    import dataclasses

    import msgspec

    from ckpt_controller import protocol as p

    out = tmp_path / "env.txt"
    path = write_hook(tmp_path / "hooks", "dump", "10-env", f"env > {out}")
    cmd = msgspec.convert({"call_id": 1, "op_id": "m1", "kind": "capture", "hook_env": {
        "CKPT_CRIU_MODE": "leave-stopped", "CKPT_PAGE_SERVER": "169.254.77.2:7000"}},
        p.OperationCommand)
    c = dataclasses.replace(ctx(tmp_path), extra_env=tuple(sorted(cmd.hook_env.items())))
    assert run_hook(path, "dump", c, timeout_s=10).exit_code == 0
    env = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert env["CKPT_CRIU_MODE"] == "leave-stopped"
    assert env["CKPT_PAGE_SERVER"] == "169.254.77.2:7000" and env["CKPT_ACTION"] == "dump"
    for bad in ({"CKPT_CRIU_EXTRA": "--x"}, {"CKPT_CRIU_MODE": "stop; rm -rf /"},
                {"CKPT_RESTORE_FROM": "/tmp/x"}, {"CKPT_CRIU_MODE": "x" * 300}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"call_id": 1, "op_id": "m1", "kind": "capture", "hook_env": bad},
                            p.OperationCommand)


def test_output_tails_keep_the_last_bytes(tmp_path):
    path = write_hook(tmp_path / "hooks", "post-dump", "10-loud",
                      "i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done\n"
                      "echo oops >&2")
    run = run_hook(path, "post-dump", ctx(tmp_path), timeout_s=10)
    assert len(run.stdout_tail.encode()) == TAIL_BYTES
    assert run.stdout_tail.endswith("line-1999\n") and run.stderr_tail == "oops\n"


# ------------------------------------------------- what a hook starts, even when it detaches

# a process the hook starts in a session of its own, through a parent that exits at once (as
# `criu restore --restore-detached` leaves a restored tree): it escapes the hook's process
# group, and without the hook being a subreaper it would be reparented to init
DETACH = ("( setsid sh -c 'trap \"\" TERM; echo $$ > {pidfile}; "
          "while :; do sleep 0.1; done' & )\n"
          "while [ ! -s {pidfile} ]; do sleep 0.05; done\n")


def _detached(pidfile: Path) -> psutil.Process:
    return psutil.Process(int(pidfile.read_text()))


def _gone(proc: psutil.Process, within_s: float = 3.0) -> bool:
    deadline = deadline_in(within_s)
    while time.monotonic() < deadline:
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def detached_pidfile(tmp_path):
    pidfile = tmp_path / "detached.pid"
    yield pidfile
    try:
        proc = _detached(pidfile)
        if "sleep 0.1" in " ".join(proc.cmdline()):  # still the one a test started
            proc.kill()
    except (OSError, ValueError, psutil.Error):  # policy: never started, or gone: nothing to do
        pass


def test_a_detached_tree_is_killed_whole_at_the_timeout(tmp_path, detached_pidfile):
    path = write_hook(tmp_path / "hooks", "pre-restore", "10-hang",
                      DETACH.format(pidfile=detached_pidfile) + "sleep 300")
    start = time.monotonic()
    run = run_hook(path, "pre-restore", ctx(tmp_path), timeout_s=1.0, grace_s=0.5)
    assert run.timed_out and time.monotonic() - start < scaled(5)
    detached = _detached(detached_pidfile)
    assert _gone(detached)  # deaf to SIGTERM: SIGKILLed after the grace
    said = run.stderr_tail.split("detached ones included:")[1]
    assert str(detached.pid) in said.split("]")[0].split()


def test_what_a_failed_hook_leaves_running_is_ended(tmp_path, detached_pidfile):
    path = write_hook(tmp_path / "hooks", "pre-restore", "10-fail",
                      DETACH.format(pidfile=detached_pidfile) + "sleep 0.6; exit 3")
    run = run_hook(path, "pre-restore", ctx(tmp_path), timeout_s=30, grace_s=0.5)
    assert run.exit_code == 3 and not run.timed_out
    assert _gone(_detached(detached_pidfile))
    assert str(_detached(detached_pidfile).pid) in run.stderr_tail.split("included:")[1]


def test_what_a_good_hook_starts_is_left_running(tmp_path, detached_pidfile):
    # a restored engine is such a process: it must outlive the criu-restore hook
    path = write_hook(tmp_path / "hooks", "pre-restore", "10-ok",
                      DETACH.format(pidfile=detached_pidfile) + "sleep 0.6")
    run = run_hook(path, "pre-restore", ctx(tmp_path), timeout_s=30, grace_s=0.5)
    assert run.exit_code == 0
    assert not _gone(_detached(detached_pidfile), within_s=1.0)


# ------------------------------------------------------------------------- symlinked hooks

def _linked_hook(tmp_path: Path, target_folder: Path) -> tuple[Path, Path]:
    """A hook at ``target_folder/hook``, linked from the dump point; returns (target, ran)."""
    ran = tmp_path / "ran"
    target = write_hook(target_folder.parent, target_folder.name, "hook", f"touch {ran}")
    (tmp_path / "hooks" / "dump").mkdir(parents=True)
    (tmp_path / "hooks" / "dump" / "10-linked").symlink_to(target)
    return target, ran


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])  # sticky is no excuse for a hook's
def test_a_linked_hook_whose_folder_others_may_write_is_refused(tmp_path, mode):  # own folder
    target, ran = _linked_hook(tmp_path, tmp_path / "open")
    target.parent.chmod(mode)
    with pytest.raises(ConfigError) as info:
        run_point(tmp_path / "hooks", "dump", ctx(tmp_path), 10, [])
    assert "writable by group or others" in info.value.message
    assert info.value.details["path"] == str(target.parent) and not ran.exists()


def test_a_linked_hook_below_a_folder_others_may_write_is_refused(tmp_path):
    # whoever may write in `open` may rename `safe` away and put another in its place
    target, ran = _linked_hook(tmp_path, tmp_path / "open" / "safe")
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(ConfigError) as info:
        run_point(tmp_path / "hooks", "dump", ctx(tmp_path), 10, [])
    assert info.value.details["path"] == str(tmp_path / "open") and not ran.exists()


def test_a_link_on_the_way_that_others_may_replace_is_refused(tmp_path):
    # dump/10-linked -> relay/link -> safe/hook: relay is world-writable, so its link is not
    target, ran = _linked_hook(tmp_path, tmp_path / "safe")
    relay = tmp_path / "relay"
    relay.mkdir(mode=0o777)
    relay.chmod(0o777)
    (relay / "link").symlink_to(target)
    (tmp_path / "hooks" / "dump" / "10-linked").unlink()
    (tmp_path / "hooks" / "dump" / "10-linked").symlink_to(relay / "link")
    with pytest.raises(ConfigError) as info:
        run_point(tmp_path / "hooks", "dump", ctx(tmp_path), 10, [])
    assert info.value.details["path"] == str(relay) and not ran.exists()


def test_a_linked_hook_in_a_safe_folder_runs_even_below_a_sticky_one(tmp_path):
    # a sticky folder on the way (as /tmp): nobody may rename what is ours in it
    target, ran = _linked_hook(tmp_path, tmp_path / "sticky" / "mine")
    (tmp_path / "sticky").chmod(0o1777)
    runs = []
    run_point(tmp_path / "hooks", "dump", ctx(tmp_path), 10, runs)
    assert ran.exists() and runs[0].exit_code == 0
    assert runs[0].path == str(tmp_path / "hooks" / "dump" / "10-linked")


def test_a_failed_hooks_error_says_what_the_hook_said_first(tmp_path):
    hooks = tmp_path / "hooks"
    write_hook(hooks, "pre-restore", "10-say", "echo 'the image in /srv/img is damaged' >&2\n"
                                          "echo 'more detail' >&2; exit 4")
    with pytest.raises(HookError) as info:
        run_point(hooks, "pre-restore", ctx(tmp_path), 10, [])
    assert info.value.message == \
        "pre-restore hook 10-say exited 4: the image in /srv/img is damaged"
    write_hook(hooks, "pre-restore", "10-say", "echo 'stuck restoring /srv/img' >&2; sleep 30")
    with pytest.raises(HookTimeoutError) as info:
        run_point(hooks, "pre-restore", ctx(tmp_path), 0.5, [], grace_s=0.5)
    assert info.value.message == "pre-restore hook 10-say timed out: stuck restoring /srv/img"


def test_a_detached_tree_left_by_a_killed_controller_is_stopped_by_the_next(tmp_path,
                                                                            detached_pidfile):
    # the "controller" is a real process running the hook; it is killed -9 mid-hook, and the
    # next one stops what the hook started, the part that left its session included
    import subprocess
    import sys

    from ckpt_controller.controller.hooks import stop_orphan_hooks

    path = write_hook(tmp_path / "hooks", "pre-restore", "10-hang",
                      DETACH.format(pidfile=detached_pidfile) + "sleep 300")
    c = ctx(tmp_path)
    runner = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path\n"
        "from ckpt_controller.controller.hooks import HookContext, run_hook\n"
        f"ctx = HookContext(engine='e1', pid=None, state='restoring', generation=1, "
        f"op_id='op-42', image_dir=Path({str(c.image_dir)!r}), deadline_wall=time.time() + 300)\n"
        f"run_hook(Path({str(path)!r}), 'pre-restore', ctx, timeout_s=300)\n")],
        cwd=ROOT)
    try:
        deadline = deadline_in(30)
        while not detached_pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the runner has looked at the hook's tree since
        detached = _detached(detached_pidfile)
        (pidfile,) = c.image_dir.glob(".hook-pre-restore-*.pid")
        hook_pid = int(pidfile.read_text().split()[0])
    finally:
        runner.kill()
        runner.wait()
    hook_proc = psutil.Process(hook_pid)
    assert hook_proc.is_running() and detached.is_running()  # both outlived the controller
    assert stop_orphan_hooks(tmp_path, "image", grace_s=0.5) == 1
    assert _gone(hook_proc) and _gone(detached)
    assert not list(c.image_dir.glob(".hook-*.pid"))


def test_a_hook_that_is_not_executable_is_refused_not_skipped(tmp_path):
    hooks = tmp_path / "hooks"
    ran = tmp_path / "ran"
    write_hook(hooks, "dump", "10-ok", f"touch {ran}")
    forgotten = write_hook(hooks, "dump", "20-criu-dump", "exit 0")
    forgotten.chmod(0o644)  # installed without chmod +x: it would silently capture nothing
    with pytest.raises(ConfigError) as info:
        run_point(hooks, "dump", ctx(tmp_path), 10, [])
    assert "not an executable file" in info.value.message
    assert info.value.details["path"] == str(forgotten)
    assert not ran.exists()  # refused before any hook of the point ran
    (hooks / "dump" / "README.md").write_text("notes, not a hook\n")  # still let be
    forgotten.chmod(0o755)
    run_point(hooks, "dump", ctx(tmp_path), 10, [])
    assert ran.exists()


def test_a_hook_pidfile_is_never_seen_empty_or_half_written(tmp_path):
    """The runner rewrites a hook's pidfile as its tree grows; a controller killed mid-write,
    or the next one reading it, must find a whole record, or that hook runs on unseen."""
    import threading

    from ckpt_controller.controller.hooks import write_pidfile

    pidfile = tmp_path / ".hook-dump-4242.pid"
    write_pidfile(pidfile, "4242\n")
    seen: set[str] = set()
    stop = threading.Event()

    def read():
        while not stop.is_set():
            seen.add(pidfile.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(3000):
            write_pidfile(pidfile, f"4242\n{i} 1.0\n")
    finally:
        stop.set()
        reader.join()
    assert len(seen) > 1 and all(text.startswith("4242\n") for text in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == [pidfile.name]


def test_a_hook_whose_controller_is_killed_gets_sigterm(tmp_path):
    """A controller killed -9 while a hook runs (systemd's KillMode=process leaves the hook
    alive): the hook gets SIGTERM, as at its timeout, so criu-restore stops its criu instead
    of restoring a copy no controller follows (a vLLM copy once came up beside its stopped
    source that way and broke it)."""
    import subprocess
    import sys

    hooks = tmp_path / "hooks"
    marker = tmp_path / "told"
    write_hook(hooks, "pre-restore", "10-long",
               f'trap "echo SIGTERM > {marker}; exit 143" TERM\n'
               f'echo started > {tmp_path}/started\nsleep 120 & wait')
    image = tmp_path / "image"
    image.mkdir(mode=0o700)
    code = ("import os, sys, time\n"
            "from pathlib import Path\n"
            "from ckpt_controller.controller.hooks import HookContext, run_point\n"
            f"c = HookContext(engine='e1', pid=os.getpid(), state='prepared', generation=0, "
            f"op_id='op', image_dir=Path({str(image)!r}), deadline_wall=time.time() + 300)\n"
            f"run_point(Path({str(hooks)!r}), 'pre-restore', c, 300, [])\n")
    controller = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        wait_until(lambda: (tmp_path / "started").exists(), timeout_s=30,
                   what="the hook running")
        controller.kill()
        controller.wait()
        wait_until(marker.exists, timeout_s=10, what="the hook told SIGTERM")
        assert marker.read_text().strip() == "SIGTERM"
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()


def test_a_hooks_end_is_seen_when_it_happens_not_at_the_next_poll(tmp_path, monkeypatch):
    """The runner waits for a hook through a pidfd, woken by the exit itself: never through
    ``Popen.wait(timeout)``, whose sleeps grow to 50 ms and made each hook's end (a dump's, a
    restore's: the engine's downtime) seen up to 50 ms late."""
    import subprocess

    from ckpt_controller import procutil

    polled = []
    real_wait = subprocess.Popen.wait

    def wait(self, timeout=None):
        if timeout is not None:
            polled.append(timeout)
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", wait)
    hooks = tmp_path / "hooks"
    write_hook(hooks, "dump", "10-slow", "sleep 0.6; exit 3")  # past one LOOK_EVERY_S round
    runs = []
    with pytest.raises(HookError):
        run_point(hooks, "dump", ctx(tmp_path), 10, runs)
    assert runs[0].exit_code == 3 and polled == []
    # on its own: a process still running is not waited for past the timeout and is left
    # running; an ended one is reaped, its status read
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert procutil.ended_within(proc, 0.05) is False and proc.returncode is None
    finally:
        proc.kill()
    assert procutil.ended_within(proc, scaled(10)) is True and proc.returncode == -9
    assert polled == []


def test_a_hook_that_reads_crtools_script_action_where_it_is_no_longer_set_is_named(tmp_path):
    from ckpt_controller.controller.hooks import crtools_readers

    hooks = tmp_path / "hooks"
    write_hook(hooks, "dump", "10-criu-like", 'echo "$CRTOOLS_SCRIPT_ACTION"')  # still set
    old = write_hook(hooks, "post-dump", "10-old", '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ]')
    write_hook(hooks, "post-dump", "20-plain", "exit 0")
    assert crtools_readers(hooks) == [old]

