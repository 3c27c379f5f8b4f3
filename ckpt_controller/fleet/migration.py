"""Migration: an engine moves from its node controller (the source) to another (the target)
with CRIU, and at every moment exactly one node owns it (``ckptctl fleet migrate``).

A migration is a fleet operation of kind ``migrate`` (``ops``) with one record of its own,
``migrations/<op>`` (``Migration``). The elected coordinator (``Driver``, called by
``ops.Coordinator``) drives it through steps, one at a time, each a ``Task`` in one node's
inbox; the node (``NodeMigration``, called by ``node.FleetNode``) runs it and writes its end
into ``migrations/<op>/steps/<step>`` (``StepEnd``) in the transaction that takes it out of
its inbox. Every step is idempotent: its node-local operations have ids made from the fleet
operation's, so a step tried again finds their first result in the node's journal.

=========  ======  ===========================================================================
step       node    what it does
=========  ======  ===========================================================================
receive    target  the image folder; ``page-server``: a ``criu page-server`` there
send       source  a node-local prepare, then a capture whose dump hooks dump with
                   ``CKPT_CRIU_MODE=leave-stopped`` (the dumped tree stays, stopped), into the
                   target's page server or the shared folder; the small image files through etcd
adopt      target  the image checked, the engine adopted (journaled), a node-local restore
                   (criu restore beside the stopped original, re-wake, bit-exact weights, golden
                   prompt); between re-wake and re-admission the target takes ``owners/<engine>``
                   in one transaction that needs ``moving/<engine>`` to still name this migration
finish     source  the stopped tree killed; the engine given away (journaled)
resume     source  (instead of finish, when the target did not take it) SIGCONT, and a
                   node-local restore: RUNNING on the source again
abandon    target  (after a failed send) the page server stopped, the folder removed
=========  ======  ===========================================================================

The coordinator resumes the source only after a transaction that deletes
``moving/<engine>`` while it still names this migration: from then on the target cannot take
the engine, and before it the source's copy is stopped. So the engine is RUNNING on at most
one node, and when a step fails or its node dies, on exactly one once the nodes are back
(``docs/fleet.md`` has the table of failure points and their outcomes).
Neighbours: ``ops`` (operations, tasks, ``unavailable``), ``node`` (runs the steps),
``etcd``, ``keys``; ``criu_images`` (page server, the small files); the controller through
``Controller.start``/``adopt``/``give_away``/``record``.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import msgspec

from ckpt_controller.controller import roster
from ckpt_controller.errors import (
    BusyError,
    CkptError,
    OperationError,
    UnreachableError,
    UsageError,
)
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet.keys import SCHEMA, Keys, Param, encode

log = logging.getLogger("ckpt_controller.fleet")

#: which node runs each step
RUNS_ON = {"receive": "target", "send": "source", "adopt": "target", "finish": "source",
           "resume": "source", "abandon": "target"}
#: the small image files go through etcd in values of at most this many bytes (etcd's
#: default request limit is 1.5 MiB)
CHUNK_BYTES = 512 * 1024
#: and at most this many bytes in all: more says to use the shared transport
MAX_SMALL_BYTES = 64 * CHUNK_BYTES


class StepEnd(msgspec.Struct, kw_only=True):
    """How a step ended, written by its node (or by the coordinator: ``lost``)."""

    step: str
    node: str
    #: succeeded, failed or lost (its node died while it ran)
    status: str
    started: float | None = None
    ended: float
    error: str | None = None
    #: what the step found out for the next ones (the page server's address, the image)
    detail: dict[str, Param] = {}


class Migration(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    op_id: str
    engine: str
    source: str
    target: str
    #: page-server or shared (the target's ``[migration] image_transport``, once received)
    transport: str | None = None
    #: the node-local prepare's parameters (drain mode, its timeout, level)
    params: dict[str, Param] = {}
    #: the step that runs now (``started``: in its node's inbox), or the one to start next
    step: str | None = None
    started: bool = False
    step_started: float | None = None
    #: the steps that ended, in order
    done: list[StepEnd] = []
    #: running, moved (RUNNING on the target), stayed (on the source), lost, failed
    outcome: str = "running"
    error: str | None = None

    def detail(self, name: str) -> dict:
        for end in reversed(self.done):
            if end.step == name and end.status == "succeeded":
                return end.detail
        return {}


_mig_dec = msgspec.json.Decoder(Migration)
_end_dec = msgspec.json.Decoder(StepEnd)


def keys_of(keys: Keys, op_id: str) -> dict[str, str]:
    """``migrations/<op>`` (the record; a range read of ``migrations/`` gets records only),
    ``migration-steps/<op>/<step>`` (``StepEnd``), ``migration-images/<op>/<n>`` (the small
    image files, while the migration runs)."""
    p = keys.prefix
    return {"record": f"{p}/migrations/{op_id}", "steps": f"{p}/migration-steps/{op_id}/",
            "image": f"{p}/migration-images/{op_id}/"}


def moving_key(keys: Keys, engine: str) -> str:
    """``moving/<engine>``: the migration whose target may take the engine over."""
    return f"{keys.prefix}/moving/{engine}"


def local_ids(op_id: str, engine: str) -> dict[str, str]:
    """The node-local operation ids of a migration's steps."""
    from ckpt_controller.fleet.ops import local_op_id

    base = local_op_id(op_id, engine)
    return {name: f"{base}.{name}" for name in ("prepare", "capture", "restore", "resume")}


def read(client: e.Etcd, keys: Keys, op_id: str) -> tuple[Migration | None, int]:
    kv = client.get(keys_of(keys, op_id)["record"])
    if kv is None:
        return None, 0
    return _mig_dec.decode(kv.value), kv.mod_revision


def submit(client: e.Etcd, keys: Keys, *, op_id: str, engine: str, to: str,
           params: dict):
    """Record a migration of ``engine`` to node ``to`` (or find the one with this id): the
    operation, its one part and the migration's record, in one transaction."""
    from ckpt_controller.fleet import ops as fops
    from ckpt_controller.fleet.keys import FleetOp, Part, decode_engine

    existing = fops.read_op(client, keys, op_id)
    if existing is not None:
        return fops._same(existing, "migrate", [engine])
    kv = client.get(keys.engine(engine))
    if kv is None:
        raise UsageError(f"{engine} is not registered in the fleet", engine=engine)
    record = decode_engine(kv.value)
    up = fops.live_nodes(client, keys)
    source = record.node
    if to == source:
        raise UsageError(f"{engine} is on {to} already", engine=engine, node=to)
    for node, what in ((source, "its node"), (to, "the target")):
        if node not in up:
            raise UnreachableError(f"{what} {node} is not registered in the fleet (down, or "
                                   "no such node)", node=node)
    held = client.get(keys.lock(engine))
    if held is not None:
        raise BusyError(f"{engine} is held by operation {held.value.decode()}",
                        engine=engine, holder=held.value.decode())
    if not record.reachable or record.state is None:
        # its node's last look found the agent silent: a busy or stalled engine as often as
        # a dead one, so retryable (exit 4), unlike an engine that says it is not RUNNING
        raise UnreachableError(f"{source} could not reach {engine} when it last looked; "
                               "nothing was started: try again once `ckptctl fleet status` "
                               "shows it running", engine=engine, node=source)
    if record.state != "running":
        raise UsageError(f"{engine} is {record.state} on {source}; only a RUNNING engine "
                         "migrates", engine=engine, state=record.state)
    op = FleetOp(op_id=op_id, kind="migrate", engines=[engine], params=params,
                 max_unavailable=1, created=time.time())
    part = Part(engine=engine, node=source, local_op=fops.local_op_id(op_id, engine))
    mig = Migration(op_id=op_id, engine=engine, source=source, target=to, params=params)
    ok, resp = client.txn([e.compare_created(keys.op(op_id))],
                          [e.put_op(keys_of(keys, op_id)["record"], encode(mig)),
                           e.put_op(keys.part(op_id, engine), encode(part)),
                           e.put_op(keys.op(op_id), encode(op))],
                          [e.get_op(keys.op(op_id))])
    if not ok:  # another caller made it first, with this id
        return fops._same(fops._op_dec.decode(resp[0]["kvs"][0].value), "migrate", [engine])
    return op


# ---------------------------------------------------------------- the coordinator's part

class Driver:
    """Moves each running migration one step further per ``drive``: a step that ended is
    written into the record with the step that comes next (``_after``), then that step is
    started (``_start``). Each write checks the record's revision, so a coordinator that dies
    between two leaves nothing half done, and the next one reads the same state."""

    def __init__(self, client: e.Etcd, keys: Keys) -> None:
        self.etcd = client
        self.keys = keys

    def drive(self, op, op_rev: int, nodes: dict) -> bool:
        mkeys = keys_of(self.keys, op.op_id)
        mig, rev = read(self.etcd, self.keys, op.op_id)
        if mig is None:
            raise KeyError(mkeys["record"])
        if mig.outcome != "running":
            return self._end(op, op_rev, mig)
        if not mig.started:
            return self._start(op, mig, rev, nodes)
        node = self._node(mig, mig.step)
        kv = self.etcd.get(mkeys["steps"] + mig.step)
        if kv is not None:
            try:
                end = _end_dec.decode(kv.value)
            except msgspec.DecodeError as err:  # policy: an end no one can read counts as
                # lost: the same safe rules then say where the engine goes
                log.error("fleet: migration %s: the end of its %s is damaged (%s); counted "
                          "as lost", op.op_id, mig.step, err)
                end = StepEnd(step=mig.step, node=node, status="lost",
                              started=mig.step_started, ended=time.time(),
                              error=f"the end {node} wrote is damaged")
        elif node not in nodes:
            end = StepEnd(step=mig.step, node=node, status="lost", started=mig.step_started,
                          ended=time.time(), error=f"node {node} was lost while the step ran")
        else:
            return False  # it runs
        return self._after(op, mig, rev, end)

    @staticmethod
    def _node(mig: Migration, step: str) -> str:
        return mig.source if RUNS_ON[step] == "source" else mig.target

    def _after(self, op, mig: Migration, rev: int, end: StepEnd) -> bool:
        """Write ``end`` into the record with what comes next: a step, or the outcome."""
        k = self.keys
        ok = end.status == "succeeded"
        nxt, outcome, error = None, "running", mig.error
        step = end.step
        transport = mig.transport
        if step == "receive":
            if not ok:
                outcome, error = "stayed", f"the target could not receive it: {end.error}"
            else:
                nxt, transport = "send", end.detail.get("transport")
        elif step == "send":
            if ok:
                nxt = "adopt"
            else:
                nxt, error = "abandon", f"the source could not send it: {end.error}"
        elif step == "adopt":
            if ok:
                nxt = "finish"
            else:
                # the target may have taken it over before it failed or died. First
                # ``moving`` goes (if the target has not taken it), so that from now on it
                # cannot; then ``owners`` is final and says where the engine is. Both steps
                # give the same answer however often a coordinator repeats them
                self.etcd.txn([e.compare_value(moving_key(k, mig.engine), op.op_id)],
                              [e.delete_op(moving_key(k, mig.engine))])
                owner = self.etcd.get(k.owner(mig.engine))
                if owner is None or owner.value.decode() != mig.target:
                    why = ("gave it back" if end.detail.get("handed_back")
                           else "did not take it")
                    nxt, error = "resume", f"the target {why}: {end.error}"
                else:  # the target holds it (lost after its take-over: it finishes there)
                    nxt, error = "finish", (f"the target took it over and then "
                                            f"{'was lost' if end.status == 'lost' else 'failed'}"
                                            f": {end.error}")
        elif step == "finish":
            outcome = "moved"
            if end.status == "lost":  # as when the source is down before the step starts
                error = _SOURCE_ENDS_IT.format(mig=mig)
            elif not ok:
                error = (f"RUNNING on {mig.target}; {mig.source} could not end its stopped "
                         f"copy: {end.error}")
        elif step == "resume":
            outcome = "stayed" if ok else "failed"
            if end.status == "lost":
                error = _SOURCE_RESUMES_IT.format(mig=mig)
            elif not ok:
                error = f"{mig.error}; resuming it on {mig.source} failed: {end.error}"
        elif step == "abandon":
            outcome = self._after_failed_send(mig)
        updated = msgspec.structs.replace(mig, step=nxt, step_started=None,
                                          done=[*mig.done, end], outcome=outcome, error=error,
                                          started=False, transport=transport)
        mkeys = keys_of(k, op.op_id)
        todo = k.todo(end.node, op.op_id, mig.engine)
        self.etcd.txn([e.compare_modified(mkeys["record"], rev)],
                      [e.put_op(mkeys["record"], encode(updated)),
                       e.delete_op(mkeys["steps"] + step), e.delete_op(todo)])
        log.info("fleet: migration %s of %s: %s on %s %s%s", op.op_id, mig.engine, step,
                 end.node, end.status, f": {end.error}" if end.error else "")
        return True

    def _after_failed_send(self, mig: Migration) -> str:
        """Where the engine is after a failed send: the source's own rules rolled it back
        (``stayed``), or the engine died in the dump (``lost``), or the source died (it
        settles the engine when it is back: ``failed``)."""
        send = next((d for d in reversed(mig.done) if d.step == "send"), None)
        if send is None or send.status == "lost":
            return "failed"
        if send.detail.get("engine_died"):
            return "lost"
        return "stayed" if send.detail.get("state") == "running" else "failed"

    def _start(self, op, mig: Migration, rev: int, nodes: dict) -> bool:
        """Start the step the record names (the first: receive), or end the migration when
        that step's node is down."""
        from ckpt_controller.fleet import ops as fops

        k = self.keys
        step = mig.step or "receive"
        node = self._node(mig, step)
        mkeys = keys_of(k, op.op_id)
        if node not in nodes:
            return self._node_down(mig, rev, step, node, mkeys)
        if step == "receive":  # out of service from now on, fleet-wide
            fops.update_unavailable(self.etcd, k, lambda cur: {mig.engine: op.op_id, **cur})
        now = time.time()
        task = fops.Task(op_id=op.op_id, kind=f"migrate-{step}", engine=mig.engine, node=node,
                         local_op=f"{fops.local_op_id(op.op_id, mig.engine)}.{step}",
                         params={**mig.params, "source": mig.source, "target": mig.target,
                                 "capture_op": local_ids(op.op_id, mig.engine)["capture"]},
                         started=now)
        started = msgspec.structs.replace(mig, step=step, step_started=now, started=True)
        writes = [e.put_op(mkeys["record"], encode(started)),
                  e.put_op(k.todo(node, op.op_id, mig.engine), encode(task))]
        if step == "receive":  # one operation on the engine across the fleet, and its place
            writes.append(e.put_op(k.lock(mig.engine), op.op_id))
        if step == "adopt":  # the target may take it over from now on, until resumed
            writes.append(e.put_op(moving_key(k, mig.engine), op.op_id))
        self.etcd.txn([e.compare_modified(mkeys["record"], rev)], writes)
        return True

    def _node_down(self, mig: Migration, rev: int, step: str, node: str, mkeys) -> bool:
        """The node of the step to start is down. A send or an adopt never starts: the
        target stops its page server (abandon), or the source, holding the engine stopped,
        resumes it. Otherwise the migration ends here, saying what the node does when it is
        back (``NodeMigration.settle``)."""
        instead = {"adopt": ("resume", f"the target {node} was down before it could adopt "
                             "it"),
                   "send": ("abandon", f"the source {node} was down before it could send "
                            "it")}.get(step)
        if instead is not None:
            updated = msgspec.structs.replace(
                mig, step=instead[0], started=False, step_started=None, error=instead[1],
                done=[*mig.done, StepEnd(step=step, node=node, status="lost",
                                         ended=time.time(), error=f"node {node} is down")])
        else:
            outcome, error = {
                "receive": ("stayed", f"the target {node} is down"),
                "abandon": (self._after_failed_send(mig), mig.error),
                "finish": ("moved", _SOURCE_ENDS_IT.format(mig=mig)),
                "resume": ("failed", _SOURCE_RESUMES_IT.format(mig=mig)),
            }[step]
            updated = msgspec.structs.replace(mig, step=None, started=False, outcome=outcome,
                                              error=error)
        self.etcd.txn([e.compare_modified(mkeys["record"], rev)],
                      [e.put_op(mkeys["record"], encode(updated))])
        return True

    def _end(self, op, op_rev: int, mig: Migration) -> bool:
        """The migration ended: its operation, its part, the engine's lock and place in
        ``unavailable`` follow; the small image files go."""
        from ckpt_controller.fleet import ops as fops

        k = self.keys
        mkeys = keys_of(k, op.op_id)
        now = time.time()
        moved = mig.outcome == "moved"
        node = mig.target if moved else mig.source
        part = fops.Part(engine=mig.engine, node=node,
                         local_op=fops.local_op_id(op.op_id, mig.engine),
                         status="succeeded" if moved else (
                             "lost" if mig.outcome == "lost" else "failed"),
                         state="running" if mig.outcome in ("moved", "stayed") else None,
                         error=mig.error, started=op.created, ended=now, settled=True)
        why = f"{mig.engine} {mig.outcome}" + (f": {mig.error}" if mig.error else "")
        ended = msgspec.structs.replace(op, status="succeeded" if moved else "failed",
                                        ended=now, error=None if moved else why[:2000])
        fops.update_unavailable(self.etcd, k, lambda cur: _settled(cur, mig, op.op_id))
        self.etcd.txn([e.compare_value(k.lock(mig.engine), op.op_id)],
                      [e.delete_op(k.lock(mig.engine))])
        self.etcd.txn([e.compare_value(moving_key(k, mig.engine), op.op_id)],
                      [e.delete_op(moving_key(k, mig.engine))])
        self.etcd.txn([e.compare_modified(k.op(op.op_id), op_rev)],
                      [e.put_op(k.op(op.op_id), encode(ended)),
                       e.put_op(k.part(op.op_id, mig.engine), encode(part)),
                       e.delete_op(mkeys["image"], e.prefix_end(mkeys["image"]))])
        log.info("fleet: migration %s of %s from %s to %s: %s", op.op_id, mig.engine,
                 mig.source, mig.target, mig.outcome)
        return True


#: what a migration says when its source is down for the last step (``NodeMigration.settle``
#: does it when the source is back), whether before that step started or while it ran
_SOURCE_ENDS_IT = ("RUNNING on {mig.target}; {mig.source} is down and ends its stopped copy "
                   "when it is back")
_SOURCE_RESUMES_IT = "{mig.error}; {mig.source} is down and resumes the engine when it is back"


def _settled(cur: dict[str, str], mig: Migration, op_id: str) -> dict[str, str]:
    if mig.outcome in ("moved", "stayed"):
        if cur.get(mig.engine) == op_id:
            cur.pop(mig.engine)
    elif mig.outcome == "lost":
        cur[mig.engine] = f"lost:{op_id}"
    return cur


# ---------------------------------------------------------------- the nodes' part

class NodeMigration:
    """Runs the migration steps a node's inbox holds: each on a thread of its own (a dump or
    a restore takes seconds), its end written with ``write_end``."""

    def __init__(self, node, controller) -> None:
        self.node = node
        self.controller = controller
        self.config = node.config
        self._page_servers: dict[str, object] = {}
        self._lock = threading.Lock()
        self._settled: set[str] = set()  # migrations ``settle`` looked at
        #: engines adopted here whose ``owners`` key still names their source: the node
        #: does not claim them (its take-over does, or the abandon gives them back)
        self.arriving: set[str] = set()
        #: engines sent from here whose migration has not ended here (finish or resume)
        self.leaving: set[str] = set()

    # -- after this node was away

    def settle(self) -> None:
        """What a migration that ended while this node was away (its controller killed and
        started again, or cut off from etcd) left here is put right: a source whose engine
        moved ends its stopped copy and gives the engine away; a source whose engine did not
        move resumes it; a target that adopted an engine that did not come ends its copy and
        gives it back. Each ended migration is looked at once per life of the controller."""
        me = self.node.fleet.node
        for kv in self.node.etcd.get_prefix(f"{self.node.keys.prefix}/migrations/"):
            try:
                mig = _mig_dec.decode(kv.value)
            except msgspec.DecodeError:  # policy: not a migration: the coordinator says so
                continue
            if mig.outcome == "running" or mig.op_id in self._settled:
                continue
            self._settled.add(mig.op_id)
            if me not in (mig.source, mig.target):
                continue
            if not self.controller.config.knows(mig.engine):
                continue  # given away already, or never here
            try:
                if mig.source == me:
                    self._settle_source(mig)
                else:
                    self._settle_target(mig)
            except CkptError as err:  # policy: said; the operator sees the engine's state
                log.error("fleet: could not settle migration %s of %s here: %s", mig.op_id,
                          mig.engine, err)

    def _settle_source(self, mig: Migration) -> None:
        owner = self.node.etcd.get(self.node.keys.owner(mig.engine))
        folder = self.config.image_dir / mig.engine / local_ids(mig.op_id, mig.engine)["capture"]
        pid = _dumped_pid(folder)
        if owner is not None and owner.value.decode() == mig.target:
            if pid is not None and _stopped(pid):
                _kill_stopped(pid)
            self.controller.give_away(mig.engine, op_id=mig.op_id, to=mig.target)
            self.node.owned.discard(mig.engine)
            log.info("fleet: %s moved to %s while this node was away (migration %s); its "
                     "stopped copy here is ended", mig.engine, mig.target, mig.op_id)
            return
        _continue(folder, pid)
        view = self.controller.status([mig.engine]).engines[0]
        if view.status is not None and str(view.status.state) == "prepared":
            self._local(local_ids(mig.op_id, mig.engine)["resume"], "restore", mig.engine, {})
            log.info("fleet: %s stayed here (migration %s %s while this node was away); "
                     "resumed", mig.engine, mig.op_id, mig.outcome)

    def _settle_target(self, mig: Migration) -> None:
        owner = self.node.etcd.get(self.node.keys.owner(mig.engine))
        if owner is not None and owner.value.decode() == self.node.fleet.node:
            return  # it is this node's: the migration ended with it here
        view = self.controller.status([mig.engine]).engines[0]
        if view.status is not None and view.status.pid:
            _kill_stopped(view.status.pid)
        self.controller.give_away(mig.engine, op_id=mig.op_id, to=mig.source)
        log.info("fleet: %s did not come here (migration %s %s while this node was away); "
                 "the copy restored here is ended", mig.engine, mig.op_id, mig.outcome)

    # -- the inbox

    def run(self, task, todo_rev: int, finished) -> None:
        threading.Thread(target=self._run, args=(task, todo_rev, finished),
                         name=f"migrate-{task.kind}", daemon=True).start()

    def _run(self, task, todo_rev: int, finished) -> None:
        step = task.kind.removeprefix("migrate-")
        started = time.time()
        try:
            detail = getattr(self, step)(task)
            end = StepEnd(step=step, node=self.node.fleet.node, status="succeeded",
                          started=started, ended=time.time(), detail=detail or {})
        except Exception as exc:  # policy: a step's failure is its end; the coordinator
            # decides what comes next (a bug is logged with its trace and ends it too)
            if not isinstance(exc, CkptError):
                log.exception("fleet: migration step %s of %s failed", step, task.engine)
            detail = getattr(exc, "step_detail", {})
            message = exc.message if isinstance(exc, CkptError) else repr(exc)
            end = StepEnd(step=step, node=self.node.fleet.node, status="failed",
                          started=started, ended=time.time(), error=message[:2000],
                          detail=detail)
        try:
            if not self.write_end(task, todo_rev, end) and step == "send" \
                    and end.status == "succeeded":
                # the coordinator gave the step up meanwhile (this node was cut off longer
                # than its lease): the migration ended without it, so the engine, dumped
                # and stopped here, is resumed here
                log.warning("fleet: migration %s gave up its send while it ran; resuming %s "
                            "here", task.op_id, task.engine)
                self.resume(task, end.detail.get("pid"))
        except CkptError as err:  # policy: etcd away: the inbox keeps it; the step runs
            # again (its local operations answer with their first results)
            log.warning("fleet: could not write the end of migration step %s: %s", step, err)
        finally:
            finished(task.local_op)

    def write_end(self, task, todo_rev: int, end: StepEnd) -> bool:
        """The step's end, while its task is still in the inbox (else False: given up)."""
        k = self.node.keys
        todo = k.todo(task.node, task.op_id, task.engine)
        ok, _ = self.node.etcd.txn(
            [e.compare_created(todo, todo_rev)],
            [e.put_op(keys_of(k, task.op_id)["steps"] + end.step, encode(end)),
             e.delete_op(todo)])
        return ok

    # -- the steps

    def _folder(self, task) -> Path:
        return self.config.image_dir / task.engine / task.params["capture_op"]

    def receive(self, task) -> dict:
        from ckpt_controller import criu_images

        mig = self.config.migration
        folder = self._folder(task)
        if mig.image_transport == "shared":
            shared = mig.shared_dir / task.engine / task.op_id
            shared.mkdir(parents=True, exist_ok=True, mode=0o700)
            folder.parent.mkdir(parents=True, exist_ok=True)
            if not folder.is_symlink():
                _replace_with_link(folder, shared)
            return {"transport": "shared", "folder": str(shared)}
        address = self._address()
        with self._lock:
            server = self._page_servers.get(task.op_id)
            if server is None:
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                server = criu_images.PageServer(criu_images.criu_path(), folder, address,
                                                port=mig.page_server_port)
                self._page_servers[task.op_id] = server
        return {"transport": "page-server", "page_server": f"{address}:{server.port}",
                "folder": str(folder)}

    def send(self, task) -> dict:
        try:
            return self._send(task)
        except BaseException:  # policy: not sent: the engine is this node's as before
            self.leaving.discard(task.engine)
            raise

    def _send(self, task) -> dict:
        mig, _ = read(self.node.etcd, self.node.keys, task.op_id)
        received = mig.detail("receive")
        ids = local_ids(task.op_id, task.engine)
        eng = self.config.engine(task.engine)
        self.leaving.add(task.engine)
        prepared = self._local(ids["prepare"], "prepare", task.engine, task.params)
        if prepared.status != "succeeded":
            raise _failed("prepare", prepared, task.engine)
        folder = self._folder(task)
        hook_env = {"CKPT_CRIU_MODE": "leave-stopped"}
        if received.get("transport") == "shared":
            folder.parent.mkdir(parents=True, exist_ok=True)
            if not folder.is_symlink():
                _replace_with_link(folder, Path(str(received["folder"])))
        else:
            hook_env["CKPT_PAGE_SERVER"] = str(received["page_server"])
        before = self.controller.status([task.engine]).engines[0].status
        pid = before.pid if before is not None else None
        captured = self._local(ids["capture"], "capture", task.engine, {}, hook_env=hook_env)
        if captured.status != "succeeded":
            err = _failed("capture", captured, task.engine)
            err.step_detail = self._after_failed_capture(task.engine, pid,
                                                         task.params["capture_op"])
            raise err
        if pid is None:
            pid = _dumped_pid(folder)
        try:
            return self._ship(task, folder, received, eng, pid,
                              before.generation if before is not None else None)
        except Exception as exc:  # policy: dumped and stopped here, but not sent: the
            # engine is resumed here before the step fails (the target never gets it)
            log.warning("fleet: migration %s of %s: the image could not be sent (%s); "
                        "resuming the engine here", task.op_id, task.engine, exc)
            try:
                self.resume(task, pid)
                state = "running"
            except CkptError as err:  # policy: said with the step's failure
                log.error("fleet: resuming %s after a failed send failed: %s", task.engine,
                          err)
                state = None
            failed = exc if isinstance(exc, CkptError) else OperationError(repr(exc))
            failed.step_detail = {"state": state}
            raise failed from None

    def _ship(self, task, folder: Path, received: dict, eng, pid, generation) -> dict:
        """What the target needs besides the pages: the engine's configuration, and (page
        server) the image's small files, through etcd."""
        from ckpt_controller import criu_images

        # the engine's whole configuration (its control endpoint, kind, labels, defaults),
        # as a journal keeps an adopted one: the target adopts exactly this
        detail: dict = {"pid": pid, "generation": generation, "engine_config": base64.b64encode(
            roster.encode(eng, self.controller.config)).decode()}
        if received.get("transport") != "shared":
            data = criu_images.pack_small(folder)
            if len(data) > MAX_SMALL_BYTES:
                raise OperationError(f"the image's small files are {len(data)} bytes, more "
                                     f"than etcd should carry ({MAX_SMALL_BYTES}); use "
                                     "image_transport = \"shared\"", bytes=len(data))
            chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
            base = keys_of(self.node.keys, task.op_id)["image"]
            for i, chunk in enumerate(chunks):
                self.node.etcd.put(f"{base}{i:04d}", chunk)
            detail.update(chunks=len(chunks), small_bytes=len(data))
        return detail

    def _after_failed_capture(self, engine: str, pid, capture_op: str) -> dict:
        """Where the engine is after a failed capture: a dump that stopped it is undone
        (SIGCONT), then its state asked; a process that is gone is the engine dead."""
        if isinstance(pid, int) and pid > 0 and not _alive(pid):
            return {"state": None, "engine_died": True}
        _continue(self.config.image_dir / engine / capture_op, pid)
        view = self.controller.status([engine]).engines[0]
        state = str(view.status.state) if view.status is not None else None
        died = state is None and isinstance(pid, int) and not _alive(pid)
        return {"state": state, "engine_died": died}

    def adopt(self, task) -> dict:
        from ckpt_controller import criu_images

        k = self.node.keys
        mig, _ = read(self.node.etcd, k, task.op_id)
        received, sent = mig.detail("receive"), mig.detail("send")
        folder = self._folder(task)
        if received.get("transport") != "shared":
            with self._lock:
                server = self._page_servers.pop(task.op_id, None)
            if server is not None:
                server.wait(timeout_s=60)
            base = keys_of(k, task.op_id)["image"]
            data = b"".join(kv.value for kv in sorted(self.node.etcd.get_prefix(base),
                                                      key=lambda kv: kv.key))
            if len(data) != int(sent.get("small_bytes") or 0):
                raise OperationError(f"the image's small files arrived with {len(data)} "
                                     f"bytes, {sent.get('small_bytes')} were sent")
            criu_images.unpack_small(data, folder)
        engine = roster.decode(base64.b64decode(str(sent["engine_config"])),
                               self.controller.config,
                               {"migration": task.op_id, "engine": task.engine})
        engine = dataclasses.replace(engine, control=self._control(engine.control))
        self.arriving.add(task.engine)
        self.controller.adopt(engine, op_id=task.op_id, origin=str(task.params["source"]))
        # the image it received, as if captured here: the restore finds it in the journal
        self.controller.record("capture", {"dumped": True, "image_dir": str(folder),
                                           "generation": sent.get("generation"),
                                           "received_from": task.params["source"],
                                           "migration": task.op_id},
                               op_id=task.params["capture_op"], engine=task.engine)
        ids = local_ids(task.op_id, task.engine)
        try:
            restored = self._local(ids["restore"], "restore", task.engine, {},
                                   hook_env={"CKPT_CRIU_BESIDE": "1"})
        finally:
            self.arriving.discard(task.engine)
        if restored.status != "succeeded":
            why = _why(restored, task.engine)
            err = _failed("restore", restored, task.engine)
            if self._owner(task.engine) == self.node.fleet.node:
                # taken over, then failed before re-admission: the copy here is ended and
                # the engine handed back, so the source may resume it
                err.step_detail["handed_back"] = self._hand_back(task, why)
            else:
                self._abandon_here(task, f"restore failed: {why}")
            raise err
        return {"state": "running"}

    def _hand_back(self, task, why: str) -> bool:
        """The copy restored here ended (and seen gone), ``owners/<engine>`` given back to
        the source in a transaction that needs it to still name this node; whether both
        happened (else the engine stays this node's, as it is)."""
        k = self.node.keys
        me = self.node.fleet.node
        pid = _dumped_pid(self._folder(task), "criu-restored-pid")
        view = self.controller.status([task.engine]).engines[0]
        if view.status is not None and view.status.pid:
            pid = view.status.pid
        if pid is not None:
            _kill_stopped(pid)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                log.error("fleet: the copy of %s restored here (pid %d) did not end; it stays "
                          "this node's", task.engine, pid)
                return False
        ok, _ = self.node.etcd.txn([e.compare_value(k.owner(task.engine), me)],
                                   [e.put_op(k.owner(task.engine), str(task.params["source"]))])
        if not ok:
            return False
        self.node.owned.discard(task.engine)
        self._abandon_here(task, f"restore failed after the take-over: {why}")
        return True

    def _owner(self, engine: str) -> str | None:
        kv = self.node.etcd.get(self.node.keys.owner(engine))
        return kv.value.decode() if kv is not None else None

    def before_resume(self, op_id: str, engine: str):
        """For a migration's restore on its target: take the engine over (``owners``) in
        one transaction that needs ``moving/<engine>`` to still name the migration. The same
        restore finished by recovery after this controller restarted (no adopt step runs
        now): resumed only if etcd names this node the engine's owner, since the source may
        have resumed it meanwhile."""
        for task_op, ids in self._restoring():
            if ids == op_id and task_op is not None:
                return lambda: self._take_over(task_op, engine)
        adopted = self.controller.adopted_by(engine)
        if adopted is not None and op_id == local_ids(adopted, engine)["restore"]:
            return lambda: self._confirm_owner(adopted, engine)
        return None

    def _confirm_owner(self, op_id: str, engine: str) -> None:
        me = self.node.fleet.node
        owner = self._owner(engine)  # etcd away: UnreachableError, and it is not resumed
        if owner != me:
            raise OperationError(f"{engine} came here by migration {op_id}, but etcd names "
                                 f"{owner} its owner: not resumed here", engine=engine,
                                 owner=owner)

    def _restoring(self):
        with self.node._running_lock:
            tasks = [t for t, _ in self.node._running.values()]
        for task in tasks:
            if task.kind == "migrate-adopt":
                yield task.op_id, local_ids(task.op_id, task.engine)["restore"]

    def _take_over(self, op_id: str, engine: str) -> None:
        k = self.node.keys
        me = self.node.fleet.node
        ok, _ = self.node.etcd.txn(
            [e.compare_value(moving_key(k, engine), op_id)],
            [e.put_op(k.owner(engine), me), e.delete_op(moving_key(k, engine))])
        if not ok:
            raise OperationError(f"migration {op_id} no longer lets {me} take {engine} over "
                                 "(the source resumes it)", engine=engine)
        self.node.owned.add(engine)
        self.node.conflicts.pop(engine, None)
        self.arriving.discard(engine)
        log.info("fleet: %s is now this node's (migration %s)", engine, op_id)

    def finish(self, task) -> dict:
        mig, _ = read(self.node.etcd, self.node.keys, task.op_id)
        pid = mig.detail("send").get("pid")
        killed = _kill_stopped(pid)
        self.controller.give_away(task.engine, op_id=task.op_id,
                                  to=str(task.params["target"]))
        self.node.owned.discard(task.engine)
        self.leaving.discard(task.engine)
        return {"killed": killed}

    def resume(self, task, pid=None) -> dict:
        if pid is None:
            mig, _ = read(self.node.etcd, self.node.keys, task.op_id)
            pid = mig.detail("send").get("pid")
        _continue(self._folder(task), pid)  # a dead engine: the restore says so
        ids = local_ids(task.op_id, task.engine)
        self.leaving.discard(task.engine)
        self.node.conflicts.pop(task.engine, None)  # it is this node's again
        back = self._local(ids["resume"], "restore", task.engine, {})
        if back.status != "succeeded":
            raise _failed("restore", back, task.engine)
        return {"state": "running"}

    def abandon(self, task) -> dict:
        self._abandon_here(task, "the send failed")
        return {}

    def _abandon_here(self, task, why: str) -> None:
        """Nothing of the migration stays here: the page server stopped, a copy restored
        here ended and given back to the source, the received image removed."""
        with self._lock:
            server = self._page_servers.pop(task.op_id, None)
        if server is not None:
            server.stop()
        if self.controller.config.knows(task.engine):
            try:
                status = self.controller.status([task.engine]).engines[0].status
                if status is not None and status.pid:
                    _kill_stopped(status.pid)
            except CkptError:  # policy: nothing restored here (or it is gone): nothing to end
                pass
            self.controller.give_away(task.engine, op_id=task.op_id,
                                      to=str(task.params["source"]))
        folder = self._folder(task)
        if folder.is_symlink():
            folder.unlink()
        elif folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        log.info("fleet: migration %s of %s abandoned here: %s", task.op_id, task.engine, why)

    # -- helpers

    def _address(self) -> str:
        address = getattr(self.node.fleet, "address", None)
        if not address:
            raise UsageError("the page-server transport needs this node's [fleet] address "
                             "(where the source's criu reaches its page server)")
        return address

    def _control(self, control: str) -> str:
        """The engine's control endpoint on this node: a wildcard or loopback host stays
        (the engine listens on the same port here); another address becomes this node's."""
        proto, _, rest = control.partition("://")
        host, _, port = rest.rpartition(":")
        if proto != "tcp" or host in ("0.0.0.0", "*", "127.0.0.1", "localhost", "[::]"):
            return control
        return f"tcp://{self._address()}:{port}"

    def _local(self, op_id: str, kind: str, engine: str, params: dict,
               hook_env: dict | None = None):
        """Run a node-local operation to its end (its result; an id run before answers with
        its first result)."""
        from ckpt_controller import protocol as p

        fields = {k: v for k, v in params.items()
                  if k in ("drain", "drain_timeout_s", "on_deadline", "level", "deadline_s")}
        cmd = msgspec.convert(dict(fields, call_id=0, op_id=op_id, kind=kind, engines=[engine],
                                   hook_env=hook_env or {}), p.OperationCommand)
        done = threading.Event()
        box: list = []

        def finished(result) -> None:
            box.append(result)
            done.set()

        self.controller.start(cmd, finished)
        done.wait()
        result = box[0]
        if isinstance(result, CkptError):
            raise result
        return result


def _failed(what: str, result, engine: str) -> OperationError:
    err = OperationError(f"{what} of {engine} {result.status}: {_why(result, engine)}")
    outcome = next((o for o in result.engines if o.engine == engine), None)
    state = str(outcome.state) if outcome is not None and outcome.state else None
    err.step_detail = {"state": state}
    return err


def _why(result, engine: str) -> str:
    outcome = next((o for o in result.engines if o.engine == engine), None)
    if outcome is not None and outcome.error is not None:
        return outcome.error.message
    return result.error.message if result.error else str(result.status)


def _replace_with_link(folder: Path, to: Path) -> None:
    if folder.exists() and not folder.is_symlink():
        shutil.rmtree(folder)
    tmp = folder.with_name(f".{folder.name}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(to)
    tmp.replace(folder)


def _kill_stopped(pid) -> bool:
    """End the dumped tree the source kept stopped (its root: the PID namespace's init)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:  # policy: gone already
        return False


def _dumped_pid(folder: Path, name: str = "criu-pid") -> int | None:
    """The PID the criu-dump hook dumped into ``folder`` (``criu-pid``), or the one the
    criu-restore hook restored (``criu-restored-pid``), if there is one."""
    try:
        return int((folder / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):  # policy: no dump there
        return None


def _continue(folder: Path, pid) -> None:
    """SIGCONT to every process of the tree a dump with leave-stopped left stopped: the ones
    the criu-dump hook listed (``criu-pids``), and ``pid``."""
    pids = set()
    try:
        pids.update(int(word) for word in (folder / "criu-pids").read_text().split())
    except (OSError, ValueError):  # policy: no list (no dump got that far): the root only
        pass
    if isinstance(pid, int) and pid > 0:
        pids.add(pid)
    for each in sorted(pids):
        if _stopped(each):
            try:
                os.kill(each, signal.SIGCONT)
            except ProcessLookupError:  # policy: ended meanwhile
                continue


def _stopped(pid: int) -> bool:
    """The process exists and is stopped (the state a dump with leave-stopped leaves)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:  # policy: no such process
        return False


def _alive(pid: int) -> bool:
    """The process exists and is no zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # policy: no such process
        return False
