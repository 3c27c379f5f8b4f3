"""The fleet's retention: ended fleet operations forgotten after ``[fleet] keep_days``.

Etcd would otherwise keep every fleet operation, its parts, its migration record and its
steps' ends for ever (a fleet cycle of 100 engines every hour: 2.4 million keys a year). The
coordinator collects once an hour (``node``); ``ckptctl fleet gc [--older-than D]`` does it
at once. An operation goes, with every key of its own (``ops/<op>``, ``parts/<op>/``,
``migrations/<op>``, ``migration-steps/<op>/``, ``migration-images/<op>/``), once it ended
longer ago than the bound, in one transaction that checks it did not change since it was
read. Never one that something still points at: a running one, one ``unavailable``,
``locks/`` or ``moving/`` names (it explains why an engine is out), nor an engine's newest
migration (what a node back after a long absence settles by, ``migration.settle``). A
damaged operation record is left alone and counted. Neighbours: ``ops``, ``records``,
``unavailable``, ``node`` (the hourly run), ``cli.fleet_cmd`` (``fleet gc``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet import unavailable
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.migration.settle import newest_per_engine
from ckpt_controller.vocab import OperationStatus

#: how often the coordinator collects
GC_EVERY_S = 3600.0


@dataclass
class GcReport:
    #: the operations forgotten
    deleted: list[str] = field(default_factory=list)
    #: op id -> why it stays although it is old enough
    kept: dict[str, str] = field(default_factory=dict)
    #: key -> why it could not be read (left alone)
    damaged: dict[str, str] = field(default_factory=dict)


def collect(client: e.Etcd, keys: Keys, older_than_s: float,
            now: float | None = None) -> GcReport:
    """Forget every ended fleet operation older than ``older_than_s`` (see the module)."""
    cutoff = (time.time() if now is None else now) - older_than_s
    report = GcReport()
    found = r.read_all(client, keys.ops, r.FleetOp, report.damaged)
    old = [(op, kv) for op, kv in found if op.status is not OperationStatus.RUNNING
           and (op.ended if op.ended is not None else op.created) < cutoff]
    if not old:
        return report
    held = _held(client, keys)
    for op, kv in old:
        if op.op_id in held:
            report.kept[op.op_id] = held[op.op_id]
            continue
        deletes = [e.delete_op(keys.op(op.op_id)),
                   e.delete_op(keys.parts(op.op_id), e.prefix_end(keys.parts(op.op_id))),
                   e.delete_op(keys.migration(op.op_id)),
                   e.delete_op(keys.step_ends(op.op_id), e.prefix_end(keys.step_ends(op.op_id))),
                   e.delete_op(keys.images(op.op_id), e.prefix_end(keys.images(op.op_id)))]
        ok, _ = client.txn([e.compare_modified(keys.op(op.op_id), kv.mod_revision)], deletes)
        if ok:
            report.deleted.append(op.op_id)
    return report


def _held(client: e.Etcd, keys: Keys) -> dict[str, str]:
    """op id -> why it must stay: named by ``unavailable``, a lock, ``moving/``, or the
    newest migration of its engine."""
    held: dict[str, str] = {}
    out, _ = unavailable.read(client, keys)
    for engine, by in out.items():
        held.setdefault(by.removeprefix(r.LOST_PREFIX), f"{engine} is out of service by it")
    for kv in client.get_prefix(keys.locks):
        held.setdefault(kv.value.decode(errors="replace"), "it holds an engine's lock")
    for kv in client.get_prefix(f"{keys.prefix}/moving/"):
        held.setdefault(kv.value.decode(errors="replace"), "its engine may still move")
    for mig in newest_per_engine(r.read_all(client, keys.migrations, r.Migration, {})):
        held.setdefault(mig.op_id, f"the newest migration of {mig.engine}")
    return held
