"""A client for one agent's control endpoint (used by the controller, the CLI and tests).

The transport (deadlines, retries, heartbeat liveness, first contact, field limits) is
``rpc.RpcClient``; this adds the agent's commands. Every operation carries an ``op_id`` so a
resend never runs it twice; one is generated only when none is given (an empty one is a
``UsageError``). It imports the transport only, never the engine side (``agent.server``,
its operations and failpoints, torch): the controller and the CLI load it on their own.
Neighbours: ``rpc``, ``protocol``, ``values``, ``vocab``.
"""

from __future__ import annotations

from ckpt_controller import protocol as p
from ckpt_controller.rpc import RpcClient, check_command, new_op_id
from ckpt_controller.values import MAX_DURATION_S, MAX_TEXT_LENGTH, STEP_OP_ID, check
from ckpt_controller.vocab import RestoreStep


def _op_id(op_id: str | None) -> str:
    return new_op_id() if op_id is None else check(STEP_OP_ID, op_id, "op_id")


def _reason(reason: str) -> str:
    """A reason is for people: one past the wire's limit is cut, never a reason to refuse a
    rollback or a fail (the controller builds reasons from error messages)."""
    if len(reason) <= MAX_TEXT_LENGTH:
        return reason
    return reason[:MAX_TEXT_LENGTH - 20] + " ... (cut)"


class AgentClient(RpcClient):
    unreachable_hint = "is the engine's agent running? check the endpoint (--control)"
    peer = "the agent"

    def status(self, *, timeout_s: float | None = None,
               retries: int | None = None) -> p.StatusReply:
        return self.call(p.RequestType.STATUS, p.StatusCommand(call_id=0), timeout_s=timeout_s,
                         retries=retries)

    def prepare(self, *, op_id: str | None = None, timeout_s: float | None = None,
                **fields) -> p.PrepareReply:
        cmd = p.PrepareCommand(call_id=0, op_id=_op_id(op_id), **fields)
        return self.call(p.RequestType.PREPARE, cmd, timeout_s=self._op_timeout(cmd, timeout_s))

    def restore(self, *, op_id: str | None = None, deadline_s: float | None = None,
                timeout_s: float | None = None,
                step: RestoreStep | str = RestoreStep.ALL) -> p.RestoreReply:
        cmd = p.RestoreCommand(call_id=0, op_id=_op_id(op_id), deadline_s=deadline_s,
                               step=step)
        return self.call(p.RequestType.RESTORE, cmd, timeout_s=self._op_timeout(cmd, timeout_s))

    def rollback(self, *, op_id: str | None = None, reason: str = "",
                 deadline_s: float | None = None, timeout_s: float | None = None) -> p.RestoreReply:
        cmd = p.RollbackCommand(call_id=0, op_id=_op_id(op_id), reason=_reason(reason),
                                deadline_s=deadline_s)
        return self.call(p.RequestType.ROLLBACK, cmd, timeout_s=self._op_timeout(cmd, timeout_s))

    def fail(self, *, reason: str, op_id: str | None = None) -> p.Ack:
        cmd = p.FailCommand(call_id=0, op_id=_op_id(op_id), reason=_reason(reason))
        return self.call(p.RequestType.FAIL, cmd)

    def _op_timeout(self, cmd, given: float | None) -> float:
        """An operation may run up to its own deadline (and drain timeout); liveness is
        checked on heartbeats meanwhile when subscribed."""
        if self.checks_commands:
            check_command(cmd)  # first: the sums below need valid numbers
        if given is not None:
            return given
        total = (getattr(cmd, "deadline_s", None) or 0) + getattr(cmd, "drain_timeout_s", 0)
        wait = max(self.timeout_s, total + self.timeout_s) if total else max(self.timeout_s, 600.0)
        return min(wait, MAX_DURATION_S)
