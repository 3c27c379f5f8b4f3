"""Fleet operations: recorded in etcd, driven by the elected coordinator, each engine's part
run by the engine's own node as an ordinary node-local operation.

The life of one (``docs/fleet.md``):

1. ``submit`` (``ckptctl fleet prepare|capture|restore|cycle|rollback``) checks the request
   against the fleet (every engine registered, its node up; a prepare that would leave more
   engines out of service than ``--max-unavailable`` refused up front), writes its parts
   (``parts/<op>/<engine>``, pending) and then the operation (``ops/<op>``), which makes it
   exist. The same id again follows the existing operation (and returns its result); the
   same id for another operation is refused. ``follow`` waits for the end, printing progress.
   Nothing of the operation lives in the caller: killed, it loses nothing.
2. The coordinator (``Coordinator.drive``, on one node at a time) starts pending parts in
   engine order: a part that takes its engine out of service (prepare, cycle) starts only if
   ``unavailable`` has room for it under the operation's limit, and one transaction checks
   the revisions of the part and of ``unavailable``, marks the part started, adds the engine
   to ``unavailable`` and puts the part in its node's inbox. A coordinator that dies between
   two steps leaves nothing half done; the next one reads the same state and goes on.
3. The node runs the part (``node.FleetNode``) as a node-local operation with the part's
   ``local_op`` id (its journal answers a repeated id with the first result, so a part never
   runs twice) and writes its end into the part.
4. The coordinator settles each ended part (the engine is in ``unavailable`` exactly when it
   is not RUNNING after it), stops starting parts at the first failure (the rest are
   skipped), marks parts of a node that died as lost, and ends the operation when no part
   is left running.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable

import msgspec

from ckpt_controller.errors import BusyError, OperationError, UnreachableError, UsageError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet.keys import (
    FleetOp,
    Keys,
    Param,
    Part,
    decode_engine,
    decode_node,
    encode,
)

log = logging.getLogger("ckpt_controller.fleet")

#: kinds whose part takes its engine out of service (what ``--max-unavailable`` limits)
TAKES_OUT = frozenset({"prepare", "cycle"})
KINDS = ("prepare", "capture", "restore", "cycle", "rollback")
#: parts written in one transaction at most (etcd allows 128 operations)
PARTS_PER_TXN = 100

_op_dec = msgspec.json.Decoder(FleetOp)
_part_dec = msgspec.json.Decoder(Part)


def local_op_id(op_id: str, engine: str) -> str:
    """The node-local operation id of ``engine``'s part: ``<op>.<engine>``, or a digest when
    that would pass the 128 characters an id may have."""
    joined = f"{op_id}.{engine}"
    if len(joined) <= 128:
        return joined
    return f"fleet-{hashlib.sha256(joined.encode()).hexdigest()[:40]}"


# ---------------------------------------------------------------- unavailable

def read_unavailable(client: e.Etcd, keys: Keys) -> tuple[dict[str, str], int]:
    """The engines out of service (engine -> what took it out) and the key's revision
    (0: absent)."""
    kv = client.get(keys.unavailable)
    if kv is None:
        return {}, 0
    try:
        return _unavailable_dec.decode(kv.value or b"{}"), kv.mod_revision
    except msgspec.DecodeError as err:  # policy: nothing can be counted: nothing starts
        raise DamagedRecord(
            f"{keys.unavailable} is damaged ({err}): the fleet cannot count the engines out "
            "of service, so no fleet operation starts a part; once none is out of service, "
            f"repair it: etcdctl put {keys.unavailable} '{{}}'", key=keys.unavailable) from None


class DamagedRecord(OperationError):
    """A record the fleet's limits depend on cannot be read: nothing that needs it goes on."""


_unavailable_dec = msgspec.json.Decoder(dict[str, str])


def unavailable_ops(keys: Keys, out: dict[str, str], revision: int) -> tuple[dict, dict]:
    """The compare that ``unavailable`` is still at ``revision``, and the put of ``out``."""
    compare = (e.compare_modified(keys.unavailable, revision) if revision
               else e.compare_created(keys.unavailable))
    return compare, e.put_op(keys.unavailable, json.dumps(out, sort_keys=True))


def update_unavailable(client: e.Etcd, keys: Keys,
                       change: Callable[[dict[str, str]], dict[str, str] | None],
                       tries: int = 20) -> None:
    """Apply ``change`` to ``unavailable`` (None: leave it) with compare-and-swap."""
    for _ in range(tries):
        out, rev = read_unavailable(client, keys)
        new = change(dict(out))
        if new is None or new == out:
            return
        compare, put = unavailable_ops(keys, new, rev)
        if client.txn([compare], [put])[0]:
            return
    raise BusyError("unavailable changed under every try", key=keys.unavailable)


# ---------------------------------------------------------------- submitting

def live_nodes(client: e.Etcd, keys: Keys) -> dict:
    """node -> its record, for every node registered now (a damaged record: left out)."""
    out = {}
    for kv in client.get_prefix(keys.nodes):
        try:
            rec = decode_node(kv.value)
        except msgspec.DecodeError:  # policy: no node can be read there: not a live one
            continue
        out[rec.node] = rec
    return out


def read_op(client: e.Etcd, keys: Keys, op_id: str) -> FleetOp | None:
    kv = client.get(keys.op(op_id))
    return _op_dec.decode(kv.value) if kv is not None else None


def read_parts(client: e.Etcd, keys: Keys, op_id: str) -> dict[str, tuple[Part, int]]:
    """engine -> (its part, the part's revision)."""
    return {kv.key.rsplit("/", 1)[1]: (_part_dec.decode(kv.value), kv.mod_revision)
            for kv in client.get_prefix(keys.parts(op_id))}


def submit(client: e.Etcd, keys: Keys, *, op_id: str, kind: str, engines: list[str],
           params: dict, max_unavailable: int | None) -> FleetOp:
    """Record the operation in etcd (or find the one with this id); see the module doc."""
    if kind not in KINDS:
        raise UsageError(f"unknown fleet operation {kind!r}", kinds=list(KINDS))
    existing = read_op(client, keys, op_id)
    if existing is not None:
        return _same(existing, kind, engines)
    if not engines:
        raise UsageError("no engines selected")
    registered = {kv.key[len(keys.engines):]: decode_engine(kv.value)
                  for kv in client.get_prefix(keys.engines)}
    up = set(live_nodes(client, keys))
    unknown = [n for n in engines if n not in registered]
    if unknown:
        raise UsageError(f"not registered in the fleet: {', '.join(unknown)}",
                         unknown=unknown, known=sorted(registered))
    down = sorted({registered[n].node for n in engines} - up)
    if down:
        raise UnreachableError(f"node(s) down: {', '.join(down)}; their engines cannot take "
                               "part", nodes=down)
    limit = max_unavailable if max_unavailable is not None else len(engines)
    if limit < 1:
        raise UsageError("--max-unavailable must be at least 1", max_unavailable=limit)
    if kind in TAKES_OUT:
        others = _held_out(client, keys, engines)
        needed = len(others) + (len(engines) if kind == "prepare" else 1)
        if needed > limit:
            what = (f"{len(engines)} engine(s) prepared and held out of service"
                    if kind == "prepare" else "one engine at a time")
            raise UsageError(
                f"--max-unavailable {limit} cannot hold: {len(others)} engine(s) are out of "
                f"service already ({', '.join(sorted(others)) or '-'}) and this {kind} needs "
                f"{what}", max_unavailable=limit, unavailable=sorted(others))
    op = FleetOp(op_id=op_id, kind=kind, engines=list(engines), params=params,
                 max_unavailable=limit, created=time.time())
    parts = [Part(engine=n, node=registered[n].node, local_op=local_op_id(op_id, n))
             for n in engines]
    absent = e.compare_created(keys.op(op_id))
    for i in range(0, len(parts), PARTS_PER_TXN):
        chunk = parts[i:i + PARTS_PER_TXN]
        client.txn([absent], [e.put_op(keys.part(op_id, p.engine), encode(p)) for p in chunk])
    ok, resp = client.txn([absent], [e.put_op(keys.op(op_id), encode(op))],
                          [e.get_op(keys.op(op_id))])
    if not ok:  # another caller made it first, with this id
        return _same(_op_dec.decode(resp[0]["kvs"][0].value), kind, engines)
    return op


def _held_out(client: e.Etcd, keys: Keys, engines: list[str]) -> set[str]:
    """The engines (other than ``engines``) out of service that stay out until someone
    restores them: not those an operation running now (a fleet one, or one holding the
    engine's lock) will bring back. A limit these fill already can never be met."""
    out, _ = read_unavailable(client, keys)
    held = set()
    for name, by in out.items():
        if name in engines:
            continue
        op = read_op(client, keys, by) if not by.startswith("lost:") else None
        if op is not None and op.status == "running" and op.kind == "cycle":
            continue  # a rolling cycle brings it back
        if client.get(keys.lock(name)) is not None and (op is None or op.status == "running"):
            continue  # an operation runs on it now (a node-local cycle, say)
        held.add(name)
    return held


def _same(op: FleetOp, kind: str, engines: list[str]) -> FleetOp:
    if engines and (op.kind, op.engines) != (kind, list(engines)):
        raise UsageError(f"operation id {op.op_id} was already used for a fleet {op.kind} of "
                         f"{', '.join(op.engines)}; a repeated id must repeat the same "
                         "operation", op_id=op.op_id, kind=op.kind, engines=op.engines)
    return op


# ---------------------------------------------------------------- the coordinator

class Task(msgspec.Struct, kw_only=True):
    """A started part as its node's inbox holds it: all the node needs to run it and to write
    its end, so the node reads nothing else."""

    op_id: str
    kind: str
    engine: str
    node: str
    local_op: str
    params: dict[str, Param] = {}
    started: float


task_dec = msgspec.json.Decoder(Task)

#: parts started or settled in one transaction at most (each is a compare and up to three
#: puts or deletes; etcd allows 128 operations in one)
BATCH = 25


class Coordinator:
    """Drives every running fleet operation further on each ``drive``: a round reads the
    operations, the nodes, ``unavailable`` and each running operation's parts once, and
    writes what changed in batched transactions."""

    def __init__(self, client: e.Etcd, keys: Keys) -> None:
        from ckpt_controller.fleet.migration import Driver

        self.etcd = client
        self.keys = keys
        self._unreadable: set[str] = set()  # keys and operations said to be damaged
        #: drives migrations (kind ``migrate``): steps on two nodes, not parts
        self.migrations = Driver(client, keys)

    def drive(self) -> bool:
        """One round; whether it wrote anything (then another round may do more)."""
        running = []
        for kv in self.etcd.get_prefix(self.keys.ops):
            try:
                op = _op_dec.decode(kv.value)
            except msgspec.DecodeError as err:  # policy: not an operation: said, left alone
                if kv.key not in self._unreadable:
                    log.error("fleet: %s is no fleet operation (%s); left alone", kv.key, err)
                    self._unreadable.add(kv.key)
                continue
            if op.status == "running":
                running.append((op, kv.mod_revision))
        if not running:
            return False
        nodes = live_nodes(self.etcd, self.keys)
        wrote = False
        for op, rev in running:
            try:
                wrote |= self.drive_op(op, rev, nodes)
            except (msgspec.DecodeError, KeyError) as err:  # policy: its parts are damaged:
                # that operation stays as it is, said once; the others go on
                if op.op_id not in self._unreadable:
                    log.error("fleet: operation %s has unreadable or missing parts (%r); "
                              "left alone", op.op_id, err)
                    self._unreadable.add(op.op_id)
        return wrote

    def drive_op(self, op: FleetOp, op_rev: int, nodes: dict) -> bool:
        if op.kind == "migrate":
            return self.migrations.drive(op, op_rev, nodes)
        k = self.keys
        parts = read_parts(self.etcd, k, op.op_id)
        out, out_rev = read_unavailable(self.etcd, k)
        now = time.time()
        # parts that ended, or whose node died under them, are settled: ``unavailable`` says
        # whether the engine is out of service after it
        ending = []
        for name in op.engines:
            part, rev = parts[name]
            if part.status == "started" and part.node not in nodes:
                ending.append((msgspec.structs.replace(
                    part, status="lost", ended=now,
                    error=f"node {part.node} was lost while the part ran"), rev, True))
            elif part.status in ("succeeded", "failed") and not part.settled:
                ending.append((part, rev, False))
        if ending:
            return self._settle(op, ending, out, out_rev)
        stopped = any(p.status in ("failed", "lost") for p, _ in parts.values())
        if stopped:
            skipped = [(msgspec.structs.replace(
                p, status="skipped", settled=True, ended=now,
                error="not started: the operation stopped at a failure"), rev)
                for p, rev in (parts[n] for n in op.engines) if p.status == "pending"]
            if skipped:
                for i in range(0, len(skipped), BATCH):
                    chunk = skipped[i:i + BATCH]
                    self.etcd.txn([e.compare_modified(k.part(op.op_id, p.engine), r)
                                   for p, r in chunk],
                                  [e.put_op(k.part(op.op_id, p.engine), encode(p))
                                   for p, _ in chunk])
                return True
        else:
            starting = []
            room = dict(out)
            for name in op.engines:
                part, rev = parts[name]
                if part.status != "pending":
                    continue
                if part.node not in nodes:
                    break  # waits for its node, and the ones after it for their turn
                if op.kind in TAKES_OUT and name not in room:
                    if len(room) + 1 > op.max_unavailable:
                        break  # no room now: engines start in order
                    room[name] = op.op_id
                starting.append((part, rev))
            if starting:
                return self._start(op, starting, nodes, out, out_rev, room)
        if all(p.status not in ("pending", "started") and p.settled for p, _ in parts.values()):
            ok = all(p.status == "succeeded" for p, _ in parts.values())
            failed = [f"{p.engine}: {p.status}: {p.error}" for p, _ in parts.values()
                      if p.status != "succeeded"]
            done = msgspec.structs.replace(op, status="succeeded" if ok else "failed",
                                           ended=now,
                                           error=None if ok else "; ".join(failed)[:2000])
            self.etcd.txn([e.compare_modified(k.op(op.op_id), op_rev)],
                          [e.put_op(k.op(op.op_id), encode(done))])
            log.info("fleet: %s %s %s", op.kind, op.op_id, done.status)
            return True
        return False

    def _start(self, op: FleetOp, starting: list, nodes: dict, out: dict, out_rev: int,
               room: dict) -> bool:
        """Start ``starting``; ``unavailable`` becomes ``room`` (every engine the parts take
        out), checked against the revision it was read at."""
        k = self.keys
        now = time.time()

        def start(item):
            part, rev = item
            started = msgspec.structs.replace(part, status="started", started=now)
            task = Task(op_id=op.op_id, kind=op.kind, engine=part.engine, node=part.node,
                        local_op=part.local_op, params=op.params, started=now)
            return ([e.compare_modified(k.part(op.op_id, part.engine), rev)],
                    [e.put_op(k.part(op.op_id, part.engine), encode(started)),
                     e.put_op(k.todo(part.node, op.op_id, part.engine), encode(task)),
                     # the engine's lock, under its node's lease, for the part's run
                     e.put_op(k.lock(part.engine), part.local_op, nodes[part.node].lease)])

        self._in_batches(starting, start, out, out_rev, room)
        return True

    def _settle(self, op: FleetOp, ending: list, out: dict, out_rev: int) -> bool:
        """Mark ``ending`` settled; ``unavailable`` says after it whether each engine is out
        of service (lost ones: until their node is back)."""
        k = self.keys
        new = dict(out)
        for part, _, lost in ending:
            if lost:  # out of service until its node is back and says otherwise
                new[part.engine] = f"lost:{op.op_id}"
            elif part.state is None:  # refused before it ran: as it was before the part
                if new.get(part.engine) == op.op_id:
                    new.pop(part.engine)
            elif part.state == "running":
                new.pop(part.engine, None)
            else:
                new.setdefault(part.engine, op.op_id)

        def settle(item):
            part, rev, lost = item
            writes = [e.put_op(k.part(op.op_id, part.engine),
                               encode(msgspec.structs.replace(part, settled=True)))]
            if lost:  # out of the dead node's inbox, and its lock
                writes += [e.delete_op(k.todo(part.node, op.op_id, part.engine)),
                           e.delete_op(k.lock(part.engine))]
            return [e.compare_modified(k.part(op.op_id, part.engine), rev)], writes

        self._in_batches(ending, settle, out, out_rev, new)
        return True

    def _in_batches(self, items: list, each, out: dict, out_rev: int, new_out: dict) -> None:
        """``each(item) -> (compares, writes)`` for every item, ``BATCH`` items to a
        transaction; the first also writes ``unavailable`` as ``new_out`` (when it changes),
        checked against ``out_rev``. Stops at a transaction whose compares fail: something
        moved meanwhile, and the next round reads again."""
        for i in range(0, len(items), BATCH):
            compare, success = [], []
            if i == 0 and new_out != out:
                cmp_out, put_out = unavailable_ops(self.keys, new_out, out_rev)
                compare.append(cmp_out)
                success.append(put_out)
            for item in items[i:i + BATCH]:
                c, w = each(item)
                compare += c
                success += w
            if not self.etcd.txn(compare, success)[0]:
                return
