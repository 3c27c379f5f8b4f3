"""Tell whether this process was restored from a checkpoint image.

A CRIU restore recreates the process: the PID may be the same, but the kernel's start time of
the task (``/proc/self/stat`` field 22) is new, and on another host so is the boot id. The
agent takes a fingerprint at start and compares it on every heartbeat tick and before it
answers a request whose reply says the incarnation (handshake, status). Reading it is two
small procfs reads with plain ``os`` calls (a few microseconds, not ``pathlib``'s tens).
Neighbours: ``agent.server`` (ticks it), ``adapters.vllm.process`` (follows vLLM's process).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Fingerprint:
    boot_id: str
    pid: int
    start_ticks: int


def read_small(path: str) -> bytes:
    """The whole of a small procfs file (under 4 KiB: ``stat``, ``boot_id``); ``OSError``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def parse_start_ticks(stat: bytes) -> int:
    """Field 22 of ``/proc/<pid>/stat``: when the task started, in clock ticks since boot.
    Field 2 (comm) may contain spaces and parentheses: split after the last ``)``."""
    return int(stat.rsplit(b")", 1)[1].split()[19])


def parse_nspid(status: bytes) -> int | None:
    """The first PID of ``/proc/<pid>/status``'s ``NSpid`` line: the PID in the namespace of
    the procfs mount, the host's for a process started with ``unshare --pid --fork`` without
    a /proc of its own (``os.getpid()`` is 1 there). ``None`` without the line (old kernels)."""
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            fields = line.split()[1:]
            return int(fields[0]) if fields else None
    return None


def host_pid() -> int:
    """This process's PID as the host sees it (see ``parse_nspid``); ``os.getpid()`` when
    procfs does not say. Read it again after a restore from an image: the PID changes then."""
    try:
        # /proc/self/status is over 1 KiB and under 4 KiB: one read holds it
        pid = parse_nspid(read_small("/proc/self/status"))
    except (OSError, ValueError):  # policy: no procfs (or a strange one) -> our own view
        pid = None
    return pid if pid is not None else os.getpid()


def current_fingerprint() -> Fingerprint | None:
    """This process's fingerprint; ``None`` when it cannot be read now (no descriptor left,
    no memory: ``EMFILE`` under thousands of connections): unknown, never a new one. Without
    procfs at all, the PID alone."""
    try:
        boot_id = read_small("/proc/sys/kernel/random/boot_id").decode().strip()
        start_ticks = parse_start_ticks(read_small("/proc/self/stat"))
    except FileNotFoundError:  # policy: no procfs -> PID only
        boot_id, start_ticks = "", 0
    except (OSError, IndexError, ValueError):  # policy: not readable now: unknown, not new
        return None
    return Fingerprint(boot_id, os.getpid(), start_ticks)


class IncarnationTracker:
    """Counts how often the process was found to be a restored copy of itself. A fingerprint
    that could not be read (``None``) says nothing: a failed read is never a restore (under
    fd pressure the agent once counted 18 restores that never happened)."""

    def __init__(self, fingerprint: Callable[[], Fingerprint | None] = current_fingerprint
                 ) -> None:
        self._fingerprint = fingerprint
        self._seen = fingerprint()
        self.incarnation = 0

    def check(self) -> bool:
        """True once per new incarnation (the first check after a restore)."""
        now = self._fingerprint()
        if now is None or now == self._seen:
            return False
        if self._seen is None:  # the first one known: the start's, not a restore
            self._seen = now
            return False
        self._seen = now
        self.incarnation += 1
        return True

    @property
    def restored_from_image(self) -> bool:
        return self.incarnation > 0
