"""After a controller crash: finish every operation the previous controller left running.

``recover`` stops the hooks such an operation left running (so nothing races a half-finished
dump or restore), then brings each of its engines back to RUNNING (rolled back if PREPARED,
resumed if re-woken, restored if FAILED before any capture and ``recover_uncaptured =
"resume"``) or leaves it FAILED, with the reason; the operation ends ``interrupted``.
Neighbours: ``service`` (calls it at start, before serving), ``reconcile`` (the same
settling), ``hooks`` (orphaned hooks), ``journal`` (what was left running), ``fanout``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ckpt_controller import hub
from ckpt_controller import protocol as p
from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.controller.fanout import fan_out
from ckpt_controller.controller.hooks import stop_orphan_hooks
from ckpt_controller.controller.journal import Journal
from ckpt_controller.controller.outcome import StepOutcome
from ckpt_controller.controller.reconcile import (
    Reconciler,
    SessionFactory,
    resume_uncaptured,
    settle_state,
)
from ckpt_controller.controller.session import EngineSession
from ckpt_controller.vocab import CheckpointState, OperationStatus, OutcomeStatus

#: how an engine of an interrupted operation ended, by the state recovery left it in
_RECOVERED = {CheckpointState.RUNNING: OutcomeStatus.RECOVERED,
              CheckpointState.FAILED: OutcomeStatus.FAILED}


def recover(config: ControllerConfig, journal: Journal, reconciler: Reconciler,
            session: SessionFactory, finish: Callable[[p.OperationResult], None],
            stop: threading.Event | None = None) -> list[p.OperationResult]:
    """Finish every operation a previous controller left running; ``finish`` journals and
    answers each one's result. ``stop`` set (a SIGTERM) ends it at once: an operation not
    settled yet stays running in the journal, for the next start."""
    results = []
    stop = stop or threading.Event()
    for op_id, kind, engines, _params in journal.unfinished():
        if stop.is_set():
            break
        wall, start = time.time(), time.monotonic()
        cmd = p.OperationCommand(call_id=0, op_id=op_id, kind=kind, engines=engines)
        known = [e for e in engines if config.knows(e)]
        for engine in known:
            stop_orphan_hooks(config.image_dir / engine, op_id,
                              grace_s=config.deadlines.hook_grace)
        sessions = [session(cmd, e) for e in known]
        # the same policy as the reconciler's: FAILED after an operation that never began
        # to capture the engine is resumed (``recover_uncaptured``)
        resume = {e for e in known if reconciler.resumes(e, op_id)}
        try:
            fan_out(sessions, lambda s: recover_engine(s, config.deadlines.operation,
                                                       s.engine.name in resume, stop))
        finally:
            for s in sessions:
                s.close()
        if stop.is_set():
            break  # cut short: not finished, the next start recovers it whole
        result = p.OperationResult(op_id=op_id, kind=kind, status=OperationStatus.INTERRUPTED,
                                   engines=[s.outcome for s in sessions], wall=wall,
                                   duration_s=time.monotonic() - start)
        finish(result)
        results.append(result)
    return results


def recover_engine(s: EngineSession, wait_s: float, resume_failed: bool,
                   stop: threading.Event | None = None) -> StepOutcome:
    """Wait for the agent to settle, then bring a PREPARED engine back to RUNNING (and a
    FAILED one too with ``resume_failed``: the operation never began to capture it).
    ``stop`` set: it stops waiting and leaves the engine as it is."""
    deadline = time.monotonic() + wait_s
    status = s.client.status()
    # an agent still running a step finishes it; one left PREPARING or RESTORING between two
    # steps (no current operation) is handled below at once
    while status.current_op and time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return StepOutcome(OutcomeStatus.FAILED, status.state)
        hub.sleep(0.1)
        status = s.client.status()
    before = status.state
    if before == CheckpointState.FAILED and resume_failed:
        s.outcome.state = resume_uncaptured(s, s.op_id)
    else:
        s.outcome.state = settle_state(s, before, "controller restarted: interrupted "
                                       "operation rolled back", step="recover")
    s.record("reconciled", {"found": before, "now": s.outcome.state})
    return StepOutcome(_RECOVERED.get(s.outcome.state, OutcomeStatus.FAILED))
