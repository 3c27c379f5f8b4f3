"""The transition table: every (state, trigger) pair, legal or not, and what gets recorded."""

from __future__ import annotations

import pytest

from ckpt_controller.clock import Deadline, ManualClock
from ckpt_controller.errors import InvalidTransitionError, UsageError
from ckpt_controller import lifecycle, vocab
from ckpt_controller.lifecycle import TRANSITIONS, Lifecycle
from ckpt_controller.vocab import CheckpointState, Trigger

S, T = CheckpointState, Trigger

LEGAL = {
    (S.RUNNING, T.PREPARE): S.PREPARING,
    (S.PREPARING, T.SEAL): S.PREPARED,
    (S.PREPARED, T.RESTORE): S.RESTORING,
    (S.FAILED, T.RESTORE): S.RESTORING,
    (S.RESTORING, T.RESUME): S.RUNNING,
    (S.PREPARING, T.ROLLBACK): S.RESTORING,
    (S.PREPARED, T.ROLLBACK): S.RESTORING,
    **{(s, T.FAIL): S.FAILED for s in S},
}


def test_state_values_and_is_restored():
    assert [s.value for s in S] == ["running", "preparing", "prepared", "restoring", "failed"]
    assert S("prepared") is S.PREPARED
    assert {s for s in S if s.is_restored} == {S.RUNNING, S.RESTORING}


def test_table_is_exactly_the_product_lifecycle():
    table = {(src, trig): dst for trig, srcs, dst in TRANSITIONS for src in srcs}
    assert table == LEGAL


@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("trigger", list(T))
def test_every_pair(state, trigger):
    clock = ManualClock()
    lc = Lifecycle(clock, initial=state, generation=3)
    if (state, trigger) in LEGAL:
        rec = lc.fire(trigger, reason="why")
        assert lc.state is LEGAL[(state, trigger)]
        assert (rec.trigger, rec.source, rec.dest, rec.reason) == (trigger, state, lc.state, "why")
        assert rec.monotonic == clock.monotonic() and rec.wall == clock.wall()
    else:
        with pytest.raises(InvalidTransitionError) as info:
            lc.fire(trigger)
        assert lc.state is state and lc.history == []
        err = info.value
        assert isinstance(err, UsageError) and err.exit_code == 2
        assert err.details["state"] == state.value
        assert err.details["trigger"] == trigger.value
        assert err.details["allowed"] == [t.value for t in lc.allowed()]
        assert set(err.details["allowed"]) == {t.value for (s, t) in LEGAL if s is state}


def test_triggers_take_the_step_names():
    """The moves into PREPARED and back to RUNNING are named after the agent's steps that
    make them (``seal``, ``resume``); the lifecycle re-exports the vocabulary, never redefines
    it."""
    names = {(src, dst): trig.value for trig, srcs, dst in TRANSITIONS for src in srcs}
    assert names[(S.PREPARING, S.PREPARED)] == "seal"
    assert names[(S.RESTORING, S.RUNNING)] == "resume"
    assert [t.value for t in T] == ["prepare", "seal", "restore", "resume", "rollback", "fail"]
    assert "prepared" not in {t.value for t in T} and "restored" not in {t.value for t in T}
    assert (lifecycle.CheckpointState, lifecycle.Trigger) == (vocab.CheckpointState, vocab.Trigger)
    assert lifecycle.TRANSITIONAL is vocab.TRANSITIONAL == {S.PREPARING, S.RESTORING}


def test_the_old_trigger_names_still_read():
    """Journals and events written before the rename say ``prepared`` and ``restored``."""
    assert T("prepared") is T.SEAL and T("restored") is T.RESUME
    lc = Lifecycle(initial=S.PREPARING)
    assert lc.fire("prepared").trigger is T.SEAL and lc.state is S.PREPARED
    with pytest.raises(ValueError):
        T("sealed")
    for junk in (["prepared"], {"a": 1}, None, 3):  # not a string: not a trigger, typed
        with pytest.raises(ValueError):
            T(junk)
        with pytest.raises(InvalidTransitionError):
            lc.fire(junk)


def test_unknown_trigger_and_no_shortcuts():
    lc = Lifecycle()
    with pytest.raises(InvalidTransitionError):
        lc.fire("to_prepared")
    with pytest.raises(InvalidTransitionError):
        lc.fire("explode")
    assert not [n for n in dir(lc) if n.startswith("to_")]  # no shortcut around the table
    with pytest.raises(AttributeError):  # the state moves only by a trigger
        lc.state = S.PREPARED
    assert lc.state is S.RUNNING


def test_generation_counts_completed_cycles_only():
    clock = ManualClock()
    lc = Lifecycle(clock)
    for _ in range(3):
        for t in (T.PREPARE, T.SEAL, T.RESTORE, T.RESUME):
            clock.advance(1)
            lc.fire(t)
    assert lc.generation == 3
    # a rollback is not a completed cycle, nor is a recovery from FAILED
    for t in (T.PREPARE, T.ROLLBACK, T.RESUME, T.FAIL, T.RESTORE, T.RESUME):
        lc.fire(t)
    assert lc.generation == 3 and lc.state is S.RUNNING
    gens = [r.generation for r in lc.history]
    assert gens[:4] == [0, 0, 0, 1] and gens == sorted(gens)
    monos = [r.monotonic for r in lc.history]
    assert monos == sorted(monos)


def test_listeners_see_every_transition():
    lc = Lifecycle()
    seen = []
    lc.subscribe(seen.append)
    lc.fire(T.PREPARE)
    lc.fire(T.FAIL, reason="boom")
    assert [(r.source, r.dest) for r in seen] == [(S.RUNNING, S.PREPARING), (S.PREPARING, S.FAILED)]
    assert seen == lc.history


def test_the_earlier_of_two_deadlines():
    clock = ManualClock()
    soon, late, never = (Deadline.after(s, clock) for s in (1.0, 5.0, None))
    assert soon.earlier(late) is soon and late.earlier(soon) is soon
    assert never.earlier(late) is late and late.earlier(never) is late
    assert never.earlier(never).at is None
