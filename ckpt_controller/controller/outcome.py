"""What one step did to one engine: succeeded, rolled back, or failed (in a known state).

A step of an operation (``steps``) returns a ``StepOutcome`` instead of annotating the error
it raises for a caller to read back; ``steps.guarded`` writes it into the engine's
``EngineOutcome``. An error that escapes a step becomes an outcome in ``from_error``, the one
place the controller reads what an agent's error says on the wire (``rolled_back``: the
agent rolled its failed prepare back itself; ``state``: where it left the engine).
Neighbours: ``steps`` and ``policy`` make outcomes; ``vocab`` spells their statuses;
``protocol.ErrorInfo`` is how an error travels.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_controller import protocol as p
from ckpt_controller.errors import CkptError
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
