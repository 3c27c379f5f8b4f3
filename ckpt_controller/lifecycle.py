"""The lifecycle: one transition table over the vocabulary's states and triggers, nothing else.

The table is data (``TRANSITIONS``), fed to a ``transitions.Machine`` (states as their wire
values, triggers as theirs) built with ``auto_transitions=False``: no ``to_<state>()``
shortcut bypasses the table, and every move is the machine's, under the lifecycle's lock. An
unknown or illegal trigger is an ``InvalidTransitionError`` that moves nothing. The machine
runs lean: ``send_event=False``, no callbacks (the lifecycle records each move and calls its
listeners itself, after the machine moved), transitions' own per-move log lines off, and its
states and transitions skip the callback lists this table leaves empty (each move is still
the library's event dispatch and state change); a trigger costs some microseconds of CPU
(bench/agent_ops.py ``--micro``). The same table draws
the lifecycle's diagram (``text_diagram``, ``mermaid_diagram``; ``ckptctl lifecycle``):

    RUNNING --prepare--> PREPARING --seal--> PREPARED --restore--> RESTORING --resume--> RUNNING
       FAILED --restore--> RESTORING
       PREPARING or PREPARED --rollback--> RESTORING
       any state --fail--> FAILED

The lifecycle knows no sockets, no torch and no engine: the agent (``ckpt_controller.agent``)
fires triggers on it and publishes the recorded ``Transition`` values (as the protocol's
``TransitionRecord``). States come from vLLM's ``CheckpointState``; states and triggers are
spelled once, in ``vocab`` (re-exported here). ``seal`` and ``resume`` share their names with
the agent's last prepare and restore steps, which fire them.

Neighbours: ``vocab`` (the words), ``agent.operations`` (fires the triggers), ``errors``,
``protocol`` (``TransitionRecord.of``), ``cli.lifecycle_cmd`` (prints the diagrams).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transitions import Machine, MachineError, State, Transition as _LibraryTransition

from ckpt_controller.clock import Clock
from ckpt_controller.errors import InvalidTransitionError
from ckpt_controller.vocab import TRANSITIONAL, CheckpointState, Trigger

__all__ = [
    "TRANSITIONAL", "TRANSITIONS", "CheckpointState", "Lifecycle", "Transition", "Trigger",
    "mermaid_diagram", "text_diagram",
]

# transitions logs every move (INFO as a state is left and entered, DEBUG at each stage):
# the lifecycle records each move itself and the agent logs what a person needs, so those
# lines would say it twice, and cost CPU per move at INFO. Warnings and errors still show.
logging.getLogger("transitions").setLevel(logging.WARNING)

S, T = CheckpointState, Trigger

#: The whole lifecycle: (trigger, sources, destination).
TRANSITIONS: tuple[tuple[Trigger, tuple[CheckpointState, ...], CheckpointState], ...] = (
    (T.PREPARE, (S.RUNNING,), S.PREPARING),
    (T.SEAL, (S.PREPARING,), S.PREPARED),
    (T.RESTORE, (S.PREPARED, S.FAILED), S.RESTORING),
    (T.RESUME, (S.RESTORING,), S.RUNNING),
    (T.ROLLBACK, (S.PREPARING, S.PREPARED), S.RESTORING),
    (T.FAIL, tuple(S), S.FAILED),
)

#: a machine state (a wire value, what transitions keeps on the model) -> its vocab member
_STATE: dict[str, CheckpointState] = {s.value: s for s in CheckpointState}


def machine_config(initial: CheckpointState = S.RUNNING) -> dict[str, Any]:
    """What a ``transitions`` machine of this lifecycle is built from: ``TRANSITIONS`` with
    states and triggers as plain wire strings (an enum member would be named by its Python
    name, ``RUNNING``), and the settings that keep the table the only way to move."""
    return {
        "states": [s.value for s in CheckpointState],
        "transitions": [{"trigger": t.value, "source": [s.value for s in srcs], "dest": d.value}
                        for t, srcs, d in TRANSITIONS],
        "initial": CheckpointState(initial).value,
        "auto_transitions": False,  # no to_<state>() around the table
        "ignore_invalid_triggers": False,  # an illegal trigger is an error, never ignored
        "send_event": False,
    }


@dataclass(frozen=True)
class Transition:
    """One recorded move. ``generation`` counts completed cycles after this move. On the wire
    it is ``protocol.TransitionRecord`` (same fields; ``TransitionRecord.of`` converts)."""

    trigger: Trigger
    source: CheckpointState
    dest: CheckpointState
    generation: int
    monotonic: float
    wall: float
    reason: str = ""


class _QuietState(State):
    """A state whose entry and exit, without callbacks (this lifecycle has none), do nothing:
    transitions' own ``State`` calls its empty callback list and two log methods for each."""

    def enter(self, event_data) -> None:
        if self.on_enter:
            super().enter(event_data)

    def exit(self, event_data) -> None:
        if self.on_exit:
            super().exit(event_data)


class _Transition(_LibraryTransition):
    """A transition of this table: no conditions and no callbacks (the table gives none), so
    executing it is the library's own state change (``_change_state``: exit the source, set
    the destination on the model, enter it), without walking four empty callback lists and
    their log lines first. Given one of either, it runs the library's whole ``execute``."""

    def execute(self, event_data) -> bool:
        machine = event_data.machine
        if self.prepare or self.conditions or self.before or self.after \
                or machine.before_state_change or machine.after_state_change:
            return super().execute(event_data)
        self._change_state(event_data)
        return True


class _Machine(Machine):
    """transitions' ``Machine`` with quiet states and transitions; every move is still the
    library's event dispatch (source check, the transition, the state set on the model)."""

    state_cls = _QuietState
    transition_cls = _Transition


class _Model:
    """What the machine moves: ``state`` (a wire value) and the trigger methods transitions
    binds to it. Private: those methods move without the lock, the record and the listeners."""

    state: str


class Lifecycle:
    """The authoritative state of one engine. Thread-safe; every move is recorded."""

    def __init__(
        self,
        clock: Clock | None = None,
        initial: CheckpointState = CheckpointState.RUNNING,
        generation: int = 0,
        history_limit: int = 1000,
    ) -> None:
        self._clock = clock or Clock()
        self._lock = threading.RLock()
        self._model = _Model()
        self._machine = _Machine(model=self._model, **machine_config(initial))
        self._events = self._machine.events  # trigger (its wire value) -> the machine's event
        #: state -> the triggers the machine allows in it, in table order (read once: a
        #: prepare checks before it moves, and get_triggers walks every event)
        self._allowed = {s: tuple(Trigger(t) for t in self._machine.get_triggers(s.value))
                         for s in CheckpointState}
        self._generation = generation
        self._restoring_cycle = False  # True while RESTORING came from PREPARED via restore
        self._history: list[Transition] = []
        self._history_limit = history_limit
        self._listeners: list[Callable[[Transition], None]] = []

    @property
    def state(self) -> CheckpointState:
        return _STATE[self._model.state]

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def history(self) -> list[Transition]:
        with self._lock:
            return list(self._history)

    def allowed(self, state: CheckpointState | None = None) -> list[Trigger]:
        """Triggers allowed in ``state`` (default: the current one), in table order."""
        return list(self._allowed[state or self.state])

    def subscribe(self, listener: Callable[[Transition], None]) -> None:
        """Call ``listener(transition)`` after every move (under the lifecycle's lock)."""
        self._listeners.append(listener)

    def check(self, trigger: Trigger | str) -> Trigger:
        """Raise ``InvalidTransitionError`` unless ``trigger`` is allowed now; move nothing."""
        source = self.state
        trig = self._known(trigger, source)
        if trig not in self._allowed[source]:
            raise self._refusal(trigger, source)
        return trig

    def fire(self, trigger: Trigger | str, reason: str = "") -> Transition:
        """Move by ``trigger`` or raise ``InvalidTransitionError`` and change nothing."""
        with self._lock:
            source = _STATE[self._model.state]
            trig = trigger if trigger.__class__ is Trigger else self._known(trigger, source)
            try:
                self._events[trig].trigger(self._model)  # the machine's event: its own move
            except MachineError:  # policy: refused before it moved: our typed refusal
                raise self._refusal(trigger, source) from None
            self._count_cycle(trig, source)
            record = Transition(trig, source, _STATE[self._model.state], self._generation,
                                self._clock.monotonic(), self._clock.wall(), reason)
            self._history.append(record)
            del self._history[: -self._history_limit]
            for listener in list(self._listeners):
                listener(record)
            return record

    def _count_cycle(self, trig: Trigger, source: CheckpointState) -> None:
        """The generation rule: a RESUME ends a cycle when its RESTORE came from PREPARED (a
        rollback's resume or a recovery from FAILED completes none)."""
        if trig is Trigger.RESTORE:
            self._restoring_cycle = source is CheckpointState.PREPARED
        elif trig is Trigger.ROLLBACK:
            self._restoring_cycle = False
        elif trig is Trigger.RESUME and self._restoring_cycle:
            self._generation += 1
            self._restoring_cycle = False

    def _known(self, trigger: object, source: CheckpointState) -> Trigger:
        """``trigger`` as a vocab member (old names read too), or the typed refusal."""
        try:
            return Trigger(trigger)
        except ValueError:  # policy: not a trigger at all is refused like an illegal one
            raise self._refusal(trigger, source) from None

    def _refusal(self, trigger: object, source: CheckpointState) -> InvalidTransitionError:
        return InvalidTransitionError(
            f"cannot {trigger} an engine that is {source}",
            state=source.value,
            trigger=str(trigger),
            allowed=[t.value for t in self.allowed(source)],
        )


# ---------------------------------------------------------------- the diagrams


def text_diagram() -> str:
    """The table as plain text: the cycle from RUNNING (each state's first trigger in table
    order, until a state comes round again), then each other move, a row of the table a line
    (``any state`` when every state is a source)."""
    lines, drawn = [], set()
    state, seen, cycle = S.RUNNING, set(), S.RUNNING.name
    while state not in seen:
        seen.add(state)
        trig, dest = next((t, d) for t, srcs, d in TRANSITIONS if state in srcs)
        drawn.add((state, trig))
        cycle += f" --{trig}--> {dest.name}"
        state = dest
    lines.append(cycle)
    for trig, srcs, dest in TRANSITIONS:
        rest = [s for s in srcs if (s, trig) not in drawn]
        if rest:
            who = "any state" if set(rest) == set(S) else " or ".join(s.name for s in rest)
            lines.append(f"   {who} --{trig}--> {dest.name}")
    return "\n".join(lines) + "\n"


def mermaid_diagram() -> str:
    """The table as a Mermaid ``stateDiagram-v2``, drawn by transitions' diagrams extension
    (``GraphMachine``, mermaid engine: no graphviz needed) from the same machine settings;
    lines without trailing blanks, so the copy in the docs stays byte for byte the same."""
    # imported here: only ``ckptctl lifecycle --format mermaid`` needs the extension
    from transitions.extensions.diagrams import GraphMachine

    machine = GraphMachine(model=_Model(), graph_engine="mermaid",
                           title="ckpt-controller lifecycle", **machine_config())
    source = machine.get_graph().draw(None)
    return "\n".join(line.rstrip() for line in source.splitlines()) + "\n"
