"""How much memory this process holds, per device, and how to hand freed memory back.

CPU: the process resident set (psutil), and glibc's ``malloc_trim`` so freed heap pages go back
to the kernel. CUDA: the torch caching allocator (``memory_allocated``/``memory_reserved``) and
the driver's view of the whole device (``mem_get_info``), and ``empty_cache``. Every CUDA call
is guarded: nothing CUDA runs unless a tensor actually lives on a CUDA device, so this module
imports and works on a CPU-only torch.

Neighbours: ``registry`` measures before and after a release or re-wake with ``usage`` and
calls ``return_freed`` after freeing storages; the reference engine (``engine.server``) calls
``trim_host_heap`` after a flood of requests; nothing here knows about tags.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field

import psutil
import torch

from ckpt_controller.errors import UsageError


def rss_bytes() -> int:
    """The resident set size of this process, in bytes: ``/proc/self/statm``, psutil where
    there is none. Never psutil's ``Process()`` of ``os.getpid()`` on Linux: in a PID
    namespace of its own under the host's /proc (``unshare --pid --fork``, as an engine that
    migrates runs) that PID names another process, and every release would measure the
    host's init instead (a ``--budget`` checked against it too)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):  # policy: no procfs (not Linux): psutil's view
        return _process().memory_info().rss


@functools.cache
def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _process() -> psutil.Process:
    return psutil.Process()


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        # policy: no glibc (musl, macOS, Windows): trimming is simply not available
        return None


def trim_host_heap() -> bool:
    """Ask glibc to return free heap pages to the kernel (``malloc_trim(0)``).

    Large tensors are ``mmap``-ed and go back on free; this catches the smaller ones that
    live on the heap. Returns whether a trim ran (``False`` where there is no glibc).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass(frozen=True)
class CudaUsage:
    """One CUDA device: this process's allocator, and the device as the driver sees it."""

    device: str
    allocated: int  # bytes in live tensors (torch.cuda.memory_allocated)
    reserved: int  # bytes the caching allocator holds (torch.cuda.memory_reserved)
    free: int  # free on the whole device (mem_get_info), all processes counted
    total: int

    @property
    def device_used(self) -> int:
        return self.total - self.free


def cuda_used(device: torch.device | str | int) -> CudaUsage:
    """Allocator and driver numbers for one CUDA device. ``UsageError`` without CUDA."""
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda" or not cuda_available():
        raise UsageError("not a usable CUDA device", device=str(dev),
                         cuda_available=cuda_available())
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(dev)
    return CudaUsage(
        device=str(dev),
        allocated=torch.cuda.memory_allocated(dev),
        reserved=torch.cuda.memory_reserved(dev),
        free=free,
        total=total,
    )


@dataclass(frozen=True)
class Usage:
    """What this process holds on one device: ``held`` is RSS on the CPU and the allocator's
    reserved bytes on CUDA; ``cuda`` carries the rest of the CUDA picture."""

    device: str
    held: int
    cuda: CudaUsage | None = field(default=None)


def usage(device: torch.device) -> Usage:
    """Measure one device (``cpu`` or ``cuda[:i]``)."""
    if device.type == "cuda":
        cu = cuda_used(device)
        return Usage(device=cu.device, held=cu.reserved, cuda=cu)
    if device.type == "cpu":
        return Usage(device="cpu", held=rss_bytes())
    raise UsageError("cannot measure this device", device=str(device))


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def return_freed(device: torch.device) -> None:
    """Hand memory freed on ``device`` back: ``malloc_trim`` on the CPU; on CUDA, wait for
    queued work, then ``empty_cache`` so the allocator's cached blocks go back to the driver."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    else:
        trim_host_heap()
