"""The lifecycle: one transition table over the vocabulary's states and triggers, nothing else.

The table is data (``TRANSITIONS``), read once into a map from (state, trigger) to the next
state: a move is one lookup under a lock, and there is no other way to change the state (no
``to_<state>()`` shortcut, an unknown or illegal trigger is an error that moves nothing).
This used to be fed to the ``transitions`` library (``auto_transitions=False``); its generic
event machinery (callbacks, event data, debug logging) was about 70% of the CPU of a no-op
prepare+restore on the agent (bench/agent_ops.py), for nothing this table needs. The lifecycle knows
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

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ckpt_controller.clock import Clock
from ckpt_controller.errors import InvalidTransitionError
from ckpt_controller.vocab import TRANSITIONAL, CheckpointState, Trigger

__all__ = [
    "TRANSITIONAL", "TRANSITIONS", "CheckpointState", "Lifecycle", "Transition", "Trigger",
]


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


#: (state, trigger) -> the state it leads to: the table, read for every move
_MOVES: dict[tuple[CheckpointState, Trigger], CheckpointState] = {
    (src, trig): dst for trig, srcs, dst in TRANSITIONS for src in srcs
}
#: state -> the triggers allowed in it, in table order
_ALLOWED: dict[CheckpointState, tuple[Trigger, ...]] = {
    state: tuple(t for t in Trigger if (state, t) in _MOVES) for state in CheckpointState
}


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
        self._state = CheckpointState(initial)
        self._generation = generation
        self._restoring_cycle = False  # True while RESTORING came from PREPARED via restore
        self._history: list[Transition] = []
        self._history_limit = history_limit
        self._listeners: list[Callable[[Transition], None]] = []

    @property
    def state(self) -> CheckpointState:
        return self._state

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def history(self) -> list[Transition]:
        with self._lock:
            return list(self._history)

    def allowed(self, state: CheckpointState | None = None) -> list[Trigger]:
        """Triggers allowed in ``state`` (default: the current one), in table order."""
        return list(_ALLOWED[state or self._state])

    def subscribe(self, listener: Callable[[Transition], None]) -> None:
        """Call ``listener(transition)`` after every move (under the lifecycle's lock)."""
        self._listeners.append(listener)

    def check(self, trigger: Trigger | str) -> Trigger:
        """Raise ``InvalidTransitionError`` unless ``trigger`` is allowed now; move nothing."""
        return self._next(trigger)[0]

    def _next(self, trigger: Trigger | str) -> tuple[Trigger, CheckpointState]:
        """The trigger and where it leads from the current state, or the typed refusal."""
        source = self._state
        try:
            trig = Trigger(trigger)
        except ValueError:  # policy: not a trigger at all is refused like an illegal one
            trig = None
        dest = _MOVES.get((source, trig)) if trig is not None else None
        if dest is None:
            raise InvalidTransitionError(
                f"cannot {trigger} an engine that is {source}",
                state=source.value,
                trigger=str(trigger),
                allowed=[t.value for t in _ALLOWED[source]],
            )
        return trig, dest

    def fire(self, trigger: Trigger | str, reason: str = "") -> Transition:
        """Move by ``trigger`` or raise ``InvalidTransitionError`` and change nothing."""
        with self._lock:
            source = self._state
            trig, dest = self._next(trigger)
            self._state = dest
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
