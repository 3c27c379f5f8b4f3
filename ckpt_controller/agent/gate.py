"""The admission gate: which requests an engine may accept, and what is still in flight.

The engine calls ``admit(request_id)`` before it accepts a request and ``finish(request_id,
reason)`` when the request ends. Admission is open only while the lifecycle is RUNNING; any
other state gets an immediate ``RejectedError`` carrying the state and a retry-after hint, so
no request ever waits on a closed gate. During a drain the gate counts how the in-flight
requests end (completed, aborted, kept). Neighbours: ``lifecycle`` (read), ``operations``
(closes the gate by firing ``prepare`` under ``gate.lock``), ``vocab`` (finish reasons).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ckpt_controller.clock import Clock, Deadline
from ckpt_controller.errors import RejectedError, UsageError
from ckpt_controller.lifecycle import Lifecycle
from ckpt_controller.vocab import CheckpointState, FinishReason


@dataclass
class DrainCounts:
    in_flight_at_start: int = 0
    completed: int = 0
    aborted: int = 0
    kept: int = 0


@dataclass
class GateTotals:
    """Every request ever admitted ends in exactly one of ``ended`` (by reason)."""

    admitted: int = 0
    rejected: int = 0
    ended: dict[FinishReason, int] = field(default_factory=lambda: dict.fromkeys(FinishReason, 0))


class AdmissionGate:
    """Thread-safe record of in-flight requests; open only while RUNNING."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        *,
        engine: str = "",
        clock: Clock | None = None,
        retry_after: Callable[[], float] | None = None,
    ) -> None:
        self.lifecycle = lifecycle
        self.engine = engine
        self._clock = clock or Clock()
        self._retry_after = retry_after or (lambda: 1.0)
        #: held while admitting and while the agent closes admission
        self.lock = threading.Condition(threading.RLock())
        self._in_flight: dict[str, float] = {}  # request id -> admitted at (monotonic)
        self._kept: set[str] = set()
        self._drain: DrainCounts | None = None
        self.totals = GateTotals()

    # ------------------------------------------------------------------ engine side

    def admit(self, request_id: str) -> None:
        """Accept ``request_id`` or raise ``RejectedError`` (not RUNNING) at once."""
        with self.lock:
            state = self.lifecycle.state
            if state is not CheckpointState.RUNNING:
                self.totals.rejected += 1
                raise RejectedError(
                    f"engine {self.engine or '?'} is {state}, not admitting requests",
                    engine=self.engine, state=state.value,
                    retry_after_s=round(self._retry_after(), 3),
                )
            if request_id in self._in_flight:
                raise UsageError("request id already in flight", request_id=request_id)
            self._in_flight[request_id] = self._clock.monotonic()
            self.totals.admitted += 1

    def finish(self, request_id: str, reason: FinishReason | str) -> None:
        """Record that ``request_id`` ended with ``reason`` (a ``FinishReason``)."""
        try:
            reason = FinishReason(reason)
        except ValueError:  # policy: the engine's bug, told to the engine
            raise UsageError("unknown finish reason", reason=reason,
                             allowed=[r.value for r in FinishReason]) from None
        with self.lock:
            if self._in_flight.pop(request_id, None) is None:
                raise UsageError("finish for a request that is not in flight", request_id=request_id)
            was_kept = request_id in self._kept
            self._kept.discard(request_id)
            self.totals.ended[reason] += 1
            if self._drain is not None and not was_kept:
                if reason is FinishReason.ABORT:
                    self._drain.aborted += 1
                else:
                    self._drain.completed += 1
            self.lock.notify_all()

    # ------------------------------------------------------------------ agent side

    def in_flight(self) -> list[str]:
        """Requests still running (kept ones excluded), oldest first."""
        with self.lock:
            return [r for r in self._in_flight if r not in self._kept]

    @property
    def kept_count(self) -> int:
        with self.lock:
            return len(self._kept)

    def begin_drain(self) -> list[str]:
        with self.lock:
            ids = self.in_flight()
            self._drain = DrainCounts(in_flight_at_start=len(ids))
            return ids

    def mark_kept(self, request_ids: Iterable[str]) -> int:
        """Mark requests as kept (frozen for after restore); ids that already ended are skipped."""
        with self.lock:
            n = 0
            for rid in request_ids:
                if rid in self._in_flight and rid not in self._kept:
                    self._kept.add(rid)
                    n += 1
            if self._drain is not None:
                self._drain.kept += n
            self.lock.notify_all()
            return n

    def resume_kept(self) -> int:
        """Kept requests run again (after restore): they count as in flight for the next
        drain like any other request. Returns how many there were."""
        with self.lock:
            n = len(self._kept)
            self._kept.clear()
            self.lock.notify_all()
            return n

    def drain_counts(self) -> DrainCounts:
        with self.lock:
            d = self._drain or DrainCounts()
            return DrainCounts(d.in_flight_at_start, d.completed, d.aborted, d.kept)

    def end_drain(self) -> DrainCounts:
        with self.lock:
            counts = self.drain_counts()
            self._drain = None
            return counts

    def wait_idle(
        self,
        deadline: Deadline,
        *,
        tick_s: float = 0.25,
        on_tick: Callable[[], None] | None = None,
    ) -> bool:
        """Wait until no non-kept request is in flight; False if ``deadline`` passed first.

        ``on_tick`` runs every ``tick_s`` seconds while waiting (progress events)."""
        with self.lock:
            while self.in_flight():
                left = deadline.remaining()
                if left is not None and left <= 0:
                    return False
                wait = tick_s if left is None else min(tick_s, left)
                if not self.lock.wait(wait) and on_tick is not None:
                    on_tick()
            return True
