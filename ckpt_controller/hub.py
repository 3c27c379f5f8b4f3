"""One thread waits for many engines: a fan-out's engines each in a greenlet, all waits at once.

A fan-out of N engines used to take N threads, each waiting on its own socket, woken one by
one by the kernel and taking turns at the GIL. ``Hub.each`` runs them all on the calling
thread instead: each item's work runs in a greenlet, and where it would wait it switches back
to the hub, which waits for every engine at once with one zmq poll and resumes those whose
socket became readable or whose wait ran out.

Code that waits says so through this module, and is unchanged outside a hub:

- ``poll(socks, timeout_s)``: until one of ``socks`` is readable (``contact.FirstContact``,
  under every request and event wait of ``rpc.RpcClient``);
- ``blocking(fn, *args)``: ``fn`` on a thread of its own while the others go on (a session's
  hooks, which run subprocesses, and the journal's fsync before them);
- ``sleep(seconds)``;

and what it sends may wait for the round: ``gather(key, item, flush)`` collects items (a
fan-out's journal records on their way to subscribers) and flushes them together when every
greenlet waits, so a round costs one message, not one per item.

Outside a hub (any plain thread, and the hub's own loop) each does the plain thing: a zmq poll,
a call, ``time.sleep``. A greenlet never moves between threads, and everything in it runs on
the hub's thread, one at a time: a zmq socket is still used by one thread only. A hub inside a
hub is not made: ``each`` called from a hub's greenlet runs its items one after the other.
Neighbours: ``contact`` (the socket waits), ``controller.fanout``, ``preflight``,
``reconcile`` and ``service`` (they fan out through ``each``), ``controller.session`` (hooks
through ``blocking``), ``controller.recovery`` (``sleep``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import greenlet
import zmq

T = TypeVar("T")
_POLLIN = int(zmq.POLLIN)
_local = threading.local()


def current() -> Hub | None:
    """The hub this code runs under (in one of its greenlets), else None."""
    hub: Hub | None = getattr(_local, "hub", None)
    if hub is None or greenlet.getcurrent() is hub.loop:
        return None
    return hub


def poll(socks: Sequence[zmq.Socket], timeout_s: float) -> list[zmq.Socket]:
    """Wait up to ``timeout_s`` until one of ``socks`` is readable; the readable ones."""
    hub = current()
    if hub is not None:
        return hub.wait(socks, timeout_s)
    ms = max(0, math.ceil(timeout_s * 1000))
    if len(socks) == 1:
        return list(socks) if socks[0].poll(ms, _POLLIN) else []
    return [s for s, _ in zmq.zmq_poll([(s, _POLLIN) for s in socks], ms)]


def blocking(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; under a hub on a thread of its own, while the hub's others go on."""
    hub = current()
    return fn(*args) if hub is None else hub.off_loop(fn, args)


def each(fn: Callable[[T], object], items: Sequence[T], at_most: int) -> None:
    """``fn(item)`` for every item, at most ``at_most`` at once; returns when all are done,
    and raises the first exception one raised (the items not yet begun then are not run).
    They run in a ``Hub`` on this thread, each in a greenlet; called from inside a hub (or
    for one item), one after the other."""
    if current() is not None or len(items) <= 1 or at_most <= 1:
        for item in items:
            fn(item)
        return
    h = Hub()
    try:
        h.each(fn, items, min(at_most, len(items)))
    finally:
        h.close()


def gather(key: object, item: T, flush: Callable[[list[T]], object]) -> None:
    """``flush([item])``; under a hub, ``item`` joins the others gathered under ``key`` in
    this round, flushed together (in the order gathered) once every greenlet waits, before
    the hub's next poll, or when its fan-out ends: a round of a fan-out's records costs one
    ``flush``, not one per record."""
    hub = current()
    if hub is None:
        flush([item])
        return
    got = hub.gathered.get(key)
    if got is None:
        hub.gathered[key] = ([item], flush)
    else:
        got[0].append(item)


def flush() -> None:
    """What this hub gathered so far in this round, flushed now (outside a hub, nothing is
    held): before anything that must come after it, such as a journal barrier."""
    hub = current()
    if hub is not None:
        hub._flush()


def sleep(seconds: float) -> None:
    hub = current()
    if hub is None:
        time.sleep(seconds)
    else:
        hub.wait((), seconds)


class _Wait:
    __slots__ = ("socks", "deadline")

    def __init__(self, socks: Sequence[zmq.Socket], deadline: float) -> None:
        self.socks, self.deadline = socks, deadline


class Hub:
    """Runs greenlets on the thread that made it (``each``); one ``each`` at a time."""

    def __init__(self) -> None:
        #: the greenlet the hub's loop runs in: the thread's own
        self.loop = greenlet.getcurrent()
        self._waits: dict[greenlet.greenlet, _Wait] = {}
        #: what the poll watches: socket -> (socket, POLLIN), and who waits on it
        self._items: dict[zmq.Socket, tuple[zmq.Socket, int]] = {}
        self._owner: dict[zmq.Socket, greenlet.greenlet] = {}
        #: greenlets to resume, with what their wait returns
        self._runnable: deque[tuple[greenlet.greenlet, object]] = deque()
        #: greenlets whose ``off_loop`` job ended (filled by the job's thread)
        self._jobs_done: deque[greenlet.greenlet] = deque()
        self._jobs = 0
        #: (deadline, seq, greenlet, its wait) of every wait made; one that ended (woken by
        #: its socket) stays until it comes to the top: each round looks at the earliest only
        self._deadlines: list[tuple[float, int, greenlet.greenlet, _Wait]] = []
        self._seq = itertools.count()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_lock = threading.Lock()
        self._closed = False
        #: key -> (items, flush): what ``gather`` collected in this round
        self.gathered: dict[object, tuple[list, Callable[[list], object]]] = {}

    def close(self) -> None:
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    # ---------------------------------------------------------------- from the greenlets

    def wait(self, socks: Sequence[zmq.Socket], timeout_s: float) -> list[zmq.Socket]:
        me = greenlet.getcurrent()
        w = self._waits[me] = _Wait(socks, time.monotonic() + max(0.0, timeout_s))
        heapq.heappush(self._deadlines, (w.deadline, next(self._seq), me, w))
        for s in socks:
            self._items[s] = (s, _POLLIN)
            self._owner[s] = me
        try:
            return self.loop.switch()
        finally:
            del self._waits[me]
            for s in socks:
                self._items.pop(s, None)
                self._owner.pop(s, None)

    def off_loop(self, fn: Callable[..., T], args: tuple) -> T:
        me = greenlet.getcurrent()
        box: list = []

        def job() -> None:
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # policy: raised in the greenlet that asked (below)
                box.append((False, exc))
            # both under the lock ``close`` takes: the loop may see the job ended (and the
            # hub close) before the wake-up is written, which must then not be written at
            # all, into a closed file or a new one given the same number
            with self._wake_lock:
                self._jobs_done.append(me)
                if not self._closed:
                    os.write(self._wake_w, b"x")

        self._jobs += 1
        threading.Thread(target=job, name="hub-job", daemon=True).start()
        try:
            self.loop.switch()
        finally:
            self._jobs -= 1
        ok, value = box[0]
        if not ok:
            raise value
        return value

    # ---------------------------------------------------------------- the loop

    def each(self, fn: Callable[[T], object], items: Iterable[T], at_most: int) -> None:
        """``fn(item)`` for every item, at most ``at_most`` at once, each in a greenlet on
        this thread; returns when all are done and raises the first exception one raised
        (the items not yet begun then are not run)."""
        todo = iter(items)
        failed: list[BaseException] = []

        def lane(_start: object = None) -> None:
            try:
                for item in todo:
                    fn(item)
                    if failed:
                        return
            except BaseException as exc:  # policy: the caller's, raised there (below)
                failed.append(exc)

        lanes = [greenlet.greenlet(lane, parent=self.loop) for _ in range(max(1, at_most))]
        _local.hub = self
        try:
            self._run(lanes)
        finally:
            _local.hub = None
            self._flush()
        if failed:
            raise failed[0]

    def _run(self, lanes: list[greenlet.greenlet]) -> None:
        live = set(lanes)
        self._runnable.extend((g, None) for g in lanes)
        while True:
            while self._runnable:
                g, value = self._runnable.popleft()
                g.switch(value)  # back here when it waits again, or ended
                if g.dead:
                    live.discard(g)
            if not live:
                return
            self._flush()
            self._poll()

    def _flush(self) -> None:
        """Hand what this round gathered to its flushes (a flush that gathers again, being
        outside the hub's greenlets, flushes at once)."""
        while self.gathered:
            gathered, self.gathered = self.gathered, {}
            for items, flush in gathered.values():
                flush(items)

    def _poll(self) -> None:
        now = time.monotonic()
        heap, waits = self._deadlines, self._waits
        while heap and waits.get(heap[0][2]) is not heap[0][3]:
            heapq.heappop(heap)  # a wait that ended already
        until = heap[0][0] if heap else math.inf
        items = list(self._items.values())
        if self._jobs:
            items.append((self._wake_r, _POLLIN))
        if until == math.inf:
            ms = -1 if items else 0
        else:
            ms = max(0, math.ceil((until - now) * 1000))
        ready = zmq.zmq_poll(items, ms) if items else (time.sleep(ms / 1000) or [])
        woken: dict[greenlet.greenlet, list[zmq.Socket]] = {}
        for s, _ in ready:
            if s == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:  # policy: another round read the wake-up already
                    pass
                continue
            woken.setdefault(self._owner[s], []).append(s)
        while self._jobs_done:
            self._runnable.append((self._jobs_done.popleft(), None))
        for g, socks in woken.items():
            self._runnable.append((g, socks))
        now = time.monotonic()
        while heap and heap[0][0] <= now:  # waits that ran out (and were not woken)
            _, _, g, w = heapq.heappop(heap)
            if waits.get(g) is w and g not in woken:
                self._runnable.append((g, []))
