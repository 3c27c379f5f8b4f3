"""What a failure at each hook point does: one table, applied in one place.

``HOOK_FAILURE`` has a row for every hook point, and for the conditions under which a
point's failure means something else (``vocab.HookCondition``): the pre-restore hooks undoing
a failed capture, a point whose engine's process is gone, the fleet's take-over check before a
migrated engine is admitted. A row says what a failure there does (``HookFailure``: a veto, a roll back to
RUNNING, FAILED, or a log line), the reason the engine's journal gives, and the states the
engine is in when the point runs (the action's trigger must be allowed there:
``tests/controller/test_policy.py``). ``hook_failed`` applies a row; its one caller is the session's
runner (``EngineSession.at``), which runs a point and turns any failure to run it into the
step's outcome. The drill derives what each injected hook fault must lead to from the same
table (``row``). Neighbours: ``vocab`` (the words), ``outcome`` (what a step returns),
``session`` (the runner), ``hooks`` (which points exist), ``drill.faults``; docs/hooks.md
shows the table to people.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from ckpt_controller import protocol as p
from ckpt_controller.controller.outcome import StepOutcome, from_error
from ckpt_controller.errors import CkptError
from ckpt_controller.vocab import (
    CheckpointState,
    HookCondition,
    HookFailure,
    HookPoint,
    Trigger,
)

log = logging.getLogger("ckpt_controller.controller")


@dataclass(frozen=True)
class Row:
    action: HookFailure
    #: why, as the engine's transition (rollback, FAILED), the journal and the log say it:
    #: ``{error}`` is the failure's message, ``{cause}`` that of the failure being undone
    reason: str
    #: the states the engine is in when the point runs
    runs_in: frozenset[CheckpointState]
    #: a failed capture: if the engine still stands where the point runs, the pre-restore
    #: hooks give back what the capture took first ((pre-restore, UNDOING_CAPTURE) says what
    #: their failure does); if it does not, its process is gone ((point, NO_PROCESS))
    undo: bool = False


S, P, C, A = CheckpointState, HookPoint, HookCondition, HookFailure


def _in(*states: CheckpointState) -> frozenset[CheckpointState]:
    return frozenset(states)


#: (point, condition) -> what a non-zero exit, a timeout or a refusal there does
HOOK_FAILURE: dict[tuple[HookPoint, HookCondition], Row] = {
    (P.PRE_PREPARE, C.PLAIN): Row(A.VETO, "vetoed by a pre-prepare hook: {error}",
                                  _in(S.RUNNING)),  # nothing moved yet: it stays RUNNING
    (P.POST_DRAIN, C.PLAIN): Row(A.ROLLBACK, "post-drain hook failed: {error}",
                                 _in(S.PREPARING)),
    (P.POST_RELEASE, C.PLAIN): Row(A.ROLLBACK, "post-release hook failed: {error}",
                                   _in(S.PREPARING)),
    (P.DUMP, C.PLAIN): Row(A.ROLLBACK, "capture failed: {error}", _in(S.PREPARED), undo=True),
    (P.DUMP, C.NO_PROCESS): Row(A.VETO, "capture failed and the engine's process is gone: "
                                "nothing to roll back: {error}", _in(S.PREPARED)),
    (P.POST_DUMP, C.PLAIN): Row(A.ROLLBACK, "capture failed: {error}", _in(S.PREPARED),
                                undo=True),
    (P.POST_DUMP, C.NO_PROCESS): Row(A.VETO, "capture failed and the engine's process is "
                                     "gone: nothing to roll back: {error}", _in(S.PREPARED)),
    (P.PRE_RESTORE, C.PLAIN): Row(A.FAIL, "{error}", _in(S.PREPARED, S.FAILED)),
    # what the dump took is not given back: not left RUNNING on a GPU still locked
    (P.PRE_RESTORE, C.UNDOING_CAPTURE): Row(
        A.FAIL, "capture failed ({cause}) and the pre-restore hooks could not undo it: {error}",
        _in(S.PREPARED)),
    # no engine to mark FAILED: the failure is the outcome (the image is still there)
    (P.PRE_RESTORE, C.NO_PROCESS): Row(A.VETO, "the pre-restore hooks did not bring the "
                                       "engine's process back: {error}",
                                       _in(S.PREPARED, S.FAILED)),
    (P.POST_RESTORE, C.PLAIN): Row(A.FAIL, "post-restore hook failed: {error}",
                                   _in(S.RESTORING)),
    # not to be admitted here: FAILED, as a failed post-restore check is (the engine never
    # runs on two nodes); a reconciler asks before it settles a PREPARING or PREPARED one too
    (P.POST_RESTORE, C.TAKING_OVER): Row(A.FAIL, "not resumed: {error}",
                                         _in(S.PREPARING, S.PREPARED, S.RESTORING)),
    (P.POST_RESUME, C.PLAIN): Row(A.LOG, "post-resume hook failed (logged only): {error}",
                                  _in(S.RUNNING)),
    # the engine is FAILED already; anything but a log line would run on-fail again
    (P.ON_FAIL, C.PLAIN): Row(A.LOG, "on-fail hook failed (logged only): {error}",
                              _in(S.FAILED)),
}

#: the lifecycle trigger each action fires on the engine (None: it moves nothing)
FIRES: dict[HookFailure, Trigger | None] = {
    A.VETO: None, A.ROLLBACK: Trigger.ROLLBACK, A.FAIL: Trigger.FAIL, A.LOG: None,
}


def row(point: HookPoint | str, condition: HookCondition = HookCondition.PLAIN) -> Row:
    """The table's row for ``point`` under ``condition`` (what the drill expects by)."""
    return HOOK_FAILURE[HookPoint(point), condition]


class Engine(Protocol):
    """What applying the policy needs of an engine's session (``session.EngineSession``)."""

    outcome: p.EngineOutcome

    @property
    def name(self) -> str: ...

    def record(self, type_: str, data: dict, **kw) -> None: ...

    def refresh_state(self) -> str | None: ...

    def rollback(self, reason: str, step: str = ...) -> None: ...

    def mark_failed(self, reason: str) -> None: ...

    def undo_capture(self, cause: CkptError) -> StepOutcome | None: ...

    def on_failed(self) -> StepOutcome | None: ...


def hook_failed(s: Engine, point: HookPoint, err: CkptError,
                condition: HookCondition = HookCondition.PLAIN,
                cause: CkptError | None = None) -> StepOutcome | None:
    """Apply the row for ``(point, condition)`` after ``err`` (a failure to run the point,
    while undoing ``cause`` if given): journal it (``hook_failure``), then log it, or roll the
    engine back, or mark it FAILED (and run its on-fail hooks), and return the step's outcome;
    ``None`` when the failure is only logged and the operation goes on. Called by the
    session's runner (``EngineSession.at``) only. A rollback that fails raises its own error."""
    rule = HOOK_FAILURE[point, condition]
    if rule.undo:
        if s.refresh_state() not in rule.runs_in:
            return hook_failed(s, point, err, HookCondition.NO_PROCESS)
        if (undone := s.undo_capture(err)) is not None:
            return undone
    reason = rule.reason.format(error=err.message, cause=cause.message if cause else "")
    s.record("hook_failure", {"point": point, "condition": condition, "action": rule.action,
                              "kind": err.kind, "message": err.message, "reason": reason})
    if rule.action is HookFailure.LOG:
        log.warning("%s: %s", s.name, reason)
        return None
    if rule.action is HookFailure.VETO:
        return from_error(err)  # nothing moved: where the error says, or ask the agent
    if rule.action is HookFailure.ROLLBACK:
        s.rollback(reason)
        return StepOutcome.rolled_back(err, s.outcome.state)
    if cause is not None:  # the outcome is the failure being undone, the undo's beside it
        cause.details["undo_error"] = err.message
    s.mark_failed(reason)
    return s.on_failed() or StepOutcome.failed(cause or err, CheckpointState.FAILED)
