"""Running a step on many engines: all at once, or rolling, and what the whole came to.

``fan_out`` runs a step for every engine's session concurrently, each in a greenlet of a ``hub``
on the operation's thread (a group prepare takes about as long as its slowest engine);
``rolling`` cycles engines keeping at most ``max_unavailable`` of them out of service
(``rolling_limit``: a quarter of them unless the operation names its own) and stops at the first
that does not succeed (the rest are ``skipped``); ``summarize`` turns the engines' outcomes into
the operation's status. Neighbours: ``steps`` (what runs on each engine), ``session``;
``service`` calls these."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ckpt_controller import hub
from ckpt_controller import protocol as p
from ckpt_controller.controller import steps
from ckpt_controller.controller.session import EngineSession
from ckpt_controller.values import DEFAULT_MAX_UNAVAILABLE, Limit
from ckpt_controller.vocab import OperationKind, OperationStatus, OutcomeStatus


def fan_out(sessions: list[EngineSession], step: Callable[[EngineSession], object],
            workers: int | None = None, guard: bool = True) -> None:
    """Run ``step`` for every session concurrently (``workers`` at a time); ``guard``:
    ``step`` is a ``steps`` step, run through ``steps.guarded``."""
    if not sessions:
        return
    run = steps.guarded(step) if guard else step
    hub.each(run, sessions, workers or len(sessions))


def rolling_limit(cmd: p.OperationCommand, engines: int) -> int:
    """A cycle's limit on ``engines`` engines: its ``max_unavailable``, else its
    ``max_unavailable_percent`` of them, else ``values.DEFAULT_MAX_UNAVAILABLE`` (25%, at least
    one): all at once only when asked (100%, or a number as large)."""
    if cmd.max_unavailable is not None:
        return cmd.max_unavailable
    if cmd.max_unavailable_percent is not None:
        return Limit(cmd.max_unavailable_percent, percent=True).of(engines)
    return DEFAULT_MAX_UNAVAILABLE.of(engines)


def rolling(sessions: list[EngineSession], max_unavailable: int
            ) -> tuple[list[p.EngineOutcome], int]:
    """Cycle every engine, at most ``max_unavailable`` at a time; returns the outcomes and
    the most engines that were out of service at once."""
    lock = threading.Lock()
    state = {"out": 0, "peak": 0, "halt": False}
    cycle = steps.guarded(steps.cycle)

    def one(s: EngineSession) -> None:
        with lock:
            if state["halt"]:
                s.outcome.status = OutcomeStatus.SKIPPED
                return
            state["out"] += 1
            state["peak"] = max(state["peak"], state["out"])
        s.start_clock()  # the deadline counts from this engine's turn
        try:
            cycle(s)
        finally:
            with lock:
                state["out"] -= 1
                if s.outcome.status != OutcomeStatus.SUCCEEDED:
                    state["halt"] = True  # a rolling cycle stops at its first failure

    fan_out(sessions, one, workers=max_unavailable, guard=False)
    return [s.outcome for s in sessions], state["peak"]


#: engine outcomes that leave an operation rolled back (rather than failed)
_UNDONE = {OutcomeStatus.SUCCEEDED, OutcomeStatus.ROLLED_BACK, OutcomeStatus.SKIPPED}


def summarize(op_id: str, kind: OperationKind | str, outcomes: list[p.EngineOutcome],
              wall: float, duration: float) -> p.OperationResult:
    statuses = {o.status for o in outcomes}
    if statuses <= {OutcomeStatus.SUCCEEDED}:
        status = OperationStatus.SUCCEEDED
    elif statuses <= _UNDONE:
        status = OperationStatus.ROLLED_BACK
    else:
        status = OperationStatus.FAILED
    first = next((o.error for o in outcomes if o.error is not None), None)
    return p.OperationResult(op_id=op_id, kind=kind, status=status, engines=outcomes,
                             wall=wall, duration_s=duration, error=first)
