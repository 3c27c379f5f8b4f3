"""Filling released host memory: pages faulted in ahead, chunks spread over threads."""

from __future__ import annotations

import ctypes
import errno
import threading

import pytest
import torch

from ckpt_controller.memory import fill
from ckpt_controller.memory.measure import rss_bytes

MIB = 1 << 20


def test_populate_faults_pages_in_without_touching_them():
    t = torch.empty(256 * MIB, dtype=torch.uint8)  # mapped, not touched: not resident yet
    before = rss_bytes()
    assert fill.populate_pages(t.data_ptr(), t.numel())
    grew = rss_bytes() - before
    assert grew > 240 * MIB, f"only {grew / MIB:.0f} MiB became resident"
    del t


def test_populate_skips_a_range_without_a_whole_page():
    t = torch.zeros(2 * 4096, dtype=torch.uint8)
    assert not fill.populate_pages(t.data_ptr() + 1, 4000)


def test_a_kernel_without_populate_is_asked_once(monkeypatch):
    calls = []

    def old_kernel(address, length, advice):
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(fill, "_madvise", lambda: old_kernel)
    monkeypatch.setattr(fill, "_populate_works", True)
    t = torch.ones(MIB, dtype=torch.uint8)
    assert not fill.populate_pages(t.data_ptr(), t.numel())
    assert not fill.populate_pages(t.data_ptr(), t.numel())
    assert calls == [23]
    out = torch.empty(MIB, dtype=torch.uint8)
    fill.zero_fresh(out)  # the fill itself still works, with plain page faults
    assert torch.count_nonzero(out) == 0


def test_in_parts_covers_every_byte_once_in_chunks_on_every_thread(monkeypatch):
    monkeypatch.setattr(fill, "PARALLEL_BYTES", 64 * 1024)
    monkeypatch.setattr(fill, "CHUNK_BYTES", 16 * 1024)
    monkeypatch.setattr(fill, "THREADS", 3)
    nbytes = 1_000_003  # parts and the last chunk of unequal size
    t = torch.zeros(nbytes, dtype=torch.uint8)
    seen: list[tuple[int, int]] = []
    threads: set[int] = set()
    lock = threading.Lock()
    all_parts_running = threading.Barrier(3, timeout=10)  # broken if parts ran one by one

    def work(lo: int, hi: int) -> None:
        with lock:
            first = threading.get_ident() not in threads
            threads.add(threading.get_ident())
        if first:
            all_parts_running.wait()
        t[lo:hi] += 1
        with lock:
            seen.append((lo, hi))

    fill.in_parts(t.data_ptr(), nbytes, work)
    assert torch.all(t == 1)  # every byte once
    assert all(hi - lo <= 16 * 1024 for lo, hi in seen)
    assert sorted(seen)[0][0] == 0 and sorted(seen)[-1][1] == nbytes
    assert len(threads) == 3


def test_a_small_range_is_filled_on_the_calling_thread():
    t = torch.zeros(MIB, dtype=torch.uint8)
    where = []
    fill.in_parts(t.data_ptr(), t.numel(), lambda lo, hi: where.append(threading.get_ident()))
    assert set(where) == {threading.get_ident()}


def test_in_parts_raises_a_failing_part_after_all_parts_stopped(monkeypatch):
    monkeypatch.setattr(fill, "PARALLEL_BYTES", 64 * 1024)
    monkeypatch.setattr(fill, "CHUNK_BYTES", 16 * 1024)
    monkeypatch.setattr(fill, "THREADS", 2)
    t = torch.zeros(256 * 1024, dtype=torch.uint8)
    done = []

    def work(lo: int, hi: int) -> None:
        if lo == 0:
            raise OSError(5, "Input/output error")
        done.append(lo)

    with pytest.raises(OSError, match="Input/output"):
        fill.in_parts(t.data_ptr(), t.numel(), work)
    assert max(done) == 256 * 1024 - 16 * 1024  # the other part ran to its end


def test_zero_fresh_zeroes_every_byte_of_a_large_range():
    t = torch.ones(fill.PARALLEL_BYTES + 3 * MIB + 5, dtype=torch.uint8)
    fill.zero_fresh(t)
    assert torch.count_nonzero(t) == 0


def test_in_chunks_shares_the_chunks_of_many_ranges_over_the_threads(monkeypatch):
    monkeypatch.setattr(fill, "PARALLEL_BYTES", 64 * 1024)
    monkeypatch.setattr(fill, "CHUNK_BYTES", 16 * 1024)
    monkeypatch.setattr(fill, "THREADS", 2)
    # many ranges, each smaller than what in_parts would split: together they fill two threads
    sizes = [20_000, 8, 0, 40_003, 16 * 1024, 30_000, 5]
    ts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    seen: list[tuple[int, int, int]] = []
    threads: dict[int, list[tuple[int, int]]] = {}
    lock = threading.Lock()
    both_running = threading.Barrier(2, timeout=10)  # broken if the runs went one by one

    def work(i: int, lo: int, hi: int) -> None:
        with lock:
            first = threading.get_ident() not in threads
            threads.setdefault(threading.get_ident(), []).append((i, lo))
        if first:
            both_running.wait()
        ts[i][lo:hi] += 1
        with lock:
            seen.append((i, lo, hi))

    fill.in_chunks([(t.data_ptr(), t.numel()) for t in ts], work)
    assert all(torch.all(t == 1) for t in ts)  # every byte of every range once
    assert all(hi - lo <= 16 * 1024 and lo % (16 * 1024) == 0 for _, lo, hi in seen)
    assert len(threads) == 2
    for run in threads.values():  # each thread walks its own stretch front to back
        assert run == sorted(run)


def test_in_chunks_of_a_little_memory_runs_on_the_calling_thread():
    ts = [torch.zeros(n, dtype=torch.uint8) for n in (MIB, 3, 0)]
    where = []
    fill.in_chunks([(t.data_ptr(), t.numel()) for t in ts],
                   lambda i, lo, hi: where.append((i, threading.get_ident())))
    assert where == [(0, threading.get_ident()), (1, threading.get_ident())]
    fill.in_chunks([], lambda i, lo, hi: where.append(i))  # nothing to fill: nothing called
    assert len(where) == 2


def test_in_chunks_raises_a_failing_chunk_after_all_runs_stopped(monkeypatch):
    monkeypatch.setattr(fill, "PARALLEL_BYTES", 64 * 1024)
    monkeypatch.setattr(fill, "CHUNK_BYTES", 16 * 1024)
    monkeypatch.setattr(fill, "THREADS", 2)
    ts = [torch.zeros(64 * 1024, dtype=torch.uint8) for _ in range(2)]
    done = []

    def work(i: int, lo: int, hi: int) -> None:
        if (i, lo) == (0, 0):
            raise OSError(5, "Input/output error")
        done.append((i, lo))

    with pytest.raises(OSError, match="Input/output"):
        fill.in_chunks([(t.data_ptr(), t.numel()) for t in ts], work)
    assert done[-1] == (1, 48 * 1024)  # the other run went to its end
