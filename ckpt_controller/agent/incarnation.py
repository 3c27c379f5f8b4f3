"""Tell whether this process was restored from a checkpoint image.

A CRIU restore recreates the process: the PID may be the same, but the kernel's start time of
the task (``/proc/self/stat`` field 22) is new, and on another host so is the boot id. The
agent takes a fingerprint at start and compares it on every heartbeat tick and before it
answers a request whose reply says the incarnation (handshake, status). Reading it is two
small procfs reads with plain ``os`` calls (a few microseconds, not ``pathlib``'s tens).
Neighbours: ``agent.server`` (ticks it), ``adapters.vllm.sidecar`` (follows vLLM's process).
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


def current_fingerprint() -> Fingerprint:
    try:
        boot_id = read_small("/proc/sys/kernel/random/boot_id").decode().strip()
        start_ticks = parse_start_ticks(read_small("/proc/self/stat"))
    except (OSError, IndexError, ValueError):  # policy: no procfs -> PID only
        boot_id, start_ticks = "", 0
    return Fingerprint(boot_id, os.getpid(), start_ticks)


class IncarnationTracker:
    """Counts how often the process was found to be a restored copy of itself."""

    def __init__(self, fingerprint: Callable[[], Fingerprint] = current_fingerprint) -> None:
        self._fingerprint = fingerprint
        self._seen = fingerprint()
        self.incarnation = 0

    def check(self) -> bool:
        """True once per new incarnation (the first check after a restore)."""
        now = self._fingerprint()
        if now == self._seen:
            return False
        self._seen = now
        self.incarnation += 1
        return True

    @property
    def restored_from_image(self) -> bool:
        return self.incarnation > 0
