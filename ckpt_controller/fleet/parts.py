"""The per-engine parts driver (``Drive.PARTS``): a fleet operation whose every engine's part
is an ordinary node-local operation on the engine's own node.

The life of one (``docs/fleet.md``, Fleet operations):

1. ``submit`` checks the request against the fleet (every engine registered, its node up; a
   kind whose limit rule holds all its engines out (``prepare``) is refused up front when
   they would not fit under ``--max-unavailable``; a rolling kind that names no limit gets
   ``default_limit``: a quarter of its engines, at least one), writes its parts
   (``parts/<op>/<engine>``, pending) and then the operation (``ops/<op>``), which makes it
   exist. Nothing of the operation lives in the caller: killed, it loses nothing.
2. The coordinator (``PartsDriver.drive``) starts pending parts in engine order: a part that
   takes its engine out of service starts only if ``unavailable`` has room for it under the
   operation's limit; one whose engine another operation holds (its lock: a node-local
   one runs on it) ends failed without starting, as the node would refuse it, and never
   touches that lock. One transaction checks the revisions of the part and of
   ``unavailable`` and that the lock is still free, marks the part started, adds the engine
   to ``unavailable``, takes the engine's lock and puts the part in its node's inbox. A coordinator that dies between two
   steps leaves nothing half done; the next one reads the same state and goes on.
3. The node runs the part (``PartRunner``) as a node-local operation with the part's
   ``local_op`` id (its journal answers a repeated id with the first result, so a part never
   runs twice) and writes its end into the part.
4. The coordinator settles each ended part (the engine is in ``unavailable`` exactly when it
   is not RUNNING after it), stops starting parts at the first failure (the rest are
   skipped), marks parts of a node that died as lost, fails a pending part whose node has
   not been up for ``PENDING_NODE_DOWN_LEASES`` of its leases (it never started: nothing
   else would ever move it), and ends the operation when no part is left running.

Neighbours: ``kinds`` (the rows this drives), ``ops``, ``unavailable``, ``records``,
``coordinator`` and ``node`` (which call it), ``drivers``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from ckpt_controller.errors import CkptError, UnreachableError, UsageError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import ops
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet import unavailable
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.kinds import KINDS, KindSpec
from ckpt_controller.values import DEFAULT_MAX_UNAVAILABLE
from ckpt_controller.vocab import CheckpointState, LimitRule, OperationStatus, PartStatus

log = logging.getLogger("ckpt_controller.fleet")

#: parts written in one transaction at most when submitted (etcd allows 128 operations)
PARTS_PER_TXN = 100
#: parts started or settled in one transaction at most (each is a compare and up to three
#: puts or deletes)
BATCH = 25


# ---------------------------------------------------------------- submitting

def submit(client: e.Etcd, keys: Keys, spec: KindSpec, *, op_id: str, engines: list[str],
           params: dict, max_unavailable: int | None) -> r.FleetOp:
    """Record the operation in etcd (or find the one with this id); see the module doc."""
    existing = ops.find(client, keys, op_id, spec.kind, engines)
    if existing is not None:
        return existing
    if not engines:
        raise UsageError("no engines selected")
    registered = {kv.key[len(keys.engines):]: rec
                  for rec, kv in r.read_all(client, keys.engines, r.EngineRecord, {})}
    unknown = [n for n in engines if n not in registered]
    if unknown:
        raise UsageError(f"not registered in the fleet: {', '.join(unknown)}",
                         unknown=unknown, known=sorted(registered))
    down = sorted({registered[n].node for n in engines} - set(ops.live_nodes(client, keys)))
    if down:
        raise UnreachableError(f"node(s) down: {', '.join(down)}; their engines cannot take "
                               "part", nodes=down)
    limit = max_unavailable if max_unavailable is not None else default_limit(spec, len(engines))
    if limit < 1:
        raise UsageError("--max-unavailable must be at least 1", max_unavailable=limit)
    if spec.takes_out:
        _check_room(client, keys, spec, engines, limit)
    op = r.FleetOp(op_id=op_id, kind=spec.kind, engines=list(engines), params=params,
                   max_unavailable=limit, created=time.time())
    parts = [r.Part(engine=n, node=registered[n].node, local_op=ops.local_op_id(op_id, n))
             for n in engines]
    absent = e.compare_created(keys.op(op_id))
    for i in range(0, len(parts), PARTS_PER_TXN):
        chunk = parts[i:i + PARTS_PER_TXN]
        client.txn([absent], [e.put_op(keys.part(op_id, p.engine), r.encode(p)) for p in chunk])
    return ops.create(client, keys, op, [])


def default_limit(spec: KindSpec, engines: int) -> int:
    """The limit of an operation that names none: a rolling one takes out
    ``values.DEFAULT_MAX_UNAVAILABLE`` of its engines at once (25%, at least one); a prepare
    holds out every engine it names (it could not finish under less)."""
    if spec.limit is LimitRule.ROLLING:
        return DEFAULT_MAX_UNAVAILABLE.of(engines)
    return engines


def _check_room(client: e.Etcd, keys: Keys, spec: KindSpec, engines: list[str],
                limit: int) -> None:
    """Refuse up front what the limit can never hold: engines held out already, plus what
    this operation needs out at once (all of them, or one at a time)."""
    others = held_out(client, keys, engines)
    holds_all = spec.limit is LimitRule.HOLDS_ALL
    needed = len(others) + (len(engines) if holds_all else 1)
    if needed > limit:
        what = (f"{len(engines)} engine(s) prepared and held out of service" if holds_all
                else "one engine at a time")
        raise UsageError(
            f"--max-unavailable {limit} cannot hold: {len(others)} engine(s) are out of "
            f"service already ({', '.join(sorted(others)) or '-'}) and this {spec.kind} needs "
            f"{what}", max_unavailable=limit, unavailable=sorted(others))


def held_out(client: e.Etcd, keys: Keys, engines: list[str]) -> set[str]:
    """The engines (other than ``engines``) out of service that stay out until someone
    restores them: not those an operation running now (a rolling fleet one, or one holding
    the engine's lock) will bring back. A limit these fill already can never be met."""
    out, _ = unavailable.read(client, keys)
    held = set()
    for name, by in out.items():
        if name in engines:
            continue
        op = None if unavailable.is_lost(by) else ops.read_op(client, keys, by)
        running = op is not None and op.status is OperationStatus.RUNNING
        if running and KINDS[op.kind].limit is LimitRule.ROLLING:
            continue  # a rolling operation brings it back
        if client.get(keys.lock(name)) is not None and (op is None or running):
            continue  # an operation runs on it now (a node-local cycle, say)
        held.add(name)
    return held


# ---------------------------------------------------------------- the coordinator's side

#: a pending part whose node this coordinator has not seen up for this many lease TTLs ends
#: failed (never started), and the operation stops there as at any failure
PENDING_NODE_DOWN_LEASES = 6


class PartsDriver:
    """Drives a parts operation further on each ``drive``: settles the parts that ended (or
    whose node died), skips the pending ones after a failure, starts the ones there is room
    for, and ends the operation when every part is settled. Each write is a transaction on
    the revisions it read. ``lease_ttl_s``: the nodes' lease, the unit of how long a pending
    part waits for its node."""

    def __init__(self, client: e.Etcd, keys: Keys, *, lease_ttl_s: float = 5.0) -> None:
        self.etcd = client
        self.keys = keys
        self.node_down_s = PENDING_NODE_DOWN_LEASES * lease_ttl_s
        #: node -> when this coordinator first saw it down (monotonic); a new coordinator
        #: starts counting afresh, so a part waits at least the bound
        self._down_since: dict[str, float] = {}

    def drive(self, op: r.FleetOp, op_rev: int, nodes: dict) -> bool:
        for node in [n for n in self._down_since if n in nodes]:
            del self._down_since[node]
        parts = ops.read_parts(self.etcd, self.keys, op.op_id)
        out, out_rev = unavailable.read(self.etcd, self.keys)
        missing = [n for n in op.engines if n not in parts]
        if missing:
            raise KeyError(self.keys.part(op.op_id, missing[0]))
        ending = self._ending(op, parts, nodes)
        if ending:
            return self._settle(op, ending, out, out_rev)
        if self._restore_inboxes(op, parts, nodes):
            return True
        if any(p.status in (PartStatus.FAILED, PartStatus.LOST) for p, _ in parts.values()):
            if self._skip(op, parts):
                return True
        else:
            starting, room, held = self._startable(op, parts, nodes, out)
            if held is not None:
                return self._refuse(op, *held)
            if starting:
                return self._start(op, starting, nodes, out, out_rev, room)
        if all(p.status.ended and p.settled for p, _ in parts.values()):
            return self._end(op, op_rev, parts)
        return False

    def _ending(self, op: r.FleetOp, parts: dict, nodes: dict) -> list:
        """Parts that ended, or whose node died under them (lost): (part, rev, lost)."""
        ending = []
        for name in op.engines:
            part, rev = parts[name]
            if part.status is PartStatus.STARTED and part.node not in nodes:
                ending.append((msgspec.structs.replace(
                    part, status=PartStatus.LOST, ended=time.time(),
                    error=f"node {part.node} was lost while the part ran"), rev, True))
            elif part.status in (PartStatus.SUCCEEDED, PartStatus.FAILED) and not part.settled:
                ending.append((part, rev, False))
            elif part.status is PartStatus.PENDING and part.node not in nodes:
                since = self._down_since.setdefault(part.node, time.monotonic())
                if time.monotonic() - since >= self.node_down_s:  # never started: state None
                    ending.append((msgspec.structs.replace(
                        part, status=PartStatus.FAILED, ended=time.time(),
                        error=f"not started: node {part.node} was not up for "
                              f"{self.node_down_s:g} s"), rev, False))
        return ending

    def _startable(self, op: r.FleetOp, parts: dict, nodes: dict, out: dict):
        """The pending parts to start now, in engine order, ``unavailable`` with their
        engines, and the first part whose engine another operation holds (its lock), with
        its revision and the holder, if one would start: each waits for its node, and for
        room under the limit if it takes its engine out (the ones after it wait for their
        turn)."""
        starting, room = [], dict(out)
        takes_out = KINDS[op.kind].takes_out
        if takes_out:  # its own running parts are out, whatever ``unavailable`` says now
            # (a key deleted or overwritten under it would let more start than the limit;
            # the start's transaction writes them back)
            for name in op.engines:
                part = parts[name][0]
                if part.status is PartStatus.STARTED or (part.status.ended
                                                         and not part.settled):
                    room.setdefault(name, op.op_id)
        locked = None
        for name in op.engines:
            part, rev = parts[name]
            if part.status is not PartStatus.PENDING:
                continue
            if part.node not in nodes:
                break
            if locked is None:  # read once a part might start: the engines' locks
                locked = {kv.key[len(self.keys.locks):]: kv.value.decode(errors="replace")
                          for kv in self.etcd.get_prefix(self.keys.locks)}
            if name in locked:  # an operation runs on it (a node-local one, say)
                return starting, room, (part, rev, locked[name])
            if takes_out and name not in room:
                if len(room) + 1 > op.max_unavailable:
                    break
                room[name] = op.op_id
            starting.append((part, rev))
        return starting, room, None

    def _restore_inboxes(self, op: r.FleetOp, parts: dict, nodes: dict) -> bool:
        """A started part whose task is gone from its (live) node's inbox, deleted by hand,
        would never end, and its engine's place in ``unavailable`` would be held for ever:
        the task is put back (the node runs it once: a repeated local op id is answered
        with its first result), said. Whether it wrote anything."""
        wrote = False
        for name in op.engines:
            part, rev = parts[name]
            if part.status is not PartStatus.STARTED or part.node not in nodes:
                continue
            todo = self.keys.todo(part.node, op.op_id, name)
            if self.etcd.get(todo) is not None:
                continue
            task = r.Task(op_id=op.op_id, kind=op.kind, engine=name, node=part.node,
                          local_op=part.local_op, params=op.params,
                          started=part.started or time.time())
            ok, _ = self.etcd.txn([e.compare_modified(self.keys.part(op.op_id, name), rev),
                                   e.compare_created(todo)],
                                  [e.put_op(todo, r.encode(task))])
            if ok:
                log.warning("fleet: %s's task of %s %s was gone from node %s's inbox while it "
                            "ran; put back", name, op.kind, op.op_id, part.node)
                wrote = True
        return wrote

    def _refuse(self, op: r.FleetOp, part: r.Part, rev: int, holder: str) -> bool:
        """``part``'s engine is held by operation ``holder``: the part ends failed, never
        started (the engine as it was), and the operation stops there as at any failure;
        the lock stays the holder's."""
        refused = msgspec.structs.replace(
            part, status=PartStatus.FAILED, ended=time.time(),
            error=f"BusyError: engine {part.engine} is held by operation {holder} (its lock "
                  "in etcd); not started")
        self.etcd.txn([e.compare_modified(self.keys.part(op.op_id, part.engine), rev)],
                      [e.put_op(self.keys.part(op.op_id, part.engine), r.encode(refused))])
        return True

    def _skip(self, op: r.FleetOp, parts: dict) -> bool:
        """After a failure: the pending parts end skipped (whether any were)."""
        k = self.keys
        skipped = [(msgspec.structs.replace(
            p, status=PartStatus.SKIPPED, settled=True, ended=time.time(),
            error="not started: the operation stopped at a failure"), rev)
            for p, rev in (parts[n] for n in op.engines) if p.status is PartStatus.PENDING]
        for i in range(0, len(skipped), BATCH):
            chunk = skipped[i:i + BATCH]
            self.etcd.txn([e.compare_modified(k.part(op.op_id, p.engine), rev)
                           for p, rev in chunk],
                          [e.put_op(k.part(op.op_id, p.engine), r.encode(p)) for p, _ in chunk])
        return bool(skipped)

    def _end(self, op: r.FleetOp, op_rev: int, parts: dict) -> bool:
        ok = all(p.status is PartStatus.SUCCEEDED for p, _ in parts.values())
        failed = [f"{p.engine}: {p.status}: {p.error}" for p, _ in parts.values()
                  if p.status is not PartStatus.SUCCEEDED]
        done = msgspec.structs.replace(
            op, status=OperationStatus.SUCCEEDED if ok else OperationStatus.FAILED,
            ended=time.time(), error=None if ok else "; ".join(failed)[:2000])
        self.etcd.txn([e.compare_modified(self.keys.op(op.op_id), op_rev)],
                      [e.put_op(self.keys.op(op.op_id), r.encode(done))])
        log.info("fleet: %s %s %s", op.kind, op.op_id, done.status)
        return True

    def _start(self, op: r.FleetOp, starting: list, nodes: dict, out: dict, out_rev: int,
               room: dict) -> bool:
        """Start ``starting``; ``unavailable`` becomes ``room`` (every engine the parts take
        out), checked against the revision it was read at."""
        k = self.keys
        now = time.time()

        def start(item):
            part, rev = item
            started = msgspec.structs.replace(part, status=PartStatus.STARTED, started=now)
            task = r.Task(op_id=op.op_id, kind=op.kind, engine=part.engine, node=part.node,
                          local_op=part.local_op, params=op.params, started=now)
            # never over another operation's lock: one taken since it was read fails the
            # transaction, and the part starts on a later round, once it is free
            return ([e.compare_modified(k.part(op.op_id, part.engine), rev),
                     e.compare_created(k.lock(part.engine))],
                    [e.put_op(k.part(op.op_id, part.engine), r.encode(started)),
                     e.put_op(k.todo(part.node, op.op_id, part.engine), r.encode(task)),
                     # the engine's lock, under its node's lease, for the part's run
                     e.put_op(k.lock(part.engine), part.local_op, nodes[part.node].lease)])

        self._in_batches(starting, start, out, out_rev, room)
        return True

    def _settle(self, op: r.FleetOp, ending: list, out: dict, out_rev: int) -> bool:
        """Mark ``ending`` settled; ``unavailable`` says after it whether each engine is out
        of service (lost ones: until their node is back)."""
        k = self.keys
        new = dict(out)
        for part, _, lost in ending:
            if lost:  # out of service until its node is back and says otherwise
                new[part.engine] = r.lost_mark(op.op_id)
            elif part.state is None:  # refused before it ran: as it was before the part
                if new.get(part.engine) == op.op_id:
                    new.pop(part.engine)
            elif part.state is CheckpointState.RUNNING:
                new.pop(part.engine, None)
            else:
                new.setdefault(part.engine, op.op_id)

        def settle(item):
            part, rev, lost = item
            writes = [e.put_op(k.part(op.op_id, part.engine),
                               r.encode(msgspec.structs.replace(part, settled=True)))]
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
                cmp_out, put_out = unavailable.ops(self.keys, new_out, out_rev)
                compare.append(cmp_out)
                success.append(put_out)
            for item in items[i:i + BATCH]:
                c, w = each(item)
                compare += c
                success += w
            if not self.etcd.txn(compare, success)[0]:
                return


# ---------------------------------------------------------------- the node's side

class PartRunner:
    """Runs the parts in a node's inbox, each as a node-local operation of its kind's
    ``local`` operation with the part's ``local_op`` id, and writes each one's end."""

    def __init__(self, node, start_local: Callable) -> None:
        self.node = node
        #: runs a node-local operation: ``start(OperationCommand, done)`` (the controller's)
        self._start_local = start_local

    def run(self, task: r.Task, todo_rev: int, finished: Callable[[str], None]) -> None:
        from ckpt_controller import protocol as p

        def done(result) -> None:
            try:
                self.write_end(task, todo_rev, result)
            except CkptError as err:  # policy: etcd away: the inbox still has it; tried again
                log.warning("fleet: could not write the end of %s's part of %s: %s",
                            task.engine, task.op_id, err)
            finally:
                finished(task.local_op)

        try:
            cmd = msgspec.convert(dict(task.params, call_id=0, op_id=task.local_op,
                                       kind=KINDS[task.kind].local, engines=[task.engine]),
                                  p.OperationCommand)
        except msgspec.ValidationError as err:  # policy: a part that cannot run fails
            done(CkptError(f"bad parameters: {err}"))
            return
        log.info("fleet: %s of %s for fleet operation %s starts here", task.kind, task.engine,
                 task.op_id)
        try:
            self._start_local(cmd, done)
        except CkptError as err:  # policy: refused at once (busy, bad state): the part's end
            done(err)

    def write_end(self, task: r.Task, todo_rev: int, result) -> None:
        """One transaction: the part's end written, out of the inbox, the lock freed; only
        while the inbox still holds the task (a coordinator that found this node lost took it
        out, and the part is lost then)."""
        state, error = _ended(task.engine, result)
        k = self.node.keys
        ended = r.Part(engine=task.engine, node=task.node, local_op=task.local_op,
                       status=PartStatus.SUCCEEDED if error is None else PartStatus.FAILED,
                       state=state, error=error, started=task.started, ended=time.time())
        todo = k.todo(task.node, task.op_id, task.engine)
        writes = [e.put_op(k.part(task.op_id, task.engine), r.encode(ended)), e.delete_op(todo)]
        ok, _ = self.node.etcd.txn([e.compare_created(todo, todo_rev),
                                    e.compare_value(k.lock(task.engine), task.local_op)],
                                   writes + [e.delete_op(k.lock(task.engine))])
        if not ok:  # the lock went with an expired lease (or was never there): not ours
            self.node.etcd.txn([e.compare_created(todo, todo_rev)], writes)


def _ended(engine: str, result) -> tuple[CheckpointState | None, str | None]:
    """(the engine's state after its part, why the part failed: None when it succeeded)."""
    if isinstance(result, CkptError):
        return None, f"{result.kind}: {result.message}"
    outcome = next((o for o in result.engines if o.engine == engine), None)
    state = CheckpointState(outcome.state) if outcome is not None and outcome.state else None
    if result.status == OperationStatus.SUCCEEDED:
        return state, None
    return state, ((outcome.error.message if outcome is not None and outcome.error else None)
                   or (result.error.message if result.error else str(result.status)))
