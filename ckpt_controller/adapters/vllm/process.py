"""The vLLM server's process as the sidecar sees it from outside: which PID it has, whether a
restore made a new incarnation of it, and how much memory its process tree holds.

- ``find_server_pid``: the local process listening on vLLM's port (a sidecar started beside
  vLLM); ``parent_host_pid``: the launcher's host PID (a sidecar started by ``launcher``,
  read again after a restore moved it);
- ``EngineFingerprint``: vLLM's process fingerprint for the agent's ``IncarnationTracker`` (a
  restore recreates vLLM's process, not the sidecar's);
- ``tree_usage``: the bytes the process tree holds, by device (PSS, and GPU memory from
  ``nvidia-smi``), which ``VllmEngine``'s memory reports measure.

Reads procfs, psutil and ``nvidia-smi``; knows nothing of vLLM's HTTP API.
Neighbours: ``sidecar`` above (its only user), ``agent.incarnation`` below (``Fingerprint``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil

from ckpt_controller.agent.incarnation import Fingerprint


def tree_usage(pid: int | None) -> dict[str, int]:
    """Bytes the process tree of ``pid`` holds, by device: host memory (``cpu``) as the sum of
    its processes' PSS (a page they share, such as torch's libraries mapped by all three of
    vLLM's, counts once, not once per process as with RSS) and, where nvidia-smi can tell,
    GPU memory of those processes (``cuda:<uuid>``). Empty without a PID or a process."""
    if pid is None:
        return {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:  # policy: gone or not ours to see: nothing measured
        return {}
    out = {"cpu": 0}
    for proc in procs:
        try:
            out["cpu"] += _pss(proc)
        except psutil.Error:  # policy: a child that ended meanwhile holds nothing
            continue
    out.update(_gpu_bytes({p.pid for p in procs}))
    return out


def _pss(proc: psutil.Process) -> int:
    """The proportional set size of ``proc`` (its RSS where the kernel does not tell)."""
    try:
        return proc.memory_full_info().pss
    except (AttributeError, psutil.AccessDenied):  # policy: no smaps here: RSS, an upper bound
        return proc.memory_info().rss


def _gpu_bytes(pids: set[int]) -> dict[str, int]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run([smi, "--query-compute-apps=pid,gpu_uuid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):  # policy: no answer: no GPU numbers
        return {}
    usage: dict[str, int] = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) in pids:
            key = f"cuda:{parts[1]}"
            usage[key] = usage.get(key, 0) + int(float(parts[2])) * 1024 * 1024
    return usage


class EngineFingerprint:
    """The vLLM server's fingerprint (boot id, PID, the kernel's start time of the task) for
    the agent's ``IncarnationTracker``: a CRIU restore of vLLM recreates its process, so its
    start time changes, while the sidecar's own process never left. While the process is
    gone (dumped, not yet restored) the last one seen stands; without a PID (a remote vLLM)
    it never changes. ``pid`` may be a function read at each call (``parent_host_pid``):
    ``on_new_pid`` then hears of each PID it gives that differs from the last."""

    def __init__(self, pid: "int | None | Callable[[], int | None]",
                 on_new_pid: Callable[[int], None] | None = None) -> None:
        self._pid_of = pid if callable(pid) else (lambda: pid)
        self.on_new_pid = on_new_pid
        first = self._pid_of()
        self._last = Fingerprint("", first or 0, 0)
        self()

    @property
    def pid(self) -> int | None:
        return self._pid_of()

    def __call__(self) -> Fingerprint:
        pid = self.pid
        if pid is None:
            return self._last
        try:
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
            # field 2 (comm) may hold spaces and parentheses: split after the last ')'
            start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        except (OSError, IndexError, ValueError):  # policy: gone for now: nothing new seen
            return self._last
        if pid != self._last.pid and self.on_new_pid is not None:
            self.on_new_pid(pid)
        self._last = Fingerprint(boot_id, pid, start_ticks)
        return self._last


def parent_host_pid() -> int | None:
    """The host PID of this process's parent (``PPid`` of ``/proc/self/status``, which
    procfs gives in its own mount's PID namespace: the host's, for a process started under
    ``unshare --pid --fork`` without a /proc of its own). Read each time: the parent of a
    restored sidecar is the restored launcher, under another host PID."""
    try:
        for line in Path("/proc/self/status").read_bytes().splitlines():
            if line.startswith(b"PPid:"):
                return int(line.split()[1]) or None
    except (OSError, ValueError, IndexError):  # policy: no procfs: not known
        return None
    return None


def find_server_pid(port: int) -> int | None:
    """The PID of the local process listening on TCP ``port`` (None if not visible)."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port \
                    and conn.pid:
                return conn.pid
    except (psutil.Error, OSError):  # policy: not allowed to list sockets: not visible
        return None
    return None


def process_started(pid: int | None) -> float | None:
    """When process ``pid`` started (wall clock, seconds since the epoch; None: no PID, or
    no such process)."""
    if not pid:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:  # policy: gone, or not ours to see: not known
        return None
