"""The wait drain's policy at its deadline (``agent.drain``), on a ``ManualClock``: the
operation's own deadline is a failure (exit 3), ``fail`` is a ``DrainError`` with what is still
in flight, ``abort`` and ``keep`` are escalations, logged once. The agent and the vLLM sidecar
both use it; their drains are tested with real processes in ``test_agent*.py`` and
``test_vllm_adapter.py``.
Neighbours: ``agent.drain``, ``clock``.
"""

from __future__ import annotations

import logging

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.agent.drain import ESCALATES_TO, DrainPolicy, Escalated
from ckpt_controller.clock import Deadline, ManualClock
from ckpt_controller.errors import DeadlineError, DrainError
from ckpt_controller.vocab import DrainMode, Escalation, PrepareStep


def command(on_deadline: Escalation, drain_timeout_s: float = 5.0) -> p.PrepareCommand:
    return p.PrepareCommand(call_id=0, op_id="op-1", drain=DrainMode.WAIT,
                            drain_timeout_s=drain_timeout_s, on_deadline=on_deadline)


def not_asked() -> int:
    raise AssertionError("the in-flight count is asked only when the drain fails")


def test_every_escalation_but_fail_is_a_drain_mode():
    assert set(ESCALATES_TO) == set(Escalation) - {Escalation.FAIL}
    assert all(ESCALATES_TO[e] is DrainMode(e.value) for e in ESCALATES_TO)


def test_the_drain_deadline_is_the_drain_timeout_or_the_operation_deadline_if_sooner():
    clock = ManualClock()
    now = clock.monotonic()
    assert DrainPolicy(command(Escalation.ABORT), Deadline.after(None, clock)).drain_deadline.at \
        == now + 5.0
    assert DrainPolicy(command(Escalation.ABORT), Deadline.after(60, clock)).drain_deadline.at \
        == now + 5.0
    assert DrainPolicy(command(Escalation.ABORT), Deadline.after(2, clock)).drain_deadline.at \
        == now + 2.0
    zero = DrainPolicy(command(Escalation.ABORT, drain_timeout_s=0), Deadline.after(60, clock))
    assert zero.drain_deadline.passed()  # 0: the drain deadline is now


def test_the_drain_deadline_counts_from_when_the_wait_begins():
    clock = ManualClock()
    op_deadline = Deadline.after(60, clock)
    clock.advance(10)  # say, a baseline taken before the wait
    policy = DrainPolicy(command(Escalation.ABORT), op_deadline)
    clock.advance(4.9)
    assert not policy.drain_deadline.passed()
    clock.advance(0.1)
    assert policy.drain_deadline.passed()


@pytest.mark.parametrize("on_deadline", [Escalation.ABORT, Escalation.KEEP])
def test_abort_and_keep_escalate_logged_once(on_deadline, caplog):
    caplog.set_level(logging.INFO, logger="ckpt_controller.agent")
    clock = ManualClock()
    policy = DrainPolicy(command(on_deadline), Deadline.after(60, clock), engine="e0")
    clock.advance(5)
    assert policy.escalate(not_asked) == Escalated(mode=DrainMode(on_deadline.value),
                                                   escalated_to=on_deadline)
    said = [r.getMessage() for r in caplog.records if "escalating" in r.getMessage()]
    assert said == [f"e0: drain deadline (5.0s) passed, escalating to {on_deadline.value}"]


def test_fail_is_a_drain_error_with_what_is_in_flight():
    clock = ManualClock()
    policy = DrainPolicy(command(Escalation.FAIL), Deadline.after(60, clock), engine="e0")
    clock.advance(5)
    with pytest.raises(DrainError) as info:
        policy.escalate(lambda: 3)
    assert info.value.exit_code == 1 and "still in flight" in info.value.message
    assert info.value.details == {"engine": "e0", "op_id": "op-1", "step": PrepareStep.DRAIN,
                                  "in_flight": 3, "drain_timeout_s": 5.0}


@pytest.mark.parametrize("on_deadline", list(Escalation))
def test_the_operations_own_deadline_is_a_failure_never_escalated(on_deadline):
    clock = ManualClock()
    policy = DrainPolicy(command(on_deadline, drain_timeout_s=30), Deadline.after(2, clock),
                         url="http://127.0.0.1:8000")
    clock.advance(2)
    assert policy.drain_deadline.passed()
    with pytest.raises(DeadlineError) as info:
        policy.escalate(not_asked)
    assert info.value.exit_code == 3
    assert info.value.details == {"url": "http://127.0.0.1:8000", "op_id": "op-1",
                                  "step": PrepareStep.DRAIN}
