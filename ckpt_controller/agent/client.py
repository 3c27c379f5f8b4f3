"""A client for one agent's control endpoint (used by the controller, the CLI and tests).

The transport (deadlines, retries, heartbeat liveness) is ``rpc.RpcClient``; this adds the
agent's commands. Every operation carries an ``op_id`` so a resend never runs it twice.
"""

from __future__ import annotations

from ckpt_controller import protocol as p
from ckpt_controller.rpc import RpcClient, new_op_id


class AgentClient(RpcClient):
    def status(self) -> p.StatusReply:
        return self.call(p.RequestType.STATUS, p.StatusCommand(call_id=0))

    def prepare(self, *, op_id: str | None = None, timeout_s: float | None = None,
                **fields) -> p.PrepareReply:
        cmd = p.PrepareCommand(call_id=0, op_id=op_id or new_op_id(), **fields)
        return self.call(p.RequestType.PREPARE, cmd, timeout_s=timeout_s or self._op_timeout(cmd))

    def restore(self, *, op_id: str | None = None, deadline_s: float | None = None,
                timeout_s: float | None = None, step: str = "all") -> p.RestoreReply:
        cmd = p.RestoreCommand(call_id=0, op_id=op_id or new_op_id(), deadline_s=deadline_s,
                               step=step)
        return self.call(p.RequestType.RESTORE, cmd, timeout_s=timeout_s or self._op_timeout(cmd))

    def rollback(self, *, op_id: str | None = None, reason: str = "",
                 deadline_s: float | None = None, timeout_s: float | None = None) -> p.RestoreReply:
        cmd = p.RollbackCommand(call_id=0, op_id=op_id or new_op_id(), reason=reason,
                                deadline_s=deadline_s)
        return self.call(p.RequestType.ROLLBACK, cmd, timeout_s=timeout_s or self._op_timeout(cmd))

    def fail(self, *, reason: str, op_id: str | None = None) -> p.Ack:
        cmd = p.FailCommand(call_id=0, op_id=op_id or new_op_id(), reason=reason)
        return self.call(p.RequestType.FAIL, cmd)

    def _op_timeout(self, cmd) -> float:
        """An operation may run up to its own deadline (and drain timeout); liveness is
        checked on heartbeats meanwhile when subscribed."""
        total = (getattr(cmd, "deadline_s", None) or 0) + getattr(cmd, "drain_timeout_s", 0)
        return max(self.timeout_s, total + self.timeout_s) if total else max(self.timeout_s, 600.0)
