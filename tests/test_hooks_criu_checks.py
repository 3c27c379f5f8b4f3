"""The criu-dump hook's own checks, before it runs CRIU (no CRIU needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to make a PID namespace")
def test_dump_refuses_a_process_whose_session_leader_is_outside_its_namespace(tmp_path):
    # inside a new PID namespace (with its own /proc), a process that did not setsid belongs to
    # a session led from outside: its session id reads 0 there, and CRIU cannot dump it
    script = (f'sleep 30 & CKPT_ENGINE_PID=$! CKPT_IMAGE_DIR={tmp_path} CKPT_CRIU=/bin/true '
              f'{ROOT / "hooks" / "criu-dump"}; rc=$?; kill $!; exit $rc')
    out = subprocess.run(["setsid", "unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                          script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "session whose leader is outside this PID namespace" in out.stderr
    assert "setsid" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing was written


IO_URING_HOLDER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)  # struct io_uring_params
fd = libc.syscall(425, 8, params)  # io_uring_setup (x86_64)
print(fd, flush=True)
time.sleep(60)
"""


def test_dump_refuses_an_engine_holding_io_uring_and_says_how_to_avoid_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", IO_URING_HOLDER], stdout=subprocess.PIPE,
                              text=True)
    try:
        if int(holder.stdout.readline()) < 0:
            pytest.skip("io_uring is not available here (kernel.io_uring_disabled?)")
        # the "engine" is this process; the holder, its child: the hook looks at the whole tree
        out = subprocess.run([str(ROOT / "hooks" / "criu-dump")], capture_output=True, text=True,
                             timeout=60, env={"PATH": os.environ["PATH"],
                                              "CKPT_ENGINE_PID": str(os.getpid()),
                                              "CKPT_IMAGE_DIR": str(tmp_path),
                                              "CKPT_CRIU": "/bin/true"})
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert out.returncode == 2, out.stdout + out.stderr
    assert "io_uring" in out.stderr and str(holder.pid) in out.stderr
    assert "kernel.io_uring_disabled" in out.stderr
    assert not list(tmp_path.iterdir())


def test_restore_treats_a_zombie_engine_as_gone(tmp_path):
    # a dump that stopped the engine leaves a zombie until its parent reaps it: not "alive"
    zombie = subprocess.Popen(["true"])
    time.sleep(0.5)  # exited, not yet reaped: a zombie
    out = subprocess.run([str(ROOT / "hooks" / "criu-restore")], capture_output=True, text=True,
                         timeout=60, env={"PATH": os.environ["PATH"],
                                          "CKPT_ENGINE_PID": str(zombie.pid),
                                          "CKPT_IMAGE_DIR": str(tmp_path),
                                          "CKPT_CRIU": "/bin/true"})
    zombie.wait()
    assert out.returncode == 2 and "no CRIU image" in out.stderr, out.stdout + out.stderr
