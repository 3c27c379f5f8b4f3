"""The coordinator's side of a migration (``Drive.STEPS``): one step further per ``drive``.

A step that ended is written into the record with the step that comes next (``_after``, by
the rules of the table in the package's docstring), then that step is started (``_start``: a
``Task`` in its node's inbox); a step whose node died is counted as lost, and the same rules
decide. Each write checks the record's revision, so a coordinator that dies between two
leaves nothing half done, and the next one reads the same state and decides the same.
Neighbours: ``record`` (the record, local ids), ``records``, ``unavailable`` (the engine out
of service while it moves), ``coordinator`` (calls ``drive``), ``steps`` (the nodes' side).
"""

from __future__ import annotations

import logging
import time

import msgspec

from ckpt_controller.errors import DamagedRecordError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import ops
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet import unavailable
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.migration.record import (
    SOURCE_ENDS_IT,
    SOURCE_RESUMES_IT,
    capture_op,
    read,
)
from ckpt_controller.vocab import (
    CheckpointState,
    MigrationOutcome,
    MigrationStep,
    OperationStatus,
    PartStatus,
)

log = logging.getLogger("ckpt_controller.fleet")

Step, Outcome = MigrationStep, MigrationOutcome


class MigrationDriver:
    """Moves each running migration one step further per ``drive`` (``lease_ttl_s``: every
    coordinator driver is made alike; a migration has no bound of its own on it)."""

    def __init__(self, client: e.Etcd, keys: Keys, *, lease_ttl_s: float = 5.0) -> None:
        self.etcd = client
        self.keys = keys

    def drive(self, op: r.FleetOp, op_rev: int, nodes: dict) -> bool:
        mig, rev = read(self.etcd, self.keys, op.op_id)
        if mig is None:
            raise KeyError(self.keys.migration(op.op_id))
        if mig.outcome is not Outcome.RUNNING:
            return self._end(op, op_rev, mig)
        if not mig.started:
            return self._start(op, mig, rev, nodes)
        node = mig.node_of(mig.step)
        kv = self.etcd.get(self.keys.step_end(op.op_id, mig.step))
        if kv is not None:
            try:
                end = r.decode(r.StepEnd, kv.value, kv.key)
            except DamagedRecordError as err:  # policy: an end no one can read counts as
                # lost: the same safe rules then say where the engine goes
                log.error("fleet: migration %s: the end of its %s is damaged (%s); counted "
                          "as lost", op.op_id, mig.step, err.message)
                end = r.StepEnd(step=mig.step, node=node, status=PartStatus.LOST,
                                started=mig.step_started, ended=time.time(),
                                error=f"the end {node} wrote is damaged")
        elif node not in nodes:
            end = r.StepEnd(step=mig.step, node=node, status=PartStatus.LOST,
                            started=mig.step_started, ended=time.time(),
                            error=f"node {node} was lost while the step ran")
        else:
            return False  # it runs
        return self._after(op, mig, rev, end)

    # ---------------------------------------------------------------- what comes next

    def _after(self, op: r.FleetOp, mig: r.Migration, rev: int, end: r.StepEnd) -> bool:
        """Write ``end`` into the record with what comes next: a step, or the outcome."""
        nxt, outcome, error, transport = self._next(op, mig, end)
        updated = msgspec.structs.replace(mig, step=nxt, step_started=None,
                                          done=[*mig.done, end], outcome=outcome, error=error,
                                          started=False, transport=transport)
        k = self.keys
        self.etcd.txn([e.compare_modified(k.migration(op.op_id), rev)],
                      [e.put_op(k.migration(op.op_id), r.encode(updated)),
                       e.delete_op(k.step_end(op.op_id, end.step)),
                       e.delete_op(k.todo(end.node, op.op_id, mig.engine))])
        log.info("fleet: migration %s of %s: %s on %s %s%s", op.op_id, mig.engine, end.step,
                 end.node, end.status, f": {end.error}" if end.error else "")
        return True

    def _next(self, op: r.FleetOp, mig: r.Migration, end: r.StepEnd):
        """(the next step, the outcome, the error, the transport) after ``end``."""
        ok = end.status is PartStatus.SUCCEEDED
        nxt, outcome, error, transport = None, Outcome.RUNNING, mig.error, mig.transport
        match end.step:
            case Step.RECEIVE if ok:
                nxt, transport = Step.SEND, end.detail.get("transport")
            case Step.RECEIVE:
                outcome, error = Outcome.STAYED, f"the target could not receive it: {end.error}"
            case Step.SEND if ok:
                nxt = Step.ADOPT
            case Step.SEND:
                nxt, error = Step.ABANDON, f"the source could not send it: {end.error}"
            case Step.ADOPT if ok:
                nxt = Step.FINISH
            case Step.ADOPT:
                nxt, error = self._after_failed_adopt(op, mig, end)
            case Step.FINISH:
                outcome = Outcome.MOVED
                if end.status is PartStatus.LOST:  # as when the source is down before it
                    error = SOURCE_ENDS_IT.format(mig=mig)
                elif not ok:
                    error = (f"RUNNING on {mig.target}; {mig.source} could not end its "
                             f"stopped copy: {end.error}")
            case Step.RESUME:
                outcome = Outcome.STAYED if ok else Outcome.FAILED
                if end.status is PartStatus.LOST:
                    error = SOURCE_RESUMES_IT.format(mig=mig)
                elif not ok:
                    error = f"{mig.error}; resuming it on {mig.source} failed: {end.error}"
            case Step.ABANDON:
                outcome = self._after_failed_send(mig)
        return nxt, outcome, error, transport

    def _after_failed_adopt(self, op: r.FleetOp, mig: r.Migration, end: r.StepEnd):
        """The target may have taken the engine over before it failed or died. First
        ``moving`` goes (if the target has not taken it), so that from now on it cannot;
        then ``owners`` is final and says where the engine is. Both give the same answer
        however often a coordinator repeats them: (the next step, the error)."""
        k = self.keys
        self.etcd.txn([e.compare_value(k.moving(mig.engine), op.op_id)],
                      [e.delete_op(k.moving(mig.engine))])
        owner = self.etcd.get(k.owner(mig.engine))
        if owner is None or owner.value.decode() != mig.target:
            why = "gave it back" if end.detail.get("handed_back") else "did not take it"
            return Step.RESUME, f"the target {why}: {end.error}"
        # the target holds it (lost after its take-over: it finishes there)
        how = "was lost" if end.status is PartStatus.LOST else "failed"
        return Step.FINISH, f"the target took it over and then {how}: {end.error}"

    @staticmethod
    def _after_failed_send(mig: r.Migration) -> MigrationOutcome:
        """Where the engine is after a failed send: the source's own rules rolled it back
        (``stayed``), or the engine died in the dump (``lost``), or the source died (it
        settles the engine when it is back: ``failed``)."""
        send = next((d for d in reversed(mig.done) if d.step is Step.SEND), None)
        if send is None or send.status is PartStatus.LOST:
            return Outcome.FAILED
        if send.detail.get("engine_died"):
            return Outcome.LOST
        if send.detail.get("state") == CheckpointState.RUNNING:
            return Outcome.STAYED
        return Outcome.FAILED

    # ---------------------------------------------------------------- starting a step

    def _start(self, op: r.FleetOp, mig: r.Migration, rev: int, nodes: dict) -> bool:
        """Start the step the record names (the first: receive), or decide without it when
        that step's node is down."""
        k = self.keys
        step = mig.step or Step.RECEIVE
        node = mig.node_of(step)
        if node not in nodes:
            return self._node_down(mig, rev, step, node)
        if step is Step.RECEIVE:
            held = self.etcd.get(k.lock(mig.engine))
            if held is not None:  # an operation runs on it (a node-local one): refused
                return self._held(mig, rev, held.value.decode(errors="replace"))
            # out of service from now on, fleet-wide
            unavailable.update(self.etcd, k, lambda cur: {mig.engine: op.op_id, **cur})
        now = time.time()
        task = r.Task(op_id=op.op_id, kind=op.kind, step=step, engine=mig.engine, node=node,
                      local_op=f"{ops.local_op_id(op.op_id, mig.engine)}.{step}",
                      params={**mig.params, "source": mig.source, "target": mig.target,
                              "capture_op": capture_op(op.op_id, mig.engine)},
                      started=now)
        started = msgspec.structs.replace(mig, step=step, step_started=now, started=True)
        writes = [e.put_op(k.migration(op.op_id), r.encode(started)),
                  e.put_op(k.todo(node, op.op_id, mig.engine), r.encode(task))]
        compare = [e.compare_modified(k.migration(op.op_id), rev)]
        if step is Step.RECEIVE:  # one operation on the engine across the fleet, and its place
            writes.append(e.put_op(k.lock(mig.engine), op.op_id))
            compare.append(e.compare_created(k.lock(mig.engine)))  # never over another's
        if step is Step.ADOPT:  # the target may take it over from now on, until resumed
            writes.append(e.put_op(k.moving(mig.engine), op.op_id))
        self.etcd.txn(compare, writes)
        return True

    def _held(self, mig: r.Migration, rev: int, holder: str) -> bool:
        """Another operation holds the engine (its lock) when the migration would start:
        it ends before anything moved (``stayed``), the lock left to its holder."""
        updated = msgspec.structs.replace(
            mig, step=None, started=False, outcome=Outcome.STAYED,
            error=f"not started: engine {mig.engine} is held by operation {holder} (its lock "
                  "in etcd)")
        self.etcd.txn([e.compare_modified(self.keys.migration(mig.op_id), rev)],
                      [e.put_op(self.keys.migration(mig.op_id), r.encode(updated))])
        return True

    def _node_down(self, mig: r.Migration, rev: int, step: MigrationStep, node: str) -> bool:
        """The node of the step to start is down. A send or an adopt never starts: the
        target stops its page server (abandon), or the source, holding the engine stopped,
        resumes it. Otherwise the migration ends here, saying what the node does when it is
        back (``settle``)."""
        instead = {Step.ADOPT: (Step.RESUME, f"the target {node} was down before it could "
                                             "adopt it"),
                   Step.SEND: (Step.ABANDON, f"the source {node} was down before it could "
                                             "send it")}.get(step)
        if instead is not None:
            lost = r.StepEnd(step=step, node=node, status=PartStatus.LOST, ended=time.time(),
                             error=f"node {node} is down")
            updated = msgspec.structs.replace(mig, step=instead[0], started=False,
                                              step_started=None, error=instead[1],
                                              done=[*mig.done, lost])
        else:
            outcome, error = {
                Step.RECEIVE: (Outcome.STAYED, f"the target {node} is down"),
                Step.ABANDON: (self._after_failed_send(mig), mig.error),
                Step.FINISH: (Outcome.MOVED, SOURCE_ENDS_IT.format(mig=mig)),
                Step.RESUME: (Outcome.FAILED, SOURCE_RESUMES_IT.format(mig=mig)),
            }[step]
            updated = msgspec.structs.replace(mig, step=None, started=False, outcome=outcome,
                                              error=error)
        self.etcd.txn([e.compare_modified(self.keys.migration(mig.op_id), rev)],
                      [e.put_op(self.keys.migration(mig.op_id), r.encode(updated))])
        return True

    # ---------------------------------------------------------------- the end

    def _end(self, op: r.FleetOp, op_rev: int, mig: r.Migration) -> bool:
        """The migration ended: its operation, its part, the engine's lock and place in
        ``unavailable`` follow; the small image files go."""
        k = self.keys
        now = time.time()
        moved = mig.outcome is Outcome.MOVED
        came_back = mig.outcome in (Outcome.MOVED, Outcome.STAYED)
        part = r.Part(engine=mig.engine, node=mig.target if moved else mig.source,
                      local_op=ops.local_op_id(op.op_id, mig.engine),
                      status=PartStatus.SUCCEEDED if moved else (
                          PartStatus.LOST if mig.outcome is Outcome.LOST else PartStatus.FAILED),
                      state=CheckpointState.RUNNING if came_back else None,
                      error=mig.error, started=op.created, ended=now, settled=True)
        why = f"{mig.engine} {mig.outcome}" + (f": {mig.error}" if mig.error else "")
        ended = msgspec.structs.replace(
            op, status=OperationStatus.SUCCEEDED if moved else OperationStatus.FAILED,
            ended=now, error=None if moved else why[:2000])
        unavailable.update(self.etcd, k, lambda cur: _settled(cur, mig, op.op_id))
        for key in (k.lock(mig.engine), k.moving(mig.engine)):
            self.etcd.txn([e.compare_value(key, op.op_id)], [e.delete_op(key)])
        images = k.images(op.op_id)
        self.etcd.txn([e.compare_modified(k.op(op.op_id), op_rev)],
                      [e.put_op(k.op(op.op_id), r.encode(ended)),
                       e.put_op(k.part(op.op_id, mig.engine), r.encode(part)),
                       e.delete_op(images, e.prefix_end(images))])
        log.info("fleet: migration %s of %s from %s to %s: %s", op.op_id, mig.engine,
                 mig.source, mig.target, mig.outcome)
        return True


def _settled(cur: dict[str, str], mig: r.Migration, op_id: str) -> dict[str, str]:
    """``unavailable`` after the migration: the engine back in service when it runs (on
    either node), out until its node sees it again when it was lost."""
    if mig.outcome in (Outcome.MOVED, Outcome.STAYED):
        if cur.get(mig.engine) == op_id:
            cur.pop(mig.engine)
    elif mig.outcome is Outcome.LOST:
        cur[mig.engine] = r.lost_mark(op_id)
    return cur
