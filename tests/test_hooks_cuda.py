"""The cuda-checkpoint hook's sequence and error handling, against a STAND-IN executable
(``tests/standins/cuda-checkpoint``) that records its calls: there is no GPU on these machines."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
    return subprocess.run([str(HOOK)], env=full, capture_output=True, text=True, timeout=30)


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
    # after a dump that stopped the engine there is nothing to give back
    assert run_hook("post-dump", parent, tmp_path, CKPT_CRIU_MODE="stop", **env).returncode == 0
    assert len(calls(tmp_path)) == 4
    out = run_hook("post-dump", parent, tmp_path, **env)  # leave-running: give the GPU back
    assert calls(tmp_path)[4:] == [f"--action restore --pid {child}",
                                   f"--action unlock --pid {child}"]


def test_a_failing_action_fails_the_hook(engine_tree, tmp_path):
    parent, child = engine_tree
    out = run_hook("dump", parent, tmp_path, STANDIN_CUDA_PIDS=str(child),
                   STANDIN_FAIL_ACTION="checkpoint")
    assert out.returncode == 1
    assert f"'checkpoint' failed for pid {child}" in out.stderr
    assert calls(tmp_path) == [f"--action lock --pid {child}",
                               f"--action checkpoint --pid {child}"]


def test_no_gpu_no_binary_no_cuda_process(engine_tree, tmp_path):
    parent, _ = engine_tree
    out = run_hook("dump", parent, tmp_path, STANDIN_CUDA_PIDS="")
    assert out.returncode == 0 and "no CUDA process" in out.stdout
    env = dict(os.environ, CKPT_ACTION="dump", CKPT_ENGINE_PID=str(parent),
               CKPT_CUDA_CHECKPOINT=str(STANDIN), CKPT_CUDA_DEVICE=str(tmp_path / "none"))
    out = subprocess.run([str(HOOK)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "no NVIDIA GPU" in out.stdout
    env = dict(os.environ, CKPT_ACTION="dump", CKPT_ENGINE_PID=str(parent), PATH="/usr/bin:/bin")
    env.pop("CKPT_CUDA_CHECKPOINT", None)
    out = subprocess.run([str(HOOK)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "no cuda-checkpoint binary" in out.stdout
