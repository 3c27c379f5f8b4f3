"""A copy restored beside its stopped original has a /dev/shm of its own.

CRIU names a file in /dev/shm that a process maps (vLLM's shared-memory queues, ``psm_*``) by
its path, so a copy restored next to the original (``CKPT_CRIU_BESIDE=1``, a migration between
two nodes of one host) mapped the very same memory: once the original was resumed (the move
abandoned), both wrote each other's queues, and a vLLM so moved and rolled back died with a
``KeyError`` in its worker. ``criu-dump`` lists the tree's /dev/shm files with the image
(``criu-shm-files``) and ``criu-restore`` gives such a copy a private tmpfs on /dev/shm in a
mount namespace of its own, holding copies of them taken while the original is stopped.

A small Python process stands in for vLLM: PID 1 of its own PID namespace, it writes a counter
into a /dev/shm file it maps, every 20 ms. Needs root, unshare and CRIU (``make criu``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from support import ROOT
from support.criu import CRIU, criu_missing, required
from support.timing import scaled, wait_until

_reason = required(criu_missing(), "the CRIU tests") or (
    None if shutil.which("unshare") else "no unshare here (util-linux)")
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

#: maps the /dev/shm file argv[1] and counts in its first 8 bytes, every 20 ms
_COUNTER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20)
n = 0
while True:
    n += 1
    mm[0:8] = n.to_bytes(8, "little")
    time.sleep(0.02)
"""


def _count(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def _hook(name: str, images: Path, pid: int, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "hooks" / name)], capture_output=True, text=True,
                          timeout=scaled(120),
                          env={**os.environ, "CKPT_CRIU": CRIU, "CKPT_ENGINE_PID": str(pid),
                               "CKPT_IMAGE_DIR": str(images), **env})


def test_a_copy_restored_beside_its_original_gets_its_own_shared_memory(tmp_path):
    shm = Path("/dev/shm") / f"psm_ckpt_test_{uuid.uuid4().hex[:8]}"
    launcher = subprocess.Popen(
        ["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", _COUNTER, str(shm)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    copy_pid = kid = None
    try:
        wait_until(lambda: shm.exists() and _count(shm) > 0, 30, "the counter counting")
        (kid,) = psutil.Process(launcher.pid).children()
        images = tmp_path / "eng" / "op1"
        images.mkdir(parents=True, mode=0o700)
        out = _hook("criu-dump", images, kid.pid, CKPT_CRIU_MODE="leave-stopped",
                    CKPT_ACTION="dump")
        assert out.returncode == 0, out.stderr
        assert (images / "criu-shm-files").read_text().split() == [str(shm)]
        frozen = _count(shm)  # the original is stopped: its counter too
        time.sleep(0.2)
        assert _count(shm) == frozen
        out = _hook("criu-restore", images, kid.pid, CKPT_CRIU_BESIDE="1",
                    CKPT_ACTION="pre-restore")
        assert out.returncode == 0, out.stdout + out.stderr
        copy_pid = int((images / "criu-restored-pid").read_text())
        # the copy counts on in its own /dev/shm, from where the original stopped ...
        own = Path(f"/proc/{copy_pid}/root") / str(shm).lstrip("/")
        wait_until(lambda: _count(own) > frozen + 5, 30, "the copy counting")
        # ... and the original's file is untouched
        assert _count(shm) == frozen
        assert os.stat(f"/proc/{copy_pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
        # the original, resumed (the move abandoned), counts in its own file again
        os.kill(kid.pid, signal.SIGCONT)
        wait_until(lambda: _count(shm) > frozen + 5, 30, "the original counting again")
        assert _count(own) > frozen + 5
    finally:
        # each is the init of a PID namespace of its own, in a session of its own: only its
        # own SIGKILL ends it (killing the launcher's group left them counting for good)
        for pid in (copy_pid, kid.pid if kid is not None else None):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        shm.unlink(missing_ok=True)


def test_a_copy_beside_an_original_whose_shared_memory_is_not_here_is_refused(tmp_path):
    """On another host the files are not there: CRIU would fail on the path; the hook says
    which file and why, before criu runs."""
    images = tmp_path / "eng" / "op1"
    images.mkdir(parents=True, mode=0o700)
    (images / "inventory.img").write_bytes(b"")
    gone = f"/dev/shm/psm_ckpt_test_gone_{uuid.uuid4().hex[:8]}"
    (images / "criu-shm-files").write_text(gone + "\n")
    out = _hook("criu-restore", images, 999999999, CKPT_CRIU_BESIDE="1",
                CKPT_ACTION="pre-restore")
    assert out.returncode == 2 and f"shared-memory file {gone} is not on this host" in \
        out.stderr, out.stderr
