"""What a hook's failure at each point does: one table, applied in one place.

``HOOK_FAILURE`` says, for every ``HookPoint``, what a hook's non-zero exit or timeout there
means (``HookFailure``): a veto (nothing moved yet; the engine stays RUNNING), a roll back to
RUNNING, FAILED, or a log line. ``hook_failed`` applies it to one engine and returns the step's
outcome (``None`` for a log-only point: the operation goes on). The session and the steps call
it; the drill derives what each injected hook fault must lead to from the same table.
Neighbours: ``vocab`` (the words), ``outcome`` (what a step returns), ``session`` and
``steps`` (the callers), ``hooks`` (which points exist), ``drill.faults``.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ckpt_controller import protocol as p
from ckpt_controller.controller.outcome import StepOutcome
from ckpt_controller.errors import CkptError
from ckpt_controller.vocab import CheckpointState, HookFailure, HookPoint

log = logging.getLogger("ckpt_controller.controller")

#: point -> what a non-zero exit or a timeout of one of its hooks does
HOOK_FAILURE: dict[HookPoint, HookFailure] = {
    HookPoint.PRE_PREPARE: HookFailure.VETO,  # nothing moved yet: the engine stays RUNNING
    HookPoint.POST_DRAIN: HookFailure.ROLLBACK,
    HookPoint.POST_RELEASE: HookFailure.ROLLBACK,
    HookPoint.DUMP: HookFailure.ROLLBACK,  # if the process lives (``steps.capture``)
    HookPoint.POST_DUMP: HookFailure.ROLLBACK,
    HookPoint.PRE_RESTORE: HookFailure.FAIL,
    HookPoint.POST_RESTORE: HookFailure.FAIL,
    HookPoint.POST_RESUME: HookFailure.LOG,
    HookPoint.ON_FAIL: HookFailure.LOG,
}


class Engine(Protocol):
    """What applying the policy needs of an engine's session (``session.EngineSession``)."""

    outcome: p.EngineOutcome

    @property
    def name(self) -> str: ...

    def rollback(self, reason: str, step: str = ...) -> None: ...

    def mark_failed(self, reason: str) -> None: ...


def hook_failed(s: Engine, point: HookPoint | str, err: CkptError,
                reason: str | None = None) -> StepOutcome | None:
    """Apply ``HOOK_FAILURE[point]`` to the engine after ``err`` (a failure of ``point``'s
    hooks): roll it back, or mark it FAILED (``reason``, default the error's message, is what
    the engine's transition says), and return the step's outcome; ``None`` when the failure
    is only logged and the operation goes on. A rollback that fails raises its own error."""
    action = HOOK_FAILURE[HookPoint(point)]
    if action is HookFailure.LOG:
        log.warning("%s: %s", s.name, err)
        return None
    if action is HookFailure.VETO:
        return StepOutcome.failed(err)  # the state is asked for: nothing moved
    if action is HookFailure.FAIL:
        s.mark_failed(reason or err.message)
        return StepOutcome.failed(err, CheckpointState.FAILED)
    s.rollback(reason or err.message)
    return StepOutcome.rolled_back(err, s.outcome.state)
