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


def ctx(tmp_path: Path, **kw) -> HookContext:
    image = tmp_path / "image"
    image.mkdir(mode=0o700, exist_ok=True)
    base = dict(engine="e1", pid=os.getpid(), state="prepared", generation=3, op_id="op-42",
                image_dir=image, deadline_wall=time.time() + 60)
    return HookContext(**{**base, **kw})


def hook(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_hooks_run_in_name_order_and_the_first_failure_stops_the_point(tmp_path):
    log = tmp_path / "order.log"
    hooks = tmp_path / "hooks"
    for name in ("30-c", "10-a", "20-b"):
        hook(hooks / "dump", name, f'echo "$(basename "$0")" >> {log}')
    runs = []
    run_point(hooks, "dump", ctx(tmp_path), 10, runs)
    assert log.read_text().split() == ["10-a", "20-b", "30-c"]
    log.unlink()
    hook(hooks / "dump", "20-b", f'echo "$(basename "$0")" >> {log}; exit 4')
    runs = []
    with pytest.raises(HookError) as info:
        run_point(hooks, "dump", ctx(tmp_path), 10, runs)
    assert log.read_text().split() == ["10-a", "20-b"]  # 30-c never ran
    assert info.value.details["exit_code"] == 4 and len(runs) == 2


def test_a_hook_deaf_to_sigterm_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    path = hook(tmp_path / "hooks" / "dump", "10-deaf",
                f"trap '' TERM\nsleep 300 &\necho $! > {pidfile}\nwhile :; do sleep 1; done")
    start = time.monotonic()
    run = run_hook(path, "dump", ctx(tmp_path), timeout_s=0.5, grace_s=0.5)
    took = time.monotonic() - start
    assert run.timed_out and run.exit_code != 0
    assert took < 5  # SIGKILL after the grace, not the hook's own end
    child = int(pidfile.read_text())
    time.sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


@pytest.mark.parametrize("where", ["hook", "point folder", "hooks folder"])
@pytest.mark.parametrize("mode", [0o020, 0o002])  # group-writable, world-writable
def test_a_hook_anyone_else_may_change_is_refused(tmp_path, where, mode):
    ran = tmp_path / "ran"
    path = hook(tmp_path / "hooks" / "dump", "10-ok", f"touch {ran}")
    target = {"hook": path, "point folder": path.parent, "hooks folder": path.parent.parent}
    target[where].chmod(target[where].stat().st_mode | mode)
    with pytest.raises(ConfigError) as info:
        run_point(tmp_path / "hooks", "dump", ctx(tmp_path), 10, [])
    assert "writable by group or others" in info.value.message
    assert info.value.details["path"] == str(target[where]) and not ran.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_hook_folder_owned_by_another_user_is_refused(tmp_path):
    path = hook(tmp_path / "hooks" / "dump", "10-ok", "true")
    os.chown(path.parent, 65534, 65534)  # nobody
    with pytest.raises(ConfigError) as info:
        run_point(tmp_path / "hooks", "dump", ctx(tmp_path), 10, [])
    assert "owned by another user" in info.value.message and info.value.details["owner"] == 65534


def test_the_grace_period_is_the_configured_one(tmp_path):
    hooks = tmp_path / "hooks"
    hook(hooks / "dump", "10-deaf", "trap '' TERM\nwhile :; do sleep 0.1; done")
    for grace in (0.2, 2.0):
        runs = []
        start = time.monotonic()
        with pytest.raises(HookTimeoutError):
            run_point(hooks, "dump", ctx(tmp_path), 0.3, runs, grace_s=grace)
        took = time.monotonic() - start
        assert runs[0].timed_out and 0.3 + grace <= took < 0.3 + grace + 1.5, (grace, took)


def test_the_environment_contract(tmp_path):
    out = tmp_path / "env.txt"
    path = hook(tmp_path / "hooks" / "dump", "10-env", f"env > {out}; pwd >> {out}")
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


def test_output_tails_keep_the_last_bytes(tmp_path):
    path = hook(tmp_path / "hooks" / "post-dump", "10-loud",
                "i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done\necho oops >&2")
    run = run_hook(path, "post-dump", ctx(tmp_path), timeout_s=10)
    assert len(run.stdout_tail.encode()) == TAIL_BYTES
    assert run.stdout_tail.endswith("line-1999\n") and run.stderr_tail == "oops\n"
