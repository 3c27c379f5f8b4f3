"""Fleet operations as etcd holds them: what every kind's driver, the nodes and ``ckptctl
fleet`` read and check alike.

``read_op``, ``read_parts`` and ``running`` read operations and their parts (a damaged one
is a ``DamagedRecordError`` naming its key); ``same_op`` is the rule for a repeated id (the
same operation again follows it; another operation with it is refused); ``local_op_id`` makes
a part's node-local id, the same on every try so that the node's journal answers a repeat
with the first result; ``live_nodes`` lists the nodes registered now.
Neighbours: ``records``, ``keys``, ``kinds`` (the table), ``parts`` and ``migration`` (the
drivers), ``coordinator``.
"""

from __future__ import annotations

import hashlib

from ckpt_controller.errors import DamagedRecordError, UsageError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.vocab import FleetKind, OperationStatus


def local_op_id(op_id: str, engine: str) -> str:
    """The node-local operation id of ``engine``'s part: ``<op>.<engine>``, or a digest when
    that would pass the 128 characters an id may have."""
    joined = f"{op_id}.{engine}"
    if len(joined) <= 128:
        return joined
    return f"fleet-{hashlib.sha256(joined.encode()).hexdigest()[:40]}"


def live_nodes(client: e.Etcd, keys: Keys) -> dict[str, r.NodeRecord]:
    """node -> its record, for every node registered now (a damaged record is no node that
    can be reached: left out, as ``registry.read`` shows it)."""
    return {rec.node: rec for rec, _ in r.read_all(client, keys.nodes, r.NodeRecord, {})}


def read_op(client: e.Etcd, keys: Keys, op_id: str) -> r.FleetOp | None:
    return r.read(client, keys.op(op_id), r.FleetOp)


def read_parts(client: e.Etcd, keys: Keys, op_id: str) -> dict[str, tuple[r.Part, int]]:
    """engine -> (its part, the part's revision)."""
    return {kv.key.rsplit("/", 1)[1]: (part, kv.mod_revision)
            for part, kv in r.read_all(client, keys.parts(op_id), r.Part)}


def running(client: e.Etcd, keys: Keys,
            damaged: dict[str, str]) -> list[tuple[r.FleetOp, int]]:
    """Every fleet operation still running, with its revision; a damaged one goes to
    ``damaged`` (key -> why)."""
    return [(op, kv.mod_revision) for op, kv in r.read_all(client, keys.ops, r.FleetOp, damaged)
            if op.status is OperationStatus.RUNNING]


def same_op(op: r.FleetOp, kind: FleetKind, engines: list[str]) -> r.FleetOp:
    """``op``, found under the id a caller gave for a ``kind`` of ``engines``: the same
    operation is followed; another one is refused (``UsageError``)."""
    if engines and (op.kind, op.engines) != (kind, list(engines)):
        raise UsageError(f"operation id {op.op_id} was already used for a fleet {op.kind} of "
                         f"{', '.join(op.engines)}; a repeated id must repeat the same "
                         "operation", op_id=op.op_id, kind=str(op.kind), engines=op.engines)
    return op


def create(client: e.Etcd, keys: Keys, op: r.FleetOp, writes: list[dict]) -> r.FleetOp:
    """Make ``op`` exist, with ``writes`` (its parts, its record) in the same transaction,
    unless its id exists already: then the operation found (``same_op``)."""
    ok, resp = client.txn([e.compare_created(keys.op(op.op_id))],
                          [*writes, e.put_op(keys.op(op.op_id), r.encode(op))],
                          [e.get_op(keys.op(op.op_id))])
    if ok:
        return op
    # another caller made it first, with this id
    found = r.decode(r.FleetOp, resp[0]["kvs"][0].value, keys.op(op.op_id))
    return same_op(found, op.kind, op.engines)


def find(client: e.Etcd, keys: Keys, op_id: str, kind: FleetKind,
         engines: list[str]) -> r.FleetOp | None:
    """The operation with ``op_id`` if there is one (the same again, or refused)."""
    try:
        existing = read_op(client, keys, op_id)
    except DamagedRecordError as err:  # policy: an id whose record is damaged is not reused
        raise UsageError(f"operation id {op_id} is taken by a damaged record: {err.message}",
                         op_id=op_id, key=keys.op(op_id)) from None
    return None if existing is None else same_op(existing, kind, engines)
