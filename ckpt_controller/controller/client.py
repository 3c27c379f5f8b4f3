"""A Python client for the controller, for orchestration scripts.

    with ControllerClient("ipc:///run/user/1000/ckpt-controller/controller.sock") as c:
        result = c.cycle(["engine-a", "engine-b"], max_unavailable=1, drain="keep")
        if result.status != "succeeded": ...

Operations return an ``OperationResult`` (per-engine outcomes, phases, drain and memory
reports, hook runs); refusals raise typed errors (``BusyError`` with the holder,
``UsageError`` for unknown engines or a value out of its limits - checked before anything is
sent -, ``UnreachableError``: within about a second when nothing serves the endpoint). Each
operation carries an id (generated unless given: never for an empty one); sending the same id
again returns the first result. Neighbours: ``rpc`` (transport), ``protocol``, ``values``.
"""

from __future__ import annotations

from ckpt_controller import protocol as p
from ckpt_controller.rpc import RpcClient, new_op_id
from ckpt_controller.values import OP_ID, check
from ckpt_controller.vocab import OperationKind

#: how long an operation may take before the client gives up waiting, when the controller's
#: heartbeats do not already bound the wait (they do once subscribed)
DEFAULT_OPERATION_TIMEOUT_S = 3600.0


class ControllerClient(RpcClient):
    unreachable_hint = ("is `ckptctl serve` running? name its endpoint with --controller or "
                        "$CKPT_CONTROLLER")

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
        op_id = new_op_id() if op_id is None else check(OP_ID, op_id, "op_id")
        cmd = p.OperationCommand(call_id=0, op_id=op_id, kind=kind,
                                 engines=list(engines or []), **params)
        return self.call(p.RequestType.OPERATION, cmd,
                         timeout_s=DEFAULT_OPERATION_TIMEOUT_S if timeout_s is None else timeout_s)

    def prepare(self, engines=None, **params) -> p.OperationResult:
        return self.operation(OperationKind.PREPARE, engines, **params)

    def capture(self, engines=None, **params) -> p.OperationResult:
        return self.operation(OperationKind.CAPTURE, engines, **params)

    def restore(self, engines=None, **params) -> p.OperationResult:
        return self.operation(OperationKind.RESTORE, engines, **params)

    def cycle(self, engines=None, **params) -> p.OperationResult:
        return self.operation(OperationKind.CYCLE, engines, **params)

    def rollback(self, engines=None, **params) -> p.OperationResult:
        return self.operation(OperationKind.ROLLBACK, engines, **params)
