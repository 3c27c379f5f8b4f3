"""Tell whether this process was restored from a checkpoint image.

A CRIU restore recreates the process: the PID may be the same, but the kernel's start time of
the task (``/proc/self/stat`` field 22) is new, and on another host so is the boot id. The
agent takes a fingerprint at start and compares it on every heartbeat tick.
Neighbours: ``agent.server`` (ticks it), ``adapters.vllm.sidecar`` (follows vLLM's process).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fingerprint:
    boot_id: str
    pid: int
    start_ticks: int


def current_fingerprint() -> Fingerprint:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path("/proc/self/stat").read_text()
        # field 2 (comm) may contain spaces and parentheses: split after the last ')'
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
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
