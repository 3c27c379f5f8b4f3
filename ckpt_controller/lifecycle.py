"""The lifecycle: one transition table over the vocabulary's states and triggers, nothing else.

The table is data (``TRANSITIONS``) fed to the ``transitions`` library with
``auto_transitions=False``, so no ``to_<state>()`` shortcut can bypass it. The lifecycle knows
no sockets, no torch and no engine: the agent (``ckpt_controller.agent``) fires triggers on it
and publishes the recorded ``Transition`` values. States come from vLLM's ``CheckpointState``;
states and triggers are spelled once, in ``vocab`` (re-exported here). ``seal`` and ``resume``
share their names with the agent's last prepare and restore steps, which fire them.

    RUNNING --prepare--> PREPARING --seal--> PREPARED --restore--> RESTORING --resume--> RUNNING
    any state --fail--> FAILED;  FAILED --restore--> RESTORING (recovery)
    PREPARING or PREPARED --rollback--> RESTORING (--resume--> RUNNING)

Neighbours: ``vocab`` (the words), ``agent.operations`` (fires the triggers), ``errors``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from transitions import Machine

from ckpt_controller.clock import Clock
from ckpt_controller.errors import InvalidTransitionError
from ckpt_controller.vocab import TRANSITIONAL, CheckpointState, Trigger

__all__ = [
    "TRANSITIONAL", "TRANSITIONS", "CheckpointState", "Lifecycle", "Transition", "Trigger",
]


# transitions logs every callback at INFO; our own log names each transition already
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


@dataclass(frozen=True)
class Transition:
    """One recorded move. ``generation`` counts completed cycles after this move."""

    trigger: Trigger
    source: CheckpointState
    dest: CheckpointState
    generation: int
    monotonic: float
    wall: float
    reason: str = ""


class _Model:
    """The object ``transitions`` attaches trigger methods and ``state`` to."""

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
        self._machine = Machine(
            model=self._model,
            states=[s.value for s in CheckpointState],
            transitions=[
                {"trigger": t.value, "source": [s.value for s in src], "dest": dst.value}
                for t, src, dst in TRANSITIONS
            ],
            initial=initial.value,
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )
        self._generation = generation
        self._restoring_cycle = False  # True while RESTORING came from PREPARED via restore
        self._history: list[Transition] = []
        self._history_limit = history_limit
        self._listeners: list[Callable[[Transition], None]] = []

    @property
    def state(self) -> CheckpointState:
        return CheckpointState(self._model.state)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def history(self) -> list[Transition]:
        with self._lock:
            return list(self._history)

    def allowed(self, state: CheckpointState | None = None) -> list[Trigger]:
        """Triggers allowed in ``state`` (default: the current one), in table order."""
        names = set(self._machine.get_triggers((state or self.state).value))
        return [t for t in Trigger if t.value in names]

    def subscribe(self, listener: Callable[[Transition], None]) -> None:
        """Call ``listener(transition)`` after every move (under the lifecycle's lock)."""
        self._listeners.append(listener)

    def check(self, trigger: Trigger | str) -> Trigger:
        """Raise ``InvalidTransitionError`` unless ``trigger`` is allowed now; move nothing."""
        source = self.state
        try:
            trig = Trigger(trigger)
        except ValueError:
            trig = None
        if trig is None or trig not in self.allowed(source):
            raise InvalidTransitionError(
                f"cannot {trigger} an engine that is {source}",
                state=source.value,
                trigger=str(trigger),
                allowed=[t.value for t in self.allowed(source)],
            )
        return trig

    def fire(self, trigger: Trigger | str, reason: str = "") -> Transition:
        """Move by ``trigger`` or raise ``InvalidTransitionError`` and change nothing."""
        with self._lock:
            source = self.state
            trig = self.check(trigger)
            getattr(self._model, trig.value)()
            dest = self.state
            if trig is Trigger.RESTORE:
                self._restoring_cycle = source is CheckpointState.PREPARED
            elif trig is Trigger.ROLLBACK:
                self._restoring_cycle = False
            elif trig is Trigger.RESUME and self._restoring_cycle:
                self._generation += 1
                self._restoring_cycle = False
            record = Transition(
                trig, source, dest, self._generation,
                self._clock.monotonic(), self._clock.wall(), reason,
            )
            self._history.append(record)
            del self._history[: -self._history_limit]
            for listener in list(self._listeners):
                listener(record)
            return record
