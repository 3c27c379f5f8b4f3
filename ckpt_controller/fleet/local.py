"""A node-local operation run by the fleet, waited for to its end.

A migration's steps (``migration.steps``, ``migration.settle``) run ordinary node-local
operations on their node's controller (``Controller.start``) and wait for each: ``run`` gives
the result (an id run before answers with its first result: the node's journal keeps it), and
``why`` says in a line why one did not succeed.
Neighbours: the controller's ``service`` (``Controller.start``), ``protocol``
(``OperationCommand``, ``OperationResult``), ``migration.steps``, ``migration.settle``.
"""

from __future__ import annotations

import threading

import msgspec

from ckpt_controller import protocol as p
from ckpt_controller.errors import CkptError
from ckpt_controller.vocab import OperationKind

#: what a fleet operation's parameters may give a node-local one
PASSED_ON = ("drain", "drain_timeout_s", "on_deadline", "level", "deadline_s", "accept")


def run(controller, op_id: str, kind: OperationKind, engine: str, params: dict,
        hook_env: dict | None = None, absent: bool = False) -> p.OperationResult:
    """Run a node-local operation to its end (its result); a refusal raises its error.
    ``absent``: a restore of an engine whose process is known not to run here."""
    fields = {k: v for k, v in params.items() if k in PASSED_ON}
    cmd = msgspec.convert(dict(fields, call_id=0, op_id=op_id, kind=kind, engines=[engine],
                               hook_env=hook_env or {}, absent=absent), p.OperationCommand)
    done = threading.Event()
    box: list = []

    def finished(result) -> None:
        box.append(result)
        done.set()

    controller.start(cmd, finished)
    done.wait()
    result = box[0]
    if isinstance(result, CkptError):
        raise result
    return result


def outcome_of(result: p.OperationResult, engine: str) -> p.EngineOutcome | None:
    return next((o for o in result.engines if o.engine == engine), None)


def why(result: p.OperationResult, engine: str) -> str:
    """Why ``engine``'s part of ``result`` did not succeed, in a line."""
    outcome = outcome_of(result, engine)
    if outcome is not None and outcome.error is not None:
        return outcome.error.message
    return result.error.message if result.error else str(result.status)


def state_after(result: p.OperationResult, engine: str) -> str | None:
    """The engine's state after ``result`` (None: not known)."""
    outcome = outcome_of(result, engine)
    return str(outcome.state) if outcome is not None and outcome.state else None
