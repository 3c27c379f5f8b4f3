"""The criu-dump hook's own checks, before it runs CRIU (no CRIU needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
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
