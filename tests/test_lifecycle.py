"""The transition table: every (state, trigger) pair, legal or not, and what gets recorded;
the ``transitions`` machine that holds it (no shortcuts, nothing moved by a refusal, many
threads at once)."""

from __future__ import annotations

import dataclasses
import logging
import threading

import msgspec
import pytest
from transitions import Machine

from ckpt_controller import lifecycle, vocab
from ckpt_controller import protocol as p
from ckpt_controller.clock import Deadline, ManualClock
from ckpt_controller.errors import InvalidTransitionError, UsageError
from ckpt_controller.lifecycle import TRANSITIONS, Lifecycle, Transition
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


# ---------------------------------------------------------------- the machine underneath


def test_the_machine_is_transitions_without_shortcuts():
    """Every move is a ``transitions.Machine``'s, built from the one table with
    ``auto_transitions=False``: no ``to_<state>()`` on its model, nor on the lifecycle."""
    lc = Lifecycle()
    machine, model = lc._machine, lc._model
    assert isinstance(machine, Machine) and machine.auto_transitions is False
    assert machine.send_event is False and not machine.ignore_invalid_triggers
    assert list(machine.states) == [s.value for s in S]  # the wire values
    assert list(machine.events) == [t.value for t, _, _ in TRANSITIONS]
    assert not [n for n in dir(model) if n.startswith("to_")]
    assert not [n for n in dir(lc) if n.startswith("to_") or n in {t.value for t in T}]
    moves = {(S(src), T(name)): S(tr.dest) for name, ev in machine.events.items()
             for src, trs in ev.transitions.items() for tr in trs}
    assert moves == LEGAL  # the machine holds the table, nothing more
    for s in S:  # what the lifecycle allows is what the machine has triggers for
        assert lc.allowed(s) == [T(t) for t in machine.get_triggers(s.value)]


@pytest.mark.parametrize(("source", "trigger"), sorted(LEGAL))
def test_every_row_moves_through_the_machine(source, trigger):
    lc = Lifecycle(initial=source)
    assert lc._model.state == source.value
    rec = lc.fire(trigger)
    assert lc._model.state == LEGAL[(source, trigger)].value  # the machine's model moved
    assert lc.state is rec.dest is LEGAL[(source, trigger)]


@pytest.mark.parametrize("junk", ["explode", "to_running", "trigger", "", "RUNNING", None, 3,
                                  2.5, ["prepare"], {"trigger": "prepare"}, b"prepare"])
def test_unknown_and_non_string_triggers_move_nothing(junk):
    clock = ManualClock()
    lc = Lifecycle(clock, initial=S.PREPARED, generation=4)
    seen = []
    lc.subscribe(seen.append)
    for call in (lc.fire, lc.check):
        with pytest.raises(InvalidTransitionError) as info:
            call(junk)
        assert info.value.details == {"state": "prepared", "trigger": str(junk),
                                      "allowed": ["restore", "rollback", "fail"]}
    assert (lc.state, lc.generation, lc.history, seen) == (S.PREPARED, 4, [], [])
    assert lc._model.state == "prepared"


def test_an_illegal_trigger_moves_nothing_and_check_agrees_with_fire():
    lc = Lifecycle(initial=S.RESTORING, generation=2)
    lc.fire(T.RESUME)
    history = lc.history
    for trig in T:
        allowed = trig in lc.allowed()
        try:
            assert lc.check(trig) is trig and allowed
        except InvalidTransitionError:
            assert not allowed
    with pytest.raises(InvalidTransitionError, match="cannot seal an engine that is running"):
        lc.fire(T.SEAL)
    assert (lc.state, lc.generation, lc.history) == (S.RUNNING, 2, history)


def test_history_is_bounded_and_listeners_run_in_order():
    lc = Lifecycle(history_limit=3)
    calls = []
    lc.subscribe(lambda t: calls.append(("a", t.trigger)))
    lc.subscribe(lambda t: calls.append(("b", t.trigger)))
    for t in (T.PREPARE, T.SEAL, T.RESTORE, T.RESUME):
        lc.fire(t)
    assert [r.trigger for r in lc.history] == [T.SEAL, T.RESTORE, T.RESUME]
    assert calls[:2] == [("a", T.PREPARE), ("b", T.PREPARE)] and len(calls) == 8


def test_a_listener_may_fire_again_under_the_same_lock():
    lc = Lifecycle()

    def fail_on_seal(t):
        if t.trigger is T.SEAL:
            lc.fire(T.FAIL, reason="listener")
    lc.subscribe(fail_on_seal)
    lc.fire(T.PREPARE)
    lc.fire(T.SEAL)
    assert lc.state is S.FAILED
    assert [r.trigger for r in lc.history] == [T.PREPARE, T.SEAL, T.FAIL]


def test_many_threads_firing_keep_the_state_and_history_consistent():
    """Threads race to fire whatever the state they see allows: each move is whole (the
    record's source is the state the previous record left), none is lost or doubled."""
    lc = Lifecycle(history_limit=100_000)
    seen = []
    lc.subscribe(seen.append)
    errors = []

    def worker(seed: int) -> None:
        order = (T.PREPARE, T.SEAL, T.RESTORE, T.RESUME, T.ROLLBACK, T.FAIL)
        for i in range(400):
            trig = order[(seed + i) % len(order)]
            if trig is T.FAIL and i % 7:
                continue
            try:
                lc.fire(trig)
            except InvalidTransitionError:
                pass  # another thread moved first: the state did not allow it any more
            except Exception as exc:  # policy: the test reports any other error
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    history = lc.history
    assert errors == [] and history == seen and len(history) > 8
    assert history[0].source is S.RUNNING and history[-1].dest is lc.state
    for before, after in zip(history, history[1:]):
        assert after.source is before.dest
        assert LEGAL[(after.source, after.trigger)] is after.dest
        assert after.generation >= before.generation
    assert lc._model.state == lc.state.value


def test_transitions_logs_nothing_per_move(caplog):
    """transitions logs each move at INFO and DEBUG; the lifecycle turns that off, so a
    process logging at DEBUG gets no line of it per move (and pays only the level checks)."""
    lc = Lifecycle()
    with caplog.at_level(logging.DEBUG):
        for t in (T.PREPARE, T.SEAL, T.RESTORE, T.RESUME):
            lc.fire(t)
    assert [r for r in caplog.records if r.name.startswith("transitions")] == []
    assert not logging.getLogger("transitions.core").isEnabledFor(logging.INFO)


def test_the_wire_record_is_the_lifecycle_record():
    """``protocol.TransitionRecord`` carries a ``Transition`` field for field, in order; ``of``
    is the one conversion, and its encoding is what journals and peers read."""
    assert tuple(f.name for f in dataclasses.fields(Transition)) == \
        p.TransitionRecord.__struct_fields__
    lc = Lifecycle(ManualClock())
    t = lc.fire(T.PREPARE, reason="op 1")
    wire = p.TransitionRecord.of(t)
    assert msgspec.structs.asdict(wire) == dataclasses.asdict(t)
    assert msgspec.msgpack.decode(p.encode(wire)) == {
        "trigger": "prepare", "source": "running", "dest": "preparing", "generation": 0,
        "monotonic": t.monotonic, "wall": t.wall, "reason": "op 1"}
