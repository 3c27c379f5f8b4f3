"""The fleet's hold on a node's own operations: ``FleetGuard`` is the controller's outside
holder of engines (``Controller.guard``) on a node with ``[fleet]``.

Every node-local operation takes ``locks/<engine>`` in etcd under the node's lease for its
run (one operation per engine across the fleet), and keeps ``unavailable`` true to it (a
prepare or cycle adds its engines; an engine RUNNING at the end is taken out again, one left
out of service stays), so fleet operations count it against ``--max-unavailable``. A fleet
operation's own part is skipped: the coordinator took its lock and its place when it started
it. Neighbours: ``node`` (the lease, whether etcd answers, the parts running here),
``unavailable``, ``kinds`` (which kinds take engines out), the controller's ``service``
(calls ``hold``, ``before_resume`` and ``free``).
"""

from __future__ import annotations

import logging

from ckpt_controller.errors import BusyError, CkptError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import ops, unavailable
from ckpt_controller.fleet.kinds import spec
from ckpt_controller.fleet.node import FleetNode
from ckpt_controller.vocab import CheckpointState, OperationKind

log = logging.getLogger("ckpt_controller.fleet")

#: node-local operations that bring an engine back into service, whoever took it out
BRINGS_BACK = frozenset({OperationKind.RESTORE, OperationKind.ROLLBACK})


def check_room(out: dict[str, str], engines: list[str], running: list, op_id: str) -> None:
    """``BusyError`` when taking ``engines`` out too (``out``: ``unavailable`` now) would
    pass the ``--max-unavailable`` of a running fleet operation that takes engines out
    (``running``): the limit holds fleet-wide, node-local operations included."""
    limits = [(op.max_unavailable, op.op_id) for op in running if spec(op.kind).takes_out]
    after = set(out) | set(engines)
    if not limits or len(after) == len(out):
        return
    limit, holder = min(limits)
    if len(after) > limit:
        raise BusyError(
            f"operation {op_id} would take {', '.join(sorted(set(engines) - set(out)))} out "
            f"of service beside the {len(out)} engine(s) out already, past fleet operation "
            f"{holder}'s --max-unavailable {limit}; try again once it has room",
            holder=holder, max_unavailable=limit, unavailable=sorted(out))


class FleetGuard:
    """The controller's outside holder of engines (``Controller.guard``): every node-local
    operation takes ``locks/<engine>`` in etcd under the node's lease for its run, and keeps
    ``unavailable`` true to it (a prepare or cycle adds its engines; an engine RUNNING at the
    end is taken out again, one left out of service stays). With etcd out of reach, the
    operation goes on with the node's own guarantees only, and says so in the log."""

    def __init__(self, node: FleetNode) -> None:
        self.node = node

    def hold(self, op_id: str, kind: str, engines: list[str]) -> None:
        n = self.node
        if n.is_fleet_part(op_id):
            return  # the coordinator took its lock and its place when it started the part
        if n.lease is None or not n.available:
            # not registered, or etcd did not answer the last round: not waited for
            log.warning("fleet: %s %s runs without fleet locks: etcd is unavailable to this "
                        "node (local guarantees only)", kind, op_id)
            return
        taken = []
        try:
            for engine in engines:
                key = n.keys.lock(engine)
                ok, resp = n.etcd.txn([e.compare_created(key)],
                                      [e.put_op(key, op_id, n.lease)], [e.get_op(key)])
                holder = op_id if ok else (resp[0]["kvs"][0].value.decode()
                                           if resp[0]["kvs"] else op_id)
                if holder != op_id:
                    raise BusyError(f"engine {engine} is held by operation {holder} (its lock "
                                    "in etcd)", engine=engine, holder=holder)
                taken.append(engine)
            if spec(kind).takes_out:
                running = [op for op, _ in ops.running(n.etcd, n.keys, {})]

                def add(cur: dict[str, str]) -> dict[str, str]:
                    check_room(cur, engines, running, op_id)
                    return {**{x: op_id for x in engines if x not in cur}, **cur}
                unavailable.update(n.etcd, n.keys, add)
        except BusyError:
            self._unlock(op_id, taken)
            raise
        except CkptError as err:  # policy: etcd away: the node's own guarantees only
            log.warning("fleet: %s %s runs without fleet locks: %s (local guarantees only)",
                        kind, op_id, err)

    def before_resume(self, op_id: str, engine: str):
        """What a restore calls between re-wake and re-admission: a migration's restore on
        its target takes the engine over there (``migration``); others: None."""
        if self.node.migration is None:
            return None
        return self.node.migration.before_resume(op_id, engine)

    def free(self, op_id: str, kind: str, engines: list[str], result) -> None:
        n = self.node
        if n.lease is None or not n.available or n.is_fleet_part(op_id):
            return  # a fleet part's end is written by the node, its place settled elsewhere
        states = {o.engine: o.state for o in getattr(result, "engines", [])}

        def change(cur: dict[str, str]) -> dict[str, str]:
            for engine in engines:
                if engine not in states:
                    if cur.get(engine) == op_id:  # refused before it began
                        cur.pop(engine)
                elif states[engine] == CheckpointState.RUNNING:
                    if kind in BRINGS_BACK or cur.get(engine) == op_id:
                        cur.pop(engine, None)
                else:
                    cur.setdefault(engine, op_id)
            return cur

        try:
            unavailable.update(n.etcd, n.keys, change)
        except CkptError as err:  # policy: logged; the locks are freed all the same
            log.warning("fleet: could not record %s's end in unavailable: %s", op_id, err)
        try:
            self._unlock(op_id, engines)
        except CkptError as err:  # policy: the lock goes with the lease; logged
            log.warning("fleet: could not free %s's fleet locks: %s", op_id, err)

    def _unlock(self, op_id: str, engines: list[str]) -> None:
        n = self.node
        for engine in engines:
            key = n.keys.lock(engine)
            n.etcd.txn([e.compare_value(key, op_id)], [e.delete_op(key)])
