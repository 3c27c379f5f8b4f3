"""The dumped process tree of a migrating engine, as its nodes see it in ``/proc``.

A dump with ``leave-stopped`` leaves the source's tree stopped (``continue_tree`` lets it go
on when the engine did not move; ``kill_stopped`` ends it when it did); the criu hooks leave
the PIDs they dumped and restored in the image folder (``dumped_pid``). What a migration needs
of the processes, checked before anything moves: the engine the init of a PID namespace of
its own (``own_pid_namespace``), the two nodes in network namespaces of their own
(``net_namespace``).
Neighbours: ``steps``, ``settle`` and ``fence`` (their users), ``hooks/criu-dump`` and
``hooks/criu-restore`` (which write ``criu-pid``, ``criu-pids``, ``criu-restored-pid``).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import psutil


def kill_stopped(pid) -> bool:
    """End the dumped tree the source kept stopped (its root: the PID namespace's init)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:  # policy: gone already
        return False


def dumped_pid(folder: Path, name: str = "criu-pid") -> int | None:
    """The PID the criu-dump hook dumped into ``folder`` (``criu-pid``), or the one the
    criu-restore hook restored (``criu-restored-pid``), if there is one."""
    try:
        return int((folder / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):  # policy: no dump there
        return None


def restored_pid(folder: Path) -> int | None:
    """The PID of the copy the criu-restore hook restored from ``folder``
    (``criu-restored-pid``), while that process lives: one started after the file was
    written is another process under a reused PID, and None."""
    pid = dumped_pid(folder, "criu-restored-pid")
    if pid is None:
        return None
    try:
        written = (folder / "criu-restored-pid").stat().st_mtime
        started = psutil.Process(pid).create_time()
    except (OSError, psutil.Error):  # policy: gone (or the file with it): no copy
        return None
    return pid if started <= written + 1.0 else None


def continue_tree(folder: Path, pid) -> None:
    """SIGCONT to every process of the tree a dump with leave-stopped left stopped: the ones
    the criu-dump hook listed (``criu-pids``), and ``pid``."""
    pids = set()
    try:
        pids.update(int(word) for word in (folder / "criu-pids").read_text().split())
    except (OSError, ValueError):  # policy: no list (no dump got that far): the root only
        pass
    if isinstance(pid, int) and pid > 0:
        pids.add(pid)
    for each in sorted(pids):
        if stopped(each):
            try:
                os.kill(each, signal.SIGCONT)
            except ProcessLookupError:  # policy: ended meanwhile
                continue


def stopped(pid: int) -> bool:
    """The process exists and is stopped (the state a dump with leave-stopped leaves)."""
    return _state(pid) in ("T", "t")


def alive(pid: int) -> bool:
    """The process exists and is no zombie."""
    state = _state(pid)
    return state is not None and state != "Z"


def _state(pid: int) -> str | None:
    """The process's state letter in ``/proc/<pid>/stat`` (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:  # policy: no such process
        return None


def own_pid_namespace(pid) -> bool | None:
    """Whether process ``pid`` is the init (PID 1) of a PID namespace below the one of this
    procfs, as ``unshare --pid --fork`` makes it: the only way a restored copy gets the PIDs
    it had. ``None`` when it cannot be told (no such process, no ``NSpid`` line)."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read(1 << 16)
    except OSError:  # policy: gone, or not ours to read: unknown
        return None
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            fields = line.split()[1:]
            return len(fields) > 1 and fields[-1] == b"1"
    return None


def net_namespace() -> str | None:
    """This process's network namespace, as ``BOOT_ID/INODE``: two nodes that say the same
    share one network namespace of one host. ``None`` when procfs does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read(64).strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:  # policy: no procfs: not known, nothing is refused for it
        return None


def signal_tree(pid: int, sig: int) -> list[int]:
    """``sig`` to process ``pid`` and every descendant (a stopped parent cannot pass a
    signal on); the PIDs it reached."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:  # policy: gone already: nothing to signal
        return []
    reached = []
    for proc in tree:
        try:
            os.kill(proc.pid, sig)
            reached.append(proc.pid)
        except ProcessLookupError:  # policy: ended meanwhile
            continue
    return reached


def remove_received(folder: Path) -> bool:
    """The image a migration's target received, gone (the folder, or the link to the shared
    one; never what the link points at); whether there was one."""
    if folder.is_symlink():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    else:
        return False
    return True
