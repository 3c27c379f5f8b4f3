"""Threads kept between operations: an operation starts on an idle one, and a new one is
made only when every one is busy.

Starting a thread for every operation costs more CPU than a no-op operation's own work in
the controller. ``Workers`` keeps them instead; they are daemon threads, as the operations'
threads always were, so a controller that is stopped (SIGTERM, then exit) never waits for an
operation in the middle of a drain. There are never more than operations ran at once.
Neighbours: ``service`` (runs each operation on one).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("ckpt_controller.controller")


class Workers:
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., object], tuple] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._made = itertools.count(1)
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on an idle thread, or on a new one when none is idle."""
        with self._lock:
            make = self._idle == 0
            if not make:
                self._idle -= 1
        self._jobs.put((fn, args))
        if make:
            t = threading.Thread(target=self._serve, daemon=True,
                                 name=f"{self.name}-{next(self._made)}")
            self._threads.append(t)
            t.start()

    def close(self) -> None:
        """Let every thread end once its job is done (without waiting for them)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except BaseException:  # policy: a job's bug is logged; the thread serves on
                log.exception("%s: a job failed", self.name)
            with self._lock:
                self._idle += 1
