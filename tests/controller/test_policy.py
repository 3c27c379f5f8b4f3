"""The hook-failure policy as one table applied in one place: every row's action allowed
where its point runs, nothing else reading the table or deciding on a hook failure, steps'
outcomes, and the drill's expectations derived from that table. (What each point does to a
real engine is test_controller's ``test_every_hook_point_has_its_documented_effect``, and
what a failure leaves behind, test_hook_outcomes.)"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.controller import policy
from ckpt_controller.controller.outcome import StepOutcome, from_error
from ckpt_controller.drill import faults
from ckpt_controller.errors import HookError, OperationError, ResidualOverBudgetError
from ckpt_controller.lifecycle import Lifecycle
from ckpt_controller.vocab import (
    CheckpointState,
    HookCondition,
    HookFailure,
    HookPoint,
    OutcomeStatus,
)


class RecordingEngine:
    """A stand-in for an ``EngineSession`` (no agent here): records what the policy asks of
    it, and moves its state as the real one's replies would. ``undo_error``: what its
    pre-restore hooks' undo of a capture fails with (None: they give back what it took)."""

    name = "e1"

    def __init__(self, state: CheckpointState = CheckpointState.PREPARING,
                 undo_error: HookError | None = None) -> None:
        self.outcome = p.EngineOutcome(engine="e1", status=OutcomeStatus.SKIPPED, state=state)
        self.calls: list[tuple] = []
        self.records: list[tuple[str, dict]] = []
        self.undo_error = undo_error

    def record(self, type_: str, data: dict, **kw) -> None:
        self.records.append((type_, data))

    def refresh_state(self) -> str | None:
        return self.outcome.state

    def rollback(self, reason: str, step: str = "rollback") -> None:
        self.calls.append(("rollback", reason))
        self.outcome.state = CheckpointState.RUNNING

    def mark_failed(self, reason: str) -> None:
        self.calls.append(("mark_failed", reason))
        self.outcome.state = CheckpointState.FAILED

    def on_failed(self) -> None:
        self.calls.append(("on_failed",))

    def undo_capture(self, cause):
        self.calls.append(("undo_capture", cause.message))
        if self.undo_error is None:
            return None
        return policy.hook_failed(self, HookPoint.PRE_RESTORE, self.undo_error,
                                  HookCondition.UNDOING_CAPTURE, cause)


def hook_error(point: HookPoint, code: int = 7) -> HookError:
    return HookError(f"{point} hook 50-bad exited {code}", engine="e1", point=point,
                     exit_code=code)


ROWS = list(policy.HOOK_FAILURE)


def test_the_table_covers_every_hook_point_with_a_policy_word():
    assert {point for point, _ in ROWS} == set(HookPoint)
    assert {(point, HookCondition.PLAIN) for point in HookPoint} <= set(ROWS)  # each in its place
    assert all(isinstance(r.action, HookFailure) and r.runs_in and r.reason.count("{error}")
               for r in policy.HOOK_FAILURE.values())
    for (point, _), r in policy.HOOK_FAILURE.items():  # a row that undoes says what then
        assert not r.undo or {(point, HookCondition.NO_PROCESS),
                              (HookPoint.PRE_RESTORE, HookCondition.UNDOING_CAPTURE)} <= set(ROWS)


@pytest.mark.parametrize("key", ROWS, ids=lambda k: "-".join(k))
def test_every_action_is_allowed_in_every_state_its_point_runs_in(key):
    """What a failure does fires a trigger the lifecycle allows wherever the point runs: a
    roll back where the engine is not PREPARING or PREPARED would be refused by the agent."""
    r = policy.HOOK_FAILURE[key]
    trigger = policy.FIRES[r.action]
    for state in r.runs_in:
        assert trigger is None or trigger in Lifecycle().allowed(state), (key, state)


def test_a_trigger_not_allowed_where_a_point_runs_is_caught(monkeypatch):
    """The check above fails when a row's action does not fit its states."""
    key = (HookPoint.POST_RESTORE, HookCondition.PLAIN)
    bad = dataclasses.replace(policy.HOOK_FAILURE[key], action=HookFailure.ROLLBACK)
    monkeypatch.setitem(policy.HOOK_FAILURE, key, bad)
    with pytest.raises(AssertionError):
        test_every_action_is_allowed_in_every_state_its_point_runs_in(key)


def test_a_failure_on_a_failed_engine_is_only_logged():
    """On-fail runs after the engine was marked FAILED: anything more than a log line would
    mark it again and run on-fail again."""
    assert policy.row(HookPoint.ON_FAIL).action is HookFailure.LOG
    assert policy.row(HookPoint.ON_FAIL).runs_in == {CheckpointState.FAILED}


@pytest.mark.parametrize("key", ROWS, ids=lambda k: "-".join(k))
def test_a_hook_failure_does_what_the_table_says(key):
    point, condition = key
    r = policy.HOOK_FAILURE[key]
    where = min(r.runs_in)  # a state the point runs in
    eng, err = RecordingEngine(where), hook_error(point)
    cause = hook_error(HookPoint.DUMP, 1) if condition is HookCondition.UNDOING_CAPTURE else None
    out = policy.hook_failed(eng, point, err, condition, cause)
    reason = r.reason.format(error=err.message, cause=cause.message if cause else "")
    done = [rec for rec in eng.records if rec[0] == "hook_failure"]
    assert done == [("hook_failure", {"point": point, "condition": condition,
                                      "action": r.action, "kind": "HookError",
                                      "message": err.message, "reason": reason})]
    undo = [("undo_capture", err.message)] if r.undo else []
    if r.action is HookFailure.LOG:
        assert out is None and eng.calls == []  # the operation goes on
    elif r.action is HookFailure.VETO:
        assert out == StepOutcome.failed(err) and eng.calls == []  # nothing moved
    elif r.action is HookFailure.ROLLBACK:
        assert eng.calls == [*undo, ("rollback", reason)]
        assert out == StepOutcome.rolled_back(err, CheckpointState.RUNNING)
    else:
        assert eng.calls == [("mark_failed", reason), ("on_failed",)]
        assert out == StepOutcome.failed(cause or err, CheckpointState.FAILED)


@pytest.mark.parametrize("point", [HookPoint.DUMP, HookPoint.POST_DUMP])
def test_a_failed_capture_is_undone_first_or_failed_if_the_undo_fails(point):
    err, undo = hook_error(point, 1), hook_error(HookPoint.PRE_RESTORE, 9)
    eng = RecordingEngine(CheckpointState.PREPARED, undo_error=undo)
    out = policy.hook_failed(eng, point, err)
    assert out == StepOutcome.failed(err, CheckpointState.FAILED)  # the capture's error
    assert err.details["undo_error"] == undo.message  # the undo's beside it
    assert eng.calls[0] == ("undo_capture", err.message) and eng.calls[1][0] == "mark_failed"
    assert "could not undo it" in eng.calls[1][1] and ("rollback",) not in eng.calls
    # whose process is gone: nothing to undo, nothing to roll back
    eng = RecordingEngine(CheckpointState.FAILED)
    out = policy.hook_failed(eng, point, err)
    assert out == StepOutcome.failed(err) and eng.calls == []
    assert eng.records[-1][1]["condition"] == HookCondition.NO_PROCESS


def test_the_policy_follows_the_table_not_a_copy(monkeypatch):
    """Change the table and the behaviour changes with it: nothing else decides."""
    key = (HookPoint.POST_DRAIN, HookCondition.PLAIN)
    monkeypatch.setitem(policy.HOOK_FAILURE, key, policy.Row(
        HookFailure.FAIL, "changed: {error}", frozenset({CheckpointState.PREPARING})))
    eng, err = RecordingEngine(), hook_error(HookPoint.POST_DRAIN)
    out = policy.hook_failed(eng, HookPoint.POST_DRAIN, err)
    assert eng.calls == [("mark_failed", f"changed: {err.message}"), ("on_failed",)]
    assert out.state == CheckpointState.FAILED


PACKAGE = Path(policy.__file__).resolve().parents[1]
#: calls that run a hook point (or what stands in for one): a failure there is the table's
RUNS_A_POINT = {"hooks", "hook_phase", "run_point", "run_hook", "before_resume"}
HOOK_ERRORS = {"HookError", "HookTimeoutError"}


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


def deciders(source: str, module: str) -> list[str]:
    """Where ``source`` (the module ``module``, a path below the package) decides on a hook
    failure outside the one place: reads ``HOOK_FAILURE`` outside policy.py, calls
    ``hook_failed`` outside the runner (``EngineSession.at``), catches hook errors by name,
    or wraps a call that runs a hook point in a ``try`` with handlers outside the runner."""
    found = []
    runner = {"controller/session.py": "at", "controller/policy.py": "hook_failed"}

    def visit(node: ast.AST, func: str | None) -> None:
        if isinstance(node, ast.FunctionDef):
            func = node.name if func is None or runner.get(module) != func else func
        name = _name(node) if isinstance(node, ast.Name | ast.Attribute) else None
        if name == "HOOK_FAILURE" and module != "controller/policy.py":
            found.append(f"{module}:{node.lineno} reads HOOK_FAILURE")
        if isinstance(node, ast.Call) and _name(node.func) == "hook_failed" \
                and func != runner.get(module):
            found.append(f"{module}:{node.lineno} applies the table outside the runner")
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            if HOOK_ERRORS & {_name(t) for t in types}:
                found.append(f"{module}:{node.lineno} catches a hook error")
        if isinstance(node, ast.Try) and node.handlers and func != runner.get(module):
            for call in (n for stmt in node.body for n in ast.walk(stmt)):
                if isinstance(call, ast.Call) and _name(call.func) in RUNS_A_POINT:
                    found.append(f"{module}:{call.lineno} decides on a failure to run a point")
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(source), None)
    return found


def test_the_table_is_read_and_applied_in_one_place():
    """Only policy.py reads the table, only the session's runner applies it, and nothing in
    the controller catches a hook point's failure to decide what it means on its own."""
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        offences += deciders(path.read_text(), module)
    assert offences == []


def test_the_one_place_check_finds_a_decision_made_elsewhere():
    """What the check above finds: the shapes the controller had before (a step that caught
    the capture's failure and marked the engine FAILED itself, a hook error caught by name)."""
    before = textwrap.dedent("""
        def capture(s):
            try:
                s.hooks(HookPoint.PRE_RESTORE, undo_capture=True)
            except CkptError as undo:
                s.mark_failed("could not undo")

        def prepare(self):
            try:
                self.hook_phase(HookPoint.PRE_PREPARE)
            except (HookError, HookTimeoutError) as err:
                return hook_failed(self, HookPoint.PRE_PREPARE, err)
            return HOOK_FAILURE[HookPoint.DUMP]
    """)
    found = deciders(before, "controller/steps.py")
    assert sorted(f.split(" ", 1)[1] for f in found) == [
        "applies the table outside the runner", "catches a hook error",
        "decides on a failure to run a point", "decides on a failure to run a point",
        "reads HOOK_FAILURE"]


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
    action = policy.row(faults.RUNS_WITH.get(point, point)).action
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
