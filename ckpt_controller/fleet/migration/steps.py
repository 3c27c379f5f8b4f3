"""A node's side of a migration: each step in its inbox run on a thread of its own (a dump or
a restore takes seconds), and its end written with ``record.write_end``.

Each step (``receive``, ``send``, ``adopt``, ``finish``, ``resume``, ``abandon``: the table in
the package's docstring) returns what happened (``Ended``: succeeded, or failed with why, and
what it found out for the next steps: the page server's address, the dumped PID, the engine's
state after a failed send). ``before_resume`` is what the controller's restore asks between
re-wake and re-admission on a node with ``[fleet]`` (through ``guard``): a migration's target
takes the engine over there, in one transaction that needs ``moving/<engine>`` to still name
the migration.
Neighbours: ``record``, ``procs``, ``settle``, ``local`` (node-local operations), the node
(``fleet.node``: its etcd, keys, owned engines), the controller (``adopt``, ``give_away``,
``record``, ``status``), ``criu_images`` (page server, the small files).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import shutil
import signal
import threading
import time
from pathlib import Path

from ckpt_controller import protocol as p
from ckpt_controller.controller import roster
from ckpt_controller.endpoints import resolve_host
from ckpt_controller.errors import CkptError, OperationError, UnreachableError, UsageError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import local
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.migration import procs, weights
from ckpt_controller.fleet.migration.fence import Fence
from ckpt_controller.fleet.migration.record import capture_op, local_ids, read, write_end
from ckpt_controller.fleet.migration.settle import Settler
from ckpt_controller.vocab import (
    CheckpointState,
    ImageTransport,
    MigrationStep,
    OperationKind,
    OutcomeStatus,
    PartStatus,
)

log = logging.getLogger("ckpt_controller.fleet")

Step = MigrationStep
#: the small image files go through etcd in values of at most this many bytes (etcd's
#: default request limit is 1.5 MiB)
CHUNK_BYTES = 512 * 1024
#: and at most this many bytes in all: more says to use the shared transport
MAX_SMALL_BYTES = 64 * CHUNK_BYTES
#: how often a take-over that could not reach etcd is tried again
TAKE_OVER_RETRY_S = 0.25


@dataclasses.dataclass
class Ended:
    """What a step did: ``error`` None when it succeeded; ``detail`` what it found out."""

    error: str | None = None
    detail: dict = dataclasses.field(default_factory=dict)


def failed(what: str, result, engine: str, **detail) -> Ended:
    """A node-local operation of the step did not succeed: the step fails, saying so, with
    the engine's state after it."""
    return Ended(f"{what} of {engine} {result.status}: {local.why(result, engine)}",
                 {"state": local.state_after(result, engine), **detail})


class NodeMigration:
    """Runs the migration steps a node's inbox holds (``run``)."""

    def __init__(self, node, controller) -> None:
        self.node = node
        self.controller = controller
        self.config = node.config
        self._page_servers: dict[str, object] = {}
        self._lock = threading.Lock()
        #: engines adopted here whose ``owners`` key still names their source: the node
        #: does not claim them (its take-over does, or the abandon gives them back)
        self.arriving: set[str] = set()
        #: engines sent from here whose migration has not ended here (finish or resume)
        self.leaving: set[str] = set()
        #: those of them being dumped here or dumped and left stopped (SIGSTOP, their whole
        #: tree): they answer nothing until finish ends them or resume continues them, so
        #: the node's rounds publish them without asking (``out_of_reach``: a round's status
        #: request sent as the dump froze the engine waited out its 2 s timeout, and the
        #: finish waiting in the inbox with it)
        self.stopped: set[str] = set()
        self.settler = Settler(node, controller)
        #: the copies restored here that a node cut off from etcd stops (``fence``)
        self.fence = Fence(node, controller, self.arriving)

    def out_of_reach(self, engine: str) -> p.EngineView:
        """How a node's round sees an engine in ``stopped``, without asking it: out of reach
        (its record keeps its endpoints, ``FleetNode.record``), held as the controller says."""
        eng = self.config.engine(engine)
        return p.EngineView(engine=engine, kind=eng.kind, control=eng.control, reachable=False,
                            holder=self.controller.admission.holders.get(engine))

    def settle(self) -> None:
        """What a migration that ended while this node was away left here, put right."""
        self.settler.settle()

    # ---------------------------------------------------------------- the inbox

    def run(self, task: r.Task, todo_rev: int, finished) -> None:
        threading.Thread(target=self._run, args=(task, todo_rev, finished),
                         name=f"migrate-{task.step}", daemon=True).start()

    def _run(self, task: r.Task, todo_rev: int, finished) -> None:
        step = task.step
        started = time.time()
        try:
            ended = self._steps[step](self, task)
        except Exception as exc:  # policy: a step's failure is its end; the coordinator
            # decides what comes next (a bug is logged with its trace and ends it too)
            if not isinstance(exc, CkptError):
                log.exception("fleet: migration step %s of %s failed", step, task.engine)
            ended = Ended(exc.message if isinstance(exc, CkptError) else repr(exc))
        end = r.StepEnd(step=step, node=self.node.fleet.node,
                        status=PartStatus.SUCCEEDED if ended.error is None else PartStatus.FAILED,
                        started=started, ended=time.time(),
                        error=None if ended.error is None else ended.error[:2000],
                        detail=ended.detail)
        try:
            written = write_end(self.node.etcd, self.node.keys, task, todo_rev, end)
            if not written and step is Step.SEND and ended.error is None:
                # the coordinator gave the step up meanwhile (this node was cut off longer
                # than its lease): the migration ended without it, so the engine, dumped
                # and stopped here, is resumed here
                log.warning("fleet: migration %s gave up its send while it ran; resuming %s "
                            "here", task.op_id, task.engine)
                back = self.resume(task, end.detail.get("pid"))
                if back.error is not None:
                    log.error("fleet: resuming %s here failed: %s", task.engine, back.error)
        except CkptError as err:  # policy: etcd away: the inbox keeps it; the step runs
            # again (its local operations answer with their first results)
            log.warning("fleet: could not write the end of migration step %s: %s", step, err)
        finally:
            finished(task.local_op)

    # ---------------------------------------------------------------- receive

    def _folder(self, task: r.Task) -> Path:
        return self.config.image_dir / task.engine / str(task.params["capture_op"])

    def receive(self, task: r.Task) -> Ended:
        from ckpt_controller import criu_images

        checked = self._weights_here(task)
        mig = self.config.migration
        folder = self._folder(task)
        if mig.image_transport == ImageTransport.SHARED:
            shared = mig.shared_dir / task.engine / task.op_id
            shared.mkdir(parents=True, exist_ok=True, mode=0o700)
            folder.parent.mkdir(parents=True, exist_ok=True)
            if not folder.is_symlink():
                _replace_with_link(folder, shared)
            return Ended(detail={"transport": ImageTransport.SHARED, "folder": str(shared),
                                 **checked})
        address = resolve_host(self._address())  # looked up again at each receive
        with self._lock:
            server = self._page_servers.get(task.op_id)
            if server is None:
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                server = criu_images.PageServer(criu_images.criu_path(), folder, address,
                                                port=mig.page_server_port)
                self._page_servers[task.op_id] = server
        return Ended(detail={"transport": ImageTransport.PAGE_SERVER,
                             "page_server": f"{address}:{server.port}", "folder": str(folder),
                             **checked})

    def _weights_here(self, task: r.Task) -> dict:
        """Before anything moves, when the source may prepare at level 2 (asked, or its
        node's default): the digest of each file the engine re-wakes from, as read here
        (``weights``); one this node cannot read fails the receive (``weights.read_all``)."""
        mig, _ = read(self.node.etcd, self.node.keys, task.op_id)
        level = task.params.get("level")
        if mig is None or not mig.reload_files or not (level is None or weights.reloads(level)):
            return {}
        return {"weights": weights.lines(weights.read_all(
            mig.reload_files, self.node.fleet.node, task.engine))}

    # ---------------------------------------------------------------- send

    def send(self, task: r.Task) -> Ended:
        try:
            ended = self._send(task)
        except BaseException:  # policy: not sent: the engine is this node's as before
            self.leaving.discard(task.engine)
            self.stopped.discard(task.engine)
            raise
        if ended.error is not None:
            self.leaving.discard(task.engine)
            self.stopped.discard(task.engine)
        return ended

    def _send(self, task: r.Task) -> Ended:
        mig, _ = read(self.node.etcd, self.node.keys, task.op_id)
        received = mig.detail(Step.RECEIVE)
        level = task.params.get("level")
        if level is None:
            level = self.config.prepare_defaults(task.engine).level
        if weights.reloads(level) and mig.reload_files:
            # the target must re-wake the very weights this engine holds: compared before
            # anything happens to the engine (a difference: it stays, untouched)
            try:
                weights.compare(mig.reload_files, received.get("weights") or [],
                                self.node.fleet.node, mig.target, task.engine)
            except OperationError as err:
                return Ended(err.message, {"state": CheckpointState.RUNNING})
        ids = local_ids(task.op_id, task.engine)
        eng = self.config.engine(task.engine)
        self.leaving.add(task.engine)
        prepared = local.run(self.controller, ids[OperationKind.PREPARE],
                             OperationKind.PREPARE, task.engine, task.params)
        if prepared.status != OutcomeStatus.SUCCEEDED:
            return failed("prepare", prepared, task.engine)
        folder = self._folder(task)
        hook_env = {"CKPT_CRIU_MODE": "leave-stopped"}
        if received.get("transport") == ImageTransport.SHARED:
            folder.parent.mkdir(parents=True, exist_ok=True)
            if not folder.is_symlink():
                _replace_with_link(folder, Path(str(received["folder"])))
        else:
            hook_env["CKPT_PAGE_SERVER"] = str(received["page_server"])
        before = self.controller.status([task.engine]).engines[0].status
        pid = before.pid if before is not None else None
        self.stopped.add(task.engine)  # from the dump on (a failed one: send() takes it out)
        captured = local.run(self.controller, ids[OperationKind.CAPTURE],
                             OperationKind.CAPTURE, task.engine, {}, hook_env=hook_env)
        if captured.status != OutcomeStatus.SUCCEEDED:
            end = failed("capture", captured, task.engine)
            end.detail = self._after_failed_capture(task.engine, pid, folder)
            return end
        if pid is None:
            pid = procs.dumped_pid(folder)
        try:
            detail = self._ship(task, folder, received, eng, pid,
                                before.generation if before is not None else None)
        except Exception as exc:  # policy: dumped and stopped here, but not sent: the
            # engine is resumed here before the step fails (the target never gets it)
            log.warning("fleet: migration %s of %s: the image could not be sent (%s); "
                        "resuming the engine here", task.op_id, task.engine, exc)
            try:
                state = CheckpointState.RUNNING if self.resume(task, pid).error is None else None
            except CkptError as err:  # policy: said with the step's failure
                log.error("fleet: resuming %s after a failed send failed: %s", task.engine,
                          err)
                state = None
            return Ended(exc.message if isinstance(exc, CkptError) else repr(exc),
                         {"state": state})
        return Ended(detail=detail)

    def _ship(self, task: r.Task, folder: Path, received: dict, eng, pid,
              generation) -> dict:
        """What the target needs besides the pages: the engine's configuration, and (page
        server) the image's small files, through etcd."""
        from ckpt_controller import criu_images

        # the engine's whole configuration (its control endpoint, kind, labels, defaults),
        # as a journal keeps an adopted one: the target adopts exactly this
        detail: dict = {"pid": pid, "generation": generation, "engine_config": base64.b64encode(
            roster.encode(eng, self.controller.config)).decode()}
        if received.get("transport") != ImageTransport.SHARED:
            data = criu_images.pack_small(folder)
            if len(data) > MAX_SMALL_BYTES:
                raise OperationError(f"the image's small files are {len(data)} bytes, more "
                                     f"than etcd should carry ({MAX_SMALL_BYTES}); use "
                                     "image_transport = \"shared\"", bytes=len(data))
            chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
            base = self.node.keys.images(task.op_id)
            for i, chunk in enumerate(chunks):
                self.node.etcd.put(f"{base}{i:04d}", chunk)
            detail.update(chunks=len(chunks), small_bytes=len(data))
        return detail

    def _after_failed_capture(self, engine: str, pid, folder: Path) -> dict:
        """Where the engine is after a failed capture: a dump that stopped it is undone
        (SIGCONT), then its state asked; a process that is gone is the engine dead."""
        if isinstance(pid, int) and pid > 0 and not procs.alive(pid):
            return {"state": None, "engine_died": True}
        procs.continue_tree(folder, pid)
        view = self.controller.status([engine]).engines[0]
        state = str(view.status.state) if view.status is not None else None
        died = state is None and isinstance(pid, int) and not procs.alive(pid)
        return {"state": state, "engine_died": died}

    # ---------------------------------------------------------------- adopt

    def adopt(self, task: r.Task) -> Ended:
        mig, _ = read(self.node.etcd, self.node.keys, task.op_id)
        received, sent = mig.detail(Step.RECEIVE), mig.detail(Step.SEND)
        folder = self._folder(task)
        if received.get("transport") != ImageTransport.SHARED:
            self._unpack(task, folder, sent)
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
                               op_id=str(task.params["capture_op"]), engine=task.engine)
        try:
            restored = local.run(self.controller,
                                 local_ids(task.op_id, task.engine)[OperationKind.RESTORE],
                                 OperationKind.RESTORE, task.engine,
                                 {"accept": task.params.get("accept") or []},
                                 hook_env={"CKPT_CRIU_BESIDE": "1"}, absent=True)
        finally:
            self.arriving.discard(task.engine)
        if restored.status == OutcomeStatus.SUCCEEDED:
            self._publish(task.engine)  # RUNNING here, now rather than at the next round
            return Ended(detail={"state": CheckpointState.RUNNING})
        why = local.why(restored, task.engine)
        if self._owner(task.engine) == self.node.fleet.node:
            # taken over, then failed before re-admission: the copy here is ended and the
            # engine handed back, so the source may resume it
            return failed("restore", restored, task.engine,
                          handed_back=self._hand_back(task, why))
        self._abandon_here(task, f"restore failed: {why}")
        return failed("restore", restored, task.engine)

    def _unpack(self, task: r.Task, folder: Path, sent: dict) -> None:
        """Page server: the server stopped (the pages are here), the small files read from
        etcd into the folder."""
        from ckpt_controller import criu_images

        with self._lock:
            server = self._page_servers.pop(task.op_id, None)
        if server is not None:
            server.wait(timeout_s=60)
        base = self.node.keys.images(task.op_id)
        data = b"".join(kv.value for kv in sorted(self.node.etcd.get_prefix(base),
                                                  key=lambda kv: kv.key))
        if len(data) != int(sent.get("small_bytes") or 0):
            raise OperationError(f"the image's small files arrived with {len(data)} "
                                 f"bytes, {sent.get('small_bytes')} were sent")
        criu_images.unpack_small(data, folder)

    def _hand_back(self, task: r.Task, why: str) -> bool:
        """The copy restored here ended (and seen gone), ``owners/<engine>`` given back to
        the source in a transaction that needs it to still name this node; whether both
        happened (else the engine stays this node's, as it is)."""
        k = self.node.keys
        me = self.node.fleet.node
        pid = procs.dumped_pid(self._folder(task), "criu-restored-pid")
        view = self.controller.status([task.engine]).engines[0]
        if view.status is not None and view.status.pid:
            pid = view.status.pid
        if pid is not None:
            procs.kill_stopped(pid)
            deadline = time.monotonic() + 10
            while procs.alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if procs.alive(pid):
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

    # ---------------------------------------------------------------- the take-over

    def before_resume(self, op_id: str, engine: str):
        """For a migration's restore on its target: take the engine over (``owners``) in
        one transaction that needs ``moving/<engine>`` to still name the migration. The same
        restore finished by recovery after this controller restarted (no adopt step runs
        now): resumed only if etcd names this node the engine's owner, since the source may
        have resumed it meanwhile."""
        for task in self.node.running_tasks():
            if task.step is Step.ADOPT and \
                    op_id == local_ids(task.op_id, task.engine)[OperationKind.RESTORE]:
                return lambda t=task: self._take_over(t.op_id, engine)
        adopted = self.controller.adopted_by(engine)
        if adopted is not None and op_id == local_ids(adopted, engine)[OperationKind.RESTORE]:
            return lambda: self._confirm_owner(adopted, engine)
        return None

    def _confirm_owner(self, op_id: str, engine: str) -> None:
        """Recovery's restore of an engine migration ``op_id`` brought: resumed only while
        etcd names this node its owner. Otherwise the copy restored here is killed at once,
        before the restore fails: on one host it maps the same shared memory (``/dev/shm``)
        as the source, which may run the engine again already, and a live copy beside it,
        even one never admitted, once broke the source's vLLM (its workers failed on a
        request id)."""
        me = self.node.fleet.node
        owner = self._owner(engine)  # etcd away: UnreachableError, and it is not resumed
        if owner != me:
            pid = procs.restored_pid(self.config.image_dir / engine / capture_op(op_id, engine))
            killed = pid is not None and bool(procs.signal_tree(pid, signal.SIGKILL))
            raise OperationError(f"{engine} came here by migration {op_id}, but etcd names "
                                 f"{owner} its owner: not resumed here"
                                 + (f"; the copy restored here (pid {pid}) is killed"
                                    if killed else ""), engine=engine, owner=owner)

    def _take_over(self, op_id: str, engine: str) -> None:
        """The take-over transaction, tried again while etcd is out of reach, for up to two
        lease TTLs: a blip shorter than the lease (the coordinator still counts this node
        up) must not abort the move; past that the coordinator has decided without this
        node, and the transaction's answer (or the fence) says so. Trying again is safe:
        it only ever succeeds while ``moving/<engine>`` names this migration."""
        k = self.node.keys
        me = self.node.fleet.node
        give_up = time.monotonic() + 2 * self.node.fleet.lease_ttl_s
        said = False
        while True:
            try:
                ok, _ = self.node.etcd.txn(
                    [e.compare_value(k.moving(engine), op_id)],
                    [e.put_op(k.owner(engine), me), e.delete_op(k.moving(engine))])
                break
            except UnreachableError as err:
                if time.monotonic() >= give_up:
                    raise
                if not said:
                    log.warning("fleet: the take-over of %s (migration %s) waits for etcd: "
                                "%s; trying again for up to %gs", engine, op_id, err.message,
                                2 * self.node.fleet.lease_ttl_s)
                    said = True
                time.sleep(TAKE_OVER_RETRY_S)
        if said:
            log.info("fleet: etcd answered the take-over of %s again", engine)
            if not ok and self._owner(engine) == me:
                ok = True  # an earlier try committed; its answer was lost
        if not ok:
            raise OperationError(f"migration {op_id} no longer lets {me} take {engine} over "
                                 "(the source resumes it)", engine=engine)
        self.node.owned.add(engine)
        self.node.conflicts.pop(engine, None)
        self.arriving.discard(engine)
        log.info("fleet: %s is now this node's (migration %s)", engine, op_id)
        # its record names this node from now on (the re-admission does not wait for it):
        # clients that watch it connect while the engine is re-admitted, and their kept
        # requests are answered the moment it runs
        threading.Thread(target=self._publish, args=(engine,), name=f"publish-{engine}",
                         daemon=True).start()

    def _publish(self, engine: str) -> None:
        """``engine``'s record written now rather than at the next round (up to
        ``publish_interval_s`` away)."""
        try:
            self.node.publish([engine])
        except CkptError as err:  # policy: the next round writes it
            log.warning("fleet: publishing %s after its take-over failed: %s", engine,
                        err.message)

    # ---------------------------------------------------------------- finish, resume, abandon

    def finish(self, task: r.Task) -> Ended:
        mig, _ = read(self.node.etcd, self.node.keys, task.op_id)
        killed = procs.kill_stopped(mig.detail(Step.SEND).get("pid"))
        self.controller.give_away(task.engine, op_id=task.op_id,
                                  to=str(task.params["target"]))
        self.node.owned.discard(task.engine)
        self.leaving.discard(task.engine)
        self.stopped.discard(task.engine)
        return Ended(detail={"killed": killed})

    def resume(self, task: r.Task, pid=None) -> Ended:
        if pid is None:
            mig, _ = read(self.node.etcd, self.node.keys, task.op_id)
            pid = mig.detail(Step.SEND).get("pid")
        procs.continue_tree(self._folder(task), pid)  # a dead engine: the restore says so
        self.leaving.discard(task.engine)
        self.stopped.discard(task.engine)
        self.node.conflicts.pop(task.engine, None)  # it is this node's again
        back = local.run(self.controller, local_ids(task.op_id, task.engine)[Step.RESUME],
                         OperationKind.RESTORE, task.engine, {})
        if back.status != OutcomeStatus.SUCCEEDED:
            return failed("restore", back, task.engine)
        return Ended(detail={"state": CheckpointState.RUNNING})

    def abandon(self, task: r.Task) -> Ended:
        self._abandon_here(task, "the send failed")
        return Ended()

    def _abandon_here(self, task: r.Task, why: str) -> None:
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
                    procs.kill_stopped(status.pid)
            except CkptError:  # policy: nothing restored here (or it is gone): nothing to end
                pass
            self.controller.give_away(task.engine, op_id=task.op_id,
                                      to=str(task.params["source"]))
        procs.remove_received(self._folder(task))
        log.info("fleet: migration %s of %s abandoned here: %s", task.op_id, task.engine, why)

    # ---------------------------------------------------------------- helpers

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

    #: each step's code, by its name
    _steps = {Step.RECEIVE: receive, Step.SEND: send, Step.ADOPT: adopt, Step.FINISH: finish,
              Step.RESUME: lambda self, task: self.resume(task), Step.ABANDON: abandon}


def _replace_with_link(folder: Path, to: Path) -> None:
    if folder.exists() and not folder.is_symlink():
        shutil.rmtree(folder)
    tmp = folder.with_name(f".{folder.name}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(to)
    tmp.replace(folder)
