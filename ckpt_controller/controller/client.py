"""A Python client for the controller, for orchestration scripts.

    with ControllerClient("ipc:///run/user/1000/ckpt-controller/controller.sock") as c:
        result = c.cycle(["engine-a", "engine-b"], max_unavailable=1, drain="keep")
        if result.status != "succeeded": ...

Operations return an ``OperationResult`` (per-engine outcomes, phases, drain and memory
reports, hook runs); refusals raise typed errors (``BusyError`` with the holder,
``UsageError`` for unknown engines, ``UnreachableError``). Each operation carries an id
(generated unless given); sending the same id again returns the first result.
Neighbours: ``rpc`` (transport), ``protocol``.
"""

from __future__ import annotations

from ckpt_controller import protocol as p
from ckpt_controller.rpc import RpcClient, new_op_id

#: how long an operation may take before the client gives up waiting, when the controller's
#: heartbeats do not already bound the wait (they do once subscribed)
DEFAULT_OPERATION_TIMEOUT_S = 3600.0


class ControllerClient(RpcClient):
    def __init__(self, endpoint: str, **kw) -> None:
        kw.setdefault("name", "ckpt-controller-client")
        super().__init__(endpoint, **kw)

    def status(self, engines: list[str] | None = None) -> p.ControllerStatusReply:
        return self.call(p.RequestType.STATUS, p.StatusCommand(call_id=0, engines=engines or []),
                         timeout_s=max(self.timeout_s, 10.0))

    def history(self, engine: str | None = None, op_id: str | None = None,
                limit: int = 50) -> p.HistoryReply:
        return self.call(p.RequestType.HISTORY, p.HistoryCommand(
            call_id=0, engine=engine, op_id=op_id, limit=limit))

    def operation(self, kind: str, engines: list[str] | None = None, *,
                  op_id: str | None = None, timeout_s: float | None = None,
                  **params) -> p.OperationResult:
        cmd = p.OperationCommand(call_id=0, op_id=op_id or new_op_id(), kind=kind,
                                 engines=list(engines or []), **params)
        return self.call(p.RequestType.OPERATION, cmd,
                         timeout_s=timeout_s or DEFAULT_OPERATION_TIMEOUT_S)

    def prepare(self, engines=None, **params) -> p.OperationResult:
        return self.operation("prepare", engines, **params)

    def capture(self, engines=None, **params) -> p.OperationResult:
        return self.operation("capture", engines, **params)

    def restore(self, engines=None, **params) -> p.OperationResult:
        return self.operation("restore", engines, **params)

    def cycle(self, engines=None, **params) -> p.OperationResult:
        return self.operation("cycle", engines, **params)

    def rollback(self, engines=None, **params) -> p.OperationResult:
        return self.operation("rollback", engines, **params)
