"""What a ``wait`` drain does when its requests have not all ended by the drain deadline.

One policy for every engine side: the agent's own drain at the gate (``operations``) and the
vLLM sidecar's (``adapters.vllm.sidecar``) wait in their own ways, then ask ``DrainPolicy``
what comes next. In this order:

- the operation's own deadline passed: ``DeadlineError`` (exit 3), a failure that is never
  escalated;
- ``on_deadline`` is ``fail``: ``DrainError`` with the requests still in flight and the drain
  timeout (the prepare rolls back; the requests go on undisturbed);
- else the drain goes on as ``abort`` or ``keep`` (``Escalated``), logged once, and its
  report says ``escalated_to``.

Neighbours: ``clock`` (``Deadline``), ``protocol`` (``PrepareCommand``), ``vocab``
(``DrainMode``, ``Escalation``), ``errors``; used by ``operations`` and the vLLM sidecar.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt_controller.clock import Deadline
from ckpt_controller.errors import DeadlineError, DrainError
from ckpt_controller.protocol import PrepareCommand
from ckpt_controller.vocab import DrainMode, Escalation, PrepareStep

log = logging.getLogger("ckpt_controller.agent")

#: what a wait drain becomes at its deadline; ``Escalation.FAIL`` is not a mode: it fails
ESCALATES_TO: dict[Escalation, DrainMode] = {
    Escalation.ABORT: DrainMode.ABORT,
    Escalation.KEEP: DrainMode.KEEP,
}


@dataclass(frozen=True)
class Escalated:
    """A wait drain past its deadline goes on as ``mode``; its report says ``escalated_to``."""

    mode: DrainMode
    escalated_to: Escalation


class DrainPolicy:
    """The deadlines of one ``wait`` drain and what happens when the drain one passes.

    Made when the wait begins: ``drain_deadline`` is ``cmd.drain_timeout_s`` from then, or the
    operation's ``deadline`` if that comes first. ``where`` goes into the errors' details
    (``engine``, or what else names the engine to a person: vLLM's ``url``)."""

    def __init__(self, cmd: PrepareCommand, deadline: Deadline, **where: Any) -> None:
        self.cmd = cmd
        self.deadline = deadline
        self.drain_deadline = Deadline.after(cmd.drain_timeout_s, deadline.clock).earlier(deadline)
        self.where = where

    def escalate(self, in_flight: Callable[[], int]) -> Escalated:
        """The requests did not all end by ``drain_deadline``: how the drain goes on.

        Raises ``DeadlineError`` when the operation's own deadline passed, ``DrainError``
        (with ``in_flight()``, asked only then) when the caller chose to fail."""
        cmd = self.cmd
        if self.deadline.passed():
            raise DeadlineError("operation deadline passed while draining", **self.where,
                                op_id=cmd.op_id, step=PrepareStep.DRAIN)
        to = ESCALATES_TO.get(cmd.on_deadline)
        if to is None:  # Escalation.FAIL
            raise DrainError("requests still in flight at the drain deadline", **self.where,
                             op_id=cmd.op_id, step=PrepareStep.DRAIN, in_flight=in_flight(),
                             drain_timeout_s=cmd.drain_timeout_s)
        log.info("%s: drain deadline (%ss) passed, escalating to %s",
                 self._name(), cmd.drain_timeout_s, to)
        return Escalated(mode=to, escalated_to=cmd.on_deadline)

    def _name(self) -> str:
        return " ".join(str(v) for v in self.where.values()) or "engine"
