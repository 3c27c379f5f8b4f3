"""The cuda-checkpoint hook's sequence and error handling, against a STAND-IN executable
(``tests/standins/cuda-checkpoint``) that records its calls: there is no GPU on these machines."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT
from support.config import engines_toml
from support.timing import scaled


HOOK = ROOT / "hooks" / "cuda-checkpoint"
STANDIN = ROOT / "tests" / "standins" / "cuda-checkpoint"


@pytest.fixture
def engine_tree():
    """A parent process with one child: the child plays the CUDA process."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "c = subprocess.Popen([sys.executable, '-c', "
                               "'import time; time.sleep(60)']); "
                               "print(c.pid, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.1)
    yield parent.pid, child
    os.kill(child, 9)
    parent.kill()
    parent.wait()
    parent.stdout.close()


def run_hook(action: str, pid: int, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    (tmp_path / "nvidia0").touch()
    full = dict(os.environ, CKPT_ACTION=action, CKPT_ENGINE_PID=str(pid),
                CKPT_CUDA_CHECKPOINT=str(STANDIN), CKPT_CUDA_DEVICE=str(tmp_path / "nvidia0"),
                STANDIN_LOG=str(tmp_path / "calls.log"), **env)
    return subprocess.run([str(HOOK)], env=full, capture_output=True, text=True, timeout=scaled(30))


def calls(tmp_path: Path) -> list[str]:
    return [c for c in (tmp_path / "calls.log").read_text().splitlines()
            if not c.startswith("--get-state")]


def test_sequence_around_dump_and_restore(engine_tree, tmp_path):
    parent, child = engine_tree
    env = {"STANDIN_CUDA_PIDS": str(child)}
    out = run_hook("dump", parent, tmp_path, **env)
    assert out.returncode == 0, out.stderr
    assert calls(tmp_path) == [f"--action lock --pid {child}", f"--action checkpoint --pid {child}"]
    out = run_hook("pre-restore", parent, tmp_path, **env)
    assert out.returncode == 0
    assert calls(tmp_path)[2:] == [f"--action restore --pid {child}",
                                   f"--action unlock --pid {child}"]
    # giving back goes by state: a process already on its GPU is left alone
    out = run_hook("pre-restore", parent, tmp_path, **env)
    assert out.returncode == 0 and "already runs on its GPU" in out.stdout
    assert len(calls(tmp_path)) == 4
    assert run_hook("dump", parent, tmp_path, **env).returncode == 0
    # after a dump that stopped the engine there is nothing to give back
    assert run_hook("post-dump", parent, tmp_path, CKPT_CRIU_MODE="stop", **env).returncode == 0
    assert len(calls(tmp_path)) == 6
    out = run_hook("post-dump", parent, tmp_path, **env)  # leave-running: give the GPU back
    assert calls(tmp_path)[6:] == [f"--action restore --pid {child}",
                                   f"--action unlock --pid {child}"]


def test_a_failing_dump_step_gives_back_what_it_took(engine_tree, tmp_path):
    parent, child = engine_tree
    out = run_hook("dump", parent, tmp_path, STANDIN_CUDA_PIDS=str(child),
                   STANDIN_FAIL_ACTION="checkpoint")
    assert out.returncode == 1
    assert f"'checkpoint' failed for pid {child}" in out.stderr
    assert calls(tmp_path) == [f"--action lock --pid {child}",
                               f"--action checkpoint --pid {child}",
                               f"--action unlock --pid {child}"]  # not left locked


def test_a_failure_on_the_second_process_gives_back_the_first(tmp_path):
    """Two CUDA processes: the first is checkpointed, locking the second fails; the first
    gets its GPU back (restore, unlock) before the hook fails."""
    script = ("import subprocess, sys, time; cs = [subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(60)']) for _ in range(2)]; "
              "print(*[c.pid for c in cs], flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    first, second = map(int, parent.stdout.readline().split())
    try:
        time.sleep(0.1)
        out = run_hook("dump", parent.pid, tmp_path, STANDIN_CUDA_PIDS=f"{first} {second}",
                       STANDIN_FAIL_ACTION="lock", STANDIN_FAIL_PID=str(second))
        assert out.returncode == 1
        assert calls(tmp_path) == [f"--action lock --pid {first}",
                                   f"--action checkpoint --pid {first}",
                                   f"--action lock --pid {second}",
                                   f"--action restore --pid {first}",
                                   f"--action unlock --pid {first}"]
    finally:
        for pid in (first, second):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_no_gpu_no_binary_no_cuda_process(engine_tree, tmp_path):
    parent, _ = engine_tree
    out = run_hook("dump", parent, tmp_path, STANDIN_CUDA_PIDS="")
    assert out.returncode == 0 and "no CUDA process" in out.stdout
    env = dict(os.environ, CKPT_ACTION="dump", CKPT_ENGINE_PID=str(parent),
               CKPT_CUDA_CHECKPOINT=str(STANDIN), CKPT_CUDA_DEVICE=str(tmp_path / "none"))
    out = subprocess.run([str(HOOK)], env=env, capture_output=True, text=True, timeout=scaled(30))
    assert out.returncode == 0 and "no NVIDIA GPU" in out.stdout
    env = dict(os.environ, CKPT_ACTION="dump", CKPT_ENGINE_PID=str(parent), PATH="/usr/bin:/bin")
    env.pop("CKPT_CUDA_CHECKPOINT", None)
    out = subprocess.run([str(HOOK)], env=env, capture_output=True, text=True, timeout=scaled(30))
    assert out.returncode == 0 and "no cuda-checkpoint binary" in out.stdout


def test_a_capture_that_fails_after_the_gpu_was_taken_gives_it_back(
        spawn_reference, spawn_controller, monkeypatch, tmp_path):
    """cuda-checkpoint at dump/05 takes the engine's GPU (stand-in), then the CRIU dump at
    dump/10 fails: before the rollback the controller runs pre-restore with
    CKPT_UNDO_CAPTURE=1, cuda-checkpoint hands the GPU back, and the engine serves again."""
    import json

    from ckpt_controller.engine.client import EngineClient

    eng = spawn_reference("gpu")
    (tmp_path / "nvidia0").touch()
    for key, value in {"CKPT_CUDA_CHECKPOINT": str(STANDIN),
                       "CKPT_CUDA_DEVICE": str(tmp_path / "nvidia0"),
                       "STANDIN_LOG": str(tmp_path / "calls.log"),
                       "STANDIN_CUDA_PIDS": str(eng.pid)}.items():
        monkeypatch.setenv(key, value)  # the controller's environment reaches its hooks
    ctl = spawn_controller(engines_toml(("gpu", eng.control)))
    for point, name, target in (("dump", "05-cuda-checkpoint", HOOK),
                                ("pre-restore", "20-cuda-checkpoint", HOOK),
                                ("pre-restore", "10-criu-restore", ROOT / "hooks" / "criu-restore")):
        folder = ctl.dir / "hooks" / point
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(target)
    failing = ctl.dir / "hooks" / "dump" / "10-criu-dump"
    failing.write_text("#!/bin/sh\necho 'dump failed (test)' >&2\nexit 1\n")
    failing.chmod(0o755)
    out = ctl.ckptctl("cycle", "gpu", "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["status"] == "rolled_back" and o["state"] == "running", o
    assert calls(tmp_path) == [f"--action lock --pid {eng.pid}",
                               f"--action checkpoint --pid {eng.pid}",
                               f"--action restore --pid {eng.pid}",
                               f"--action unlock --pid {eng.pid}"]
    undo = [h for h in o["hooks"] if h["point"] == "pre-restore"]
    assert [h["path"].rsplit("/", 1)[-1] for h in undo] == ["10-criu-restore",
                                                            "20-cuda-checkpoint"]
    assert "nothing to restore" in undo[0]["stdout_tail"]
    with EngineClient(eng.api) as api:
        assert api.generate([1, 2, 3], 4).finish_reason == "length"
