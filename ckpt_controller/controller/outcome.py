"""What one step did to one engine: succeeded, rolled back, or failed (in a known state).

A step of an operation (``steps``) returns a ``StepOutcome`` instead of annotating the error
it raises for a caller to read back; ``steps.guarded`` writes it into the engine's
``EngineOutcome``. An error that escapes a step becomes an outcome in ``from_error``, the one
place the controller reads what an agent's error says on the wire (``rolled_back``: the
agent rolled its failed prepare back itself; ``state``: where it left the engine).
A whole operation's result that the journal could not take is no result to answer: its
callers get ``not_durable``'s error instead, logged at a bounded rate (``Throttled``).
Neighbours: ``steps`` and ``policy`` make outcomes; ``vocab`` spells their statuses;
``protocol.ErrorInfo`` is how an error travels; ``service`` ends operations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ckpt_controller import protocol as p
from ckpt_controller.errors import CkptError, StateDirError
from ckpt_controller.vocab import CheckpointState, OutcomeStatus


@dataclass(frozen=True)
class StepOutcome:
    status: OutcomeStatus
    #: where the step left the engine; None: not known, ask the agent
    state: CheckpointState | str | None = None
    #: why it did not succeed
    error: CkptError | None = None

    @classmethod
    def succeeded(cls) -> StepOutcome:
        return cls(OutcomeStatus.SUCCEEDED)

    @classmethod
    def rolled_back(cls, error: CkptError, state: str | None) -> StepOutcome:
        return cls(OutcomeStatus.ROLLED_BACK, state, error)

    @classmethod
    def failed(cls, error: CkptError, state: str | None = None) -> StepOutcome:
        return cls(OutcomeStatus.FAILED, state, error)


#: what an agent's error says on the wire: it rolled its failed prepare back itself
WIRE_ROLLED_BACK = "rolled_back"
#: ... and the state it left the engine in (also said by the controller's own errors)
WIRE_STATE = "state"


def from_error(err: CkptError) -> StepOutcome:
    """The outcome an error that escaped a step stands for: rolled back when the agent said
    so, else failed; in the state the error names, if it names one."""
    state = err.details.get(WIRE_STATE)
    state = state if isinstance(state, str) else None
    if err.details.get(WIRE_ROLLED_BACK):
        return StepOutcome.rolled_back(err, state)
    return StepOutcome.failed(err, state)


def error_info(err: CkptError) -> p.ErrorInfo:
    return p.ErrorInfo(kind=err.kind, message=err.message, details=p.to_plain(err.details))


def not_durable(result: p.OperationResult, state_dir, err: Exception) -> StateDirError:
    """What the callers of an operation hear when its result could not be journaled (a full
    disk): no "succeeded" that a restart would turn into "interrupted"."""
    return StateDirError(
        f"{result.kind} {result.op_id} ended {result.status}, but its result could not be "
        f"written to the journal in {state_dir} ({err}): it is not durable, and a restarted "
        "controller finds the operation interrupted and settles its engines again; free "
        "space there (or fix the file system)", state_dir=str(state_dir), problem=str(err),
        op_id=result.op_id, status=result.status)


class Throttled:
    """A log line said at most once every ``every_s``, counting what it held back (a full
    disk fails every operation: one line each would fill the log that disk holds too)."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0, clock=time.monotonic):
        self.log, self.every_s, self.clock = log, every_s, clock
        self._held, self._last = 0, -every_s

    def error(self, line: str, *args) -> None:
        now = self.clock()
        self._held += 1
        if now - self._last >= self.every_s:
            self.log.error(line + " (%d such since the last line)", *args, self._held)
            self._held, self._last = 0, now
