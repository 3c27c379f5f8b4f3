"""What each operation does to one engine, and what a failure there undoes.

A step (``prepare``, ``capture``, ``restore``, ``rollback``, ``cycle``, ...) runs on one
engine's ``EngineSession`` and returns a ``StepOutcome``; ``guarded`` opens the session, runs
the step, turns an error that escaped it into an outcome (``outcome.from_error``) and writes
the outcome into the engine's ``EngineOutcome``, so one engine's failure never stops the
others. What a hook point's failure does is the session's runner's business (``session.at``
applies ``policy.HOOK_FAILURE``); here a cycle whose restore never ran rolls back, and an
all-or-nothing prepare rolls back the engines it prepared.
Neighbours: ``session`` (the engine's phases), ``policy`` and ``outcome``; ``fanout`` runs
steps across engines; ``service`` chooses the step for an operation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckpt_controller import protocol as p
from ckpt_controller.controller.hooks import find_hooks
from ckpt_controller.controller.outcome import StepOutcome, error_info, from_error
from ckpt_controller.controller.session import EngineSession
from ckpt_controller.errors import (CkptError, OperationError, UnreachableError, UsageError,
                                    described)
from ckpt_controller.vocab import CheckpointState, HookCondition, HookPoint, OutcomeStatus

log = logging.getLogger("ckpt_controller.controller")

Step = Callable[[EngineSession], StepOutcome]


def guarded(step: Step, open_first: bool = True) -> Callable[[EngineSession], None]:
    """``step`` made safe to fan out: its outcome, or its failure, is its engine's outcome."""
    def run(s: EngineSession) -> None:
        try:
            if open_first:
                s.open()
            out = step(s)
        except Exception as exc:
            # policy: a step's failure is its engine's outcome (a bug becomes a typed
            # OperationError); the other engines go on
            err = exc if isinstance(exc, CkptError) else OperationError(
                f"controller step failed: {described(exc)}", engine=s.engine.name)
            if not isinstance(exc, CkptError):
                log.error("%s: step failed", s.engine.name, exc_info=exc)
            out = from_error(err)
        apply(s, out)
    return run


def apply(s: EngineSession, out: StepOutcome) -> None:
    """Write a step's outcome into the engine's ``EngineOutcome`` (and journal its error)."""
    s.outcome.status = out.status
    if out.error is None:
        return
    err = out.error
    s.outcome.error = error_info(err)
    if out.state is not None:
        s.outcome.state = out.state
    elif not isinstance(err, UnreachableError):  # an unreachable engine has no state
        s.outcome.state = s.refresh_state()
    s.record("error", {"kind": err.kind, "message": err.message,
                       "details": p.to_plain(err.details)})


def prepare(s: EngineSession) -> StepOutcome:
    return s.prepare()


def capture(s: EngineSession) -> StepOutcome:
    if s.outcome.state != CheckpointState.PREPARED:
        raise UsageError(f"capture needs a PREPARED engine; {s.engine.name} is {s.outcome.state}",
                         engine=s.engine.name, state=s.outcome.state)
    return s.capture()


def restore(s: EngineSession) -> StepOutcome:
    if s.outcome.state not in (CheckpointState.PREPARED, CheckpointState.FAILED):
        raise UsageError(f"restore needs a PREPARED or FAILED engine; {s.engine.name} is "
                         f"{s.outcome.state}", engine=s.engine.name, state=s.outcome.state)
    return s.restore()


def revive_and_restore(s: EngineSession) -> StepOutcome:
    """A restore whose engine's process may be gone (dumped with stop, or a migration): the
    pre-restore hooks may bring it back from its image, so the session opens after them. An
    engine the preflight found unanswered just now goes to them at once: asking it again
    would only wait out its link's timeout and resend (4 s on a dead TCP port), time that a
    client held by ``tcp-hold`` waits too."""
    if not s.unanswered:
        try:
            s.open()
        except UnreachableError:
            if not find_hooks(s.config.hooks_dir, HookPoint.PRE_RESTORE):
                raise
        else:
            return restore(s)
    # policy: the process is gone and pre-restore hooks may bring it back from an image
    # (what their failure does: the table's (pre-restore, NO_PROCESS))
    out = s.at(HookPoint.PRE_RESTORE, s.pre_restore, condition=HookCondition.NO_PROCESS)
    if out is not None:
        return out
    s.reconnect()
    return s.restore(run_pre_restore=False)


def rollback(s: EngineSession, reason: str) -> StepOutcome:
    s.rollback(reason)
    return StepOutcome.succeeded()


def cycle(s: EngineSession) -> StepOutcome:
    """Prepare, capture, restore; a restore that never reached the agent (a deadline, a
    refusal) leaves the engine PREPARED: a cycle must not strand it, so it rolls back."""
    for step in (prepare, capture):
        out = step(s)
        if out.status is not OutcomeStatus.SUCCEEDED:
            return out
    s.image = s.outcome.image  # what this cycle dumped, if anything
    try:
        return restore(s)
    except CkptError as err:  # policy: PREPARED after a failed restore: roll back
        if s.refresh_state() == CheckpointState.PREPARED:
            s.rollback(f"restore did not run: {err.message}")
            return StepOutcome.rolled_back(err, s.outcome.state)
        raise


def undo_prepare(s: EngineSession, failed: list[str]) -> StepOutcome:
    """An all-or-nothing prepare that failed on ``failed``: roll this prepared engine back."""
    s.rollback(f"group prepare failed on {', '.join(failed)}")
    err = OperationError(f"rolled back: prepare failed on {', '.join(failed)}", failed=failed)
    return StepOutcome.rolled_back(err, s.outcome.state)
