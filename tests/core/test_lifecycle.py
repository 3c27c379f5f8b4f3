"""The transition table: every (state, trigger) pair, legal or not, and what gets recorded;
the ``transitions`` machine that holds it (no shortcuts, nothing moved by a refusal, many
threads at once); ``ckptctl lifecycle``'s diagrams and the docs that show them."""

from __future__ import annotations

import ast
import dataclasses
import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import msgspec
import pytest
from transitions import Machine

from ckpt_controller import lifecycle, vocab
from ckpt_controller import protocol as p
from ckpt_controller.clock import Deadline, ManualClock
from ckpt_controller.errors import InvalidTransitionError, UsageError
from ckpt_controller.lifecycle import (
    TRANSITIONS,
    Lifecycle,
    Transition,
    mermaid_diagram,
    text_diagram,
)
from ckpt_controller.vocab import CheckpointState, Trigger
from support import ROOT
from support.cli import ckptctl
from support.timing import scaled

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


def test_a_transition_with_callbacks_runs_the_librarys_whole_execute():
    """The lifecycle's transitions skip the callback lists its table leaves empty; a machine
    of the same classes given a condition or a callback still runs them (the library's
    ``execute``), so the shortcut cannot drop one."""
    config = lifecycle.machine_config()
    calls: list[str] = []

    class Model:
        def allowed(self) -> bool:
            calls.append("condition")
            return self.ok

        def before(self) -> None:
            calls.append("before")

    model = Model()
    model.ok = False
    machine = lifecycle._Machine(model=model, **config)
    machine.add_transition("hold", "running", "preparing", conditions="allowed",
                           before="before")
    assert model.hold() is False and model.state == "running" and calls == ["condition"]
    model.ok = True
    assert model.hold() is True and model.state == "preparing"
    assert calls == ["condition", "condition", "before"]
    assert type(machine.events["prepare"].transitions["running"][0]) is lifecycle._Transition


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


# ---------------------------------------------------------------- the diagram


def fenced(path: Path, after: str, lang: str = "") -> str:
    """The first ```lang fenced block after the line ``after`` in ``path``."""
    text = path.read_text()
    start = text.index(f"\n```{lang}\n", text.index(after)) + len(lang) + 5
    return text[start:text.index("\n```\n", start) + 1]


def test_ckptctl_lifecycle_prints_the_table_as_text():
    out = ckptctl("lifecycle")
    assert out.returncode == 0 and out.stderr == ""
    assert ckptctl("lifecycle", "--format", "text").stdout == out.stdout == text_diagram()
    lines = out.stdout.splitlines()
    assert lines[0] == ("RUNNING --prepare--> PREPARING --seal--> PREPARED --restore--> "
                        "RESTORING --resume--> RUNNING")
    assert "   any state --fail--> FAILED" in lines
    assert "   PREPARING or PREPARED --rollback--> RESTORING" in lines
    assert "   FAILED --restore--> RESTORING" in lines
    # every row of the table is drawn: each (trigger, destination) pair is on some line
    for trig, _, dest in TRANSITIONS:
        assert f"--{trig.value}--> {dest.name}" in out.stdout


def test_ckptctl_lifecycle_prints_the_machine_as_mermaid():
    out = ckptctl("lifecycle", "--format", "mermaid")
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout == mermaid_diagram()
    assert "stateDiagram-v2" in out.stdout and "[*] --> running" in out.stdout
    edges = {line.strip() for line in out.stdout.splitlines() if " --> " in line}
    for (src, trig), dst in LEGAL.items():  # each move, on its edge (several share one)
        assert any(e.startswith(f"{src.value} --> {dst.value}: ") and
                   trig.value in e.split(": ", 1)[1].split(" | ") for e in edges), (src, trig)
    assert all(line == line.rstrip() for line in out.stdout.splitlines())


def test_ckptctl_lifecycle_refuses_a_format_it_does_not_know():
    out = ckptctl("lifecycle", "--format", "dot")
    assert out.returncode == 2 and out.stdout == ""
    assert "usage:" in out.stderr and "invalid choice: 'dot'" in out.stderr
    out = ckptctl("lifecycle", "--help")
    assert out.returncode == 0 and "--format {text,mermaid}" in out.stdout


def test_the_docs_show_what_ckptctl_lifecycle_prints():
    """The README's lifecycle, the lifecycle module's docstring and docs/agent.md's Mermaid
    diagram are the command's output: change the table, regenerate them."""
    text, mermaid = ckptctl("lifecycle").stdout, ckptctl("lifecycle", "--format", "mermaid").stdout
    assert fenced(ROOT / "README.md", "## The lifecycle") == text
    assert fenced(ROOT / "docs" / "agent.md", "# The agent", "mermaid") == mermaid
    assert textwrap.indent(text, "    ") in lifecycle.__doc__


def test_the_diagrams_extension_loads_for_the_mermaid_form_alone():
    """An agent's lifecycle, and the text form, load transitions' core only; the diagrams
    extension (and no graphviz) comes with ``--format mermaid``, warning about nothing."""
    code = ("import sys, warnings\nwarnings.simplefilter('error')\n"
            "from ckpt_controller import lifecycle\n"
            "lc = lifecycle.Lifecycle(); lc.fire('prepare'); lifecycle.text_diagram()\n"
            "print(sorted(m for m in sys.modules if m.startswith('transitions')))\n"
            "lifecycle.mermaid_diagram()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('transitions', 'graphviz',"
            " 'pygraphviz'))))")
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, timeout=scaled(60), cwd=ROOT)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    before, after = (set(ast.literal_eval(line)) for line in run.stdout.splitlines())
    assert not [m for m in before if m.startswith("transitions.extensions")]
    assert "transitions.extensions.diagrams_mermaid" in after
    assert not [m for m in after if m.startswith(("graphviz", "pygraphviz"))]
