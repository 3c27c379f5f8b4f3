"""The hook-failure policy as one table applied in one place, steps' outcomes, and the
drill's expectations derived from that table. (What each point does to a real engine is
test_controller's ``test_every_hook_point_has_its_documented_effect``.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.controller import policy
from ckpt_controller.controller.outcome import StepOutcome, from_error
from ckpt_controller.drill import faults
from ckpt_controller.errors import HookError, OperationError, ResidualOverBudgetError
from ckpt_controller.vocab import CheckpointState, HookFailure, HookPoint, OutcomeStatus


class RecordingEngine:
    """A stand-in for an ``EngineSession`` (no agent here): records what the policy asks of
    it, and moves its state as the real one's replies would."""

    name = "e1"

    def __init__(self) -> None:
        self.outcome = p.EngineOutcome(engine="e1", status=OutcomeStatus.SKIPPED,
                                       state=CheckpointState.PREPARING)
        self.calls: list[tuple[str, str]] = []

    def rollback(self, reason: str, step: str = "rollback") -> None:
        self.calls.append(("rollback", reason))
        self.outcome.state = CheckpointState.RUNNING

    def mark_failed(self, reason: str) -> None:
        self.calls.append(("mark_failed", reason))
        self.outcome.state = CheckpointState.FAILED


def hook_error(point: HookPoint) -> HookError:
    return HookError(f"{point} hook 50-bad exited 7", engine="e1", point=point, exit_code=7)


def test_the_table_covers_every_hook_point_with_a_policy_word():
    assert set(policy.HOOK_FAILURE) == set(HookPoint)
    assert all(isinstance(v, HookFailure) for v in policy.HOOK_FAILURE.values())


@pytest.mark.parametrize("point", list(HookPoint))
def test_a_hook_failure_does_what_the_table_says(point):
    eng, err = RecordingEngine(), hook_error(point)
    out = policy.hook_failed(eng, point, err, reason="why")
    action = policy.HOOK_FAILURE[point]
    if action is HookFailure.LOG:
        assert out is None and eng.calls == []  # the operation goes on
    elif action is HookFailure.VETO:
        assert out == StepOutcome.failed(err) and eng.calls == []  # nothing moved
    elif action is HookFailure.ROLLBACK:
        assert eng.calls == [("rollback", "why")]
        assert out == StepOutcome.rolled_back(err, CheckpointState.RUNNING)
    else:
        assert eng.calls == [("mark_failed", "why")]
        assert out == StepOutcome.failed(err, CheckpointState.FAILED)


def test_the_policy_follows_the_table_not_a_copy(monkeypatch):
    """Change the table and the behaviour changes with it: nothing else decides."""
    monkeypatch.setitem(policy.HOOK_FAILURE, HookPoint.POST_DRAIN, HookFailure.FAIL)
    eng, err = RecordingEngine(), hook_error(HookPoint.POST_DRAIN)
    out = policy.hook_failed(eng, "post-drain", err)
    assert eng.calls == [("mark_failed", err.message)] and out.state == CheckpointState.FAILED


def test_an_agents_error_becomes_an_outcome_in_one_place():
    # the agent rolled its failed prepare back itself and says so on the wire
    wire = p.ErrorInfo(kind="ResidualOverBudgetError", message="over budget",
                       details={"rolled_back": True, "state": "running"}).to_exception()
    assert isinstance(wire, ResidualOverBudgetError)
    assert from_error(wire) == StepOutcome.rolled_back(wire, "running")
    # an error naming the state it left the engine in, and one naming none (asked later)
    named = OperationError("no", state="failed")
    assert from_error(named) == StepOutcome.failed(named, "failed")
    bare = OperationError("no")
    assert from_error(bare) == StepOutcome.failed(bare) and from_error(bare).state is None


@pytest.mark.parametrize("point", list(HookPoint))
def test_the_drill_expects_what_the_table_says(point):
    exp = faults.expected("fail-hook", point)
    # on-fail runs only with another failure (post-restore): the cycle ends as that one says
    action = policy.HOOK_FAILURE[faults.RUNS_WITH.get(point, point)]
    state, status = {HookFailure.VETO: ("running", "failed"),
                     HookFailure.ROLLBACK: ("running", "rolled_back"),
                     HookFailure.FAIL: ("failed", "failed"),
                     HookFailure.LOG: ("running", "succeeded")}[action]
    assert (exp.state, exp.status) == (state, (status,))
    assert exp.after == ("recover" if state == "failed" else "none")


def test_the_cli_gets_its_exit_codes_without_the_controller_service():
    code = ("import sys; from ckpt_controller.controller.exit_codes import exit_code; "
            "assert 'ckpt_controller.controller.service' not in sys.modules; "
            "assert 'ckpt_controller.controller.session' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
