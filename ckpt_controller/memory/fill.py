"""Filling untouched host memory fast: the inner loop of a CPU re-wake.

A release gives a storage's pages back to the kernel, so a re-wake writes into memory that
is not mapped yet. Left to themselves, those pages fault in one trap per 4 KiB as the fill
touches them. Here every chunk's pages are faulted in first, in one call
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+), and then filled while they are still in the
CPU's cache; a large range is split into one contiguous part per thread, so the page faults
run on every core. ``populate_pages`` is a no-op where the kernel or libc lacks the call.

Many ranges at once (``in_chunks``: every re-woken weight of a tag, whatever their sizes) are
cut into the same chunks, and the chunks of all of them are shared out over the threads, so a
model of many middle-sized tensors fills on every core too.

Neighbours: ``safetensors_io`` fills re-woken weights from their file through ``in_parts`` and
``in_chunks``;
``registry`` zero-fills a re-woken KV cache with ``zero_fresh``; ``layout`` checksums a
release's tensors on every core with ``run_parts``. Nothing here knows tags.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import threading
from collections.abc import Callable, Sequence

import torch

#: a range this large is filled by several threads at once, each in its own part
PARALLEL_BYTES = 64 << 20
#: what one thread faults in and fills before moving on (fits in the CPU's cache)
CHUNK_BYTES = 4 << 20
#: filling threads (the cores torch may use)
THREADS = max(1, torch.get_num_threads())

_PAGE = 4096
_MADV_POPULATE_WRITE = 23
_populate_works = True


@functools.cache
def _madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None  # policy: no libc madvise (not Linux): pages fault in as they are touched
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def populate_pages(address: int, nbytes: int) -> bool:
    """Fault in, for writing, the whole pages inside host memory ``[address, address +
    nbytes)`` in one call. Harmless on pages already there. Returns whether it ran; where the
    kernel refuses the call (before 5.14) it is not tried again."""
    global _populate_works
    madvise = _madvise()
    if not _populate_works or madvise is None:
        return False
    lo = -(-address // _PAGE) * _PAGE
    hi = (address + nbytes) // _PAGE * _PAGE
    if hi <= lo:
        return False
    if madvise(lo, hi - lo, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:
        _populate_works = False  # policy: an older kernel: plain page faults, as before
    return False


def in_parts(address: int, nbytes: int, fill: Callable[[int, int], None]) -> None:
    """Call ``fill(lo, hi)`` for consecutive ``CHUNK_BYTES`` chunks covering ``[0, nbytes)``
    of the host memory at ``address``, each chunk's pages populated just before. Ranges of
    ``PARALLEL_BYTES`` or more are split into one contiguous part per thread (parts start
    on chunk bounds); the first exception of any part is raised once all have stopped."""
    chunk = CHUNK_BYTES
    workers = max(1, min(THREADS, nbytes // max(1, PARALLEL_BYTES // 2)))
    step = -(-nbytes // workers)
    step = max(chunk, -(-step // chunk) * chunk)

    def part(lo: int) -> None:
        end = min(nbytes, lo + step)
        for c0 in range(lo, end, chunk):
            c1 = min(end, c0 + chunk)
            populate_pages(address + c0, c1 - c0)
            fill(c0, c1)

    run_parts([functools.partial(part, lo) for lo in range(0, nbytes, step)])


def in_chunks(ranges: Sequence[tuple[int, int]], fill: Callable[[int, int, int], None]) -> None:
    """Call ``fill(i, lo, hi)`` for consecutive ``CHUNK_BYTES`` chunks covering ``[0, n)`` of
    each host memory range ``i`` of ``ranges`` (``(address, n)``), each chunk's pages populated
    just before. The chunks of all ranges, in order, are split into runs of about equal bytes,
    one per thread (as many as ``in_parts`` would use for their total), so each thread walks
    its own stretch of memory (and of a file read into it) front to back. The first exception
    of any run is raised once all have stopped."""
    chunk = CHUNK_BYTES
    chunks = [(i, lo, min(n, lo + chunk)) for i, (_, n) in enumerate(ranges)
              for lo in range(0, n, chunk)]
    if not chunks:
        return
    total = sum(n for _, n in ranges)
    workers = max(1, min(THREADS, total // max(1, PARALLEL_BYTES // 2), len(chunks)))
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(workers)]
    done = 0
    for item in chunks:
        runs[min(workers - 1, done * workers // max(1, total))].append(item)
        done += item[2] - item[1]

    def run(items: list[tuple[int, int, int]]) -> None:
        for i, lo, hi in items:
            populate_pages(ranges[i][0] + lo, hi - lo)
            fill(i, lo, hi)

    run_parts([functools.partial(run, items) for items in runs if items])


def run_parts(parts: list[Callable[[], None]]) -> None:
    """Each part on a thread of its own, the first on the calling thread; the first exception
    is raised once every part has stopped. Threads of their own, not a pool's: a pool hands a
    part to a thread that finished an earlier one, and two parts then run one after the
    other. No parts: nothing runs (a release of a tag with no CPU tensor)."""
    if not parts:
        return
    errors: list[BaseException] = []

    def guard(part: Callable[[], None]) -> None:
        try:
            part()
        except BaseException as exc:  # policy: kept for the caller, raised once all stopped
            errors.append(exc)

    others = [threading.Thread(target=guard, args=(part,), daemon=True,
                               name=f"fill-{n}") for n, part in enumerate(parts[1:], 1)]
    for t in others:
        t.start()
    guard(parts[0])
    for t in others:
        t.join()
    if errors:
        raise errors[0]


def zero_fresh(flat: torch.Tensor) -> None:
    """Zero a contiguous 1-D uint8 tensor whose pages were just given back: a large CPU one
    in parts, its pages faulted in ahead; any other at once (``zero_``)."""
    if flat.device.type != "cpu" or flat.numel() < PARALLEL_BYTES:
        flat.zero_()
        return
    in_parts(flat.data_ptr(), flat.numel(), lambda lo, hi: flat[lo:hi].zero_())
