"""A target cut off from etcd fences the copy it restored but does not own.

While a migration adopts an engine, the target's restored copy is the engine only once the
target took it over (``owners/<engine>``, in the take-over transaction). A target that loses
etcd before that cannot know whether the coordinator has given up the move and resumed the
source: its copy, re-woken and answering its control endpoint, must not live on beside the
source for the whole partition. So once the node has heard nothing from etcd for one lease
TTL (its lease has expired there: the coordinator counts its step lost), every copy it holds
uncertainly is stopped (SIGSTOP to its process tree; ``cut_off``, from the lease thread), and
when etcd answers again (``in_touch``, each round) etcd decides: the node owns the engine, so
the copy goes on (SIGCONT); or the migration has ended without it (the source runs it), so
the copy is killed and the engine given back. Each step is logged and journaled
(``fenced``, with the migration's restore operation here: ``stopped``, ``continued``,
``killed``).

A copy held uncertainly: an engine a migration adopted here, not owned by this node as far as
it knows, that is not RUNNING (a restore reaches RUNNING only through the take-over, or
through recovery's check of ``owners``), with no operation on it since the migration's own.
Neighbours: ``steps`` (``NodeMigration``: ``arriving``), ``procs``, ``record``, the node
(``fleet.node``: its lease thread, ``owned``), the controller (``adopted_by``, ``last_op``,
``status``, ``record``, ``give_away``).
"""

from __future__ import annotations

import logging
import signal
import threading

from ckpt_controller.errors import BusyError, CkptError, described
from ckpt_controller.fleet.migration import procs
from ckpt_controller.fleet.migration.record import capture_op, local_ids, read
from ckpt_controller.vocab import CheckpointState, MigrationOutcome, OperationKind

log = logging.getLogger("ckpt_controller.fleet")


class Fence:
    """The copies this node stopped while cut off from etcd (``fenced``: engine ->
    (migration, pid)), and the rules that stop, continue or end them."""

    def __init__(self, node, controller, arriving: set[str]) -> None:
        self.node = node
        self.controller = controller
        self.arriving = arriving
        self.fenced: dict[str, tuple[str, int]] = {}
        self.killed: set[str] = set()  # fenced, killed, not yet given back
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- which copies

    def uncertain(self) -> dict[str, str]:
        """The copies held uncertainly now: engine -> the migration that adopted it."""
        out = {}
        for eng in self.controller.config.engines:
            name = eng.name
            mig = self.controller.adopted_by(name)
            if mig is None or name in self.node.owned or name in self.fenced:
                continue
            if name not in self.arriving:
                restore = local_ids(mig, name)[OperationKind.RESTORE]
                if self.controller.last_op(name) not in (None, restore):
                    continue  # an operation since the migration's: the engine was ours
                try:
                    view = self.controller.status([name]).engines[0].status
                except CkptError:  # policy: given away meanwhile: not here to fence
                    continue
                if view is not None and view.state == CheckpointState.RUNNING:
                    continue  # RUNNING only through the take-over: ours
            out[name] = mig
        return out

    def _pid(self, engine: str, mig: str) -> int | None:
        pid = procs.restored_pid(self.node.config.image_dir / engine / capture_op(mig, engine))
        if pid is None or not procs.alive(pid):
            try:
                view = self.controller.status([engine]).engines[0].status
            except CkptError:  # policy: no answer: the hook's PID or nothing
                view = None
            if view is not None and view.pid:
                pid = view.pid
        return pid if pid is not None and procs.alive(pid) else None

    # ---------------------------------------------------------------- cut off

    def cut_off(self, silent_s: float) -> None:
        """No word from etcd for ``silent_s`` (at least one lease TTL): every copy held
        uncertainly stopped, said. (On the fence's own thread: a failure is logged, and
        the next look, half a second later, tries again.)"""
        try:
            self._cut_off(silent_s)
        except Exception:  # policy: a bug here must not end the lease thread's fencing
            log.exception("fleet: fencing the copies held uncertainly failed")

    def _cut_off(self, silent_s: float) -> None:
        with self._lock:
            for engine, mig in self.uncertain().items():
                pid = self._pid(engine, mig)
                if pid is None:
                    continue  # nothing restored yet (or gone): looked at again next time
                stopped = procs.signal_tree(pid, signal.SIGSTOP)
                if not stopped:
                    continue
                self.fenced[engine] = (mig, pid)
                log.error("fleet: no word from etcd for %.1f s (past this node's lease): "
                          "the copy of %s restored here by migration %s is not this node's "
                          "as far as it knows; stopped (pid %d, %d processes) until etcd "
                          "says where %s runs", silent_s, engine, mig, pid, len(stopped),
                          engine)
                self._journal(engine, mig, "stopped", pid=pid, silent_s=round(silent_s, 1))

    # ---------------------------------------------------------------- in touch again

    def in_touch(self) -> None:
        """etcd answers: each stopped copy continued (this node owns the engine) or ended
        and the engine given back (its migration ended without it); one whose migration
        still runs stays stopped until the coordinator decides."""
        with self._lock:
            for engine, (mig, pid) in list(self.fenced.items()):
                try:
                    self._decide(engine, mig, pid)
                except BusyError as err:  # policy: an operation still holds it (its
                    # restore, failing now): given back next round
                    log.info("fleet: %s: %s; given back later", engine, err.message)
                except CkptError as err:  # policy: etcd away again: next round
                    log.warning("fleet: could not settle the stopped copy of %s: %s",
                                engine, err.message)

    def _decide(self, engine: str, mig: str, pid: int) -> None:
        k = self.node.keys
        me = self.node.fleet.node
        kv = self.node.etcd.get(k.owner(engine))
        owner = kv.value.decode() if kv is not None else None
        if owner == me:
            procs.signal_tree(pid, signal.SIGCONT)
            self.node.owned.add(engine)
            del self.fenced[engine]
            log.warning("fleet: etcd names this node the owner of %s: its copy (pid %d) goes "
                        "on", engine, pid)
            self._journal(engine, mig, "continued", pid=pid)
            return
        record, _ = read(self.node.etcd, k, mig)
        if record is not None and record.outcome is MigrationOutcome.RUNNING:
            return  # the coordinator has not decided yet: stays stopped
        source = record.source if record is not None else owner
        if engine not in self.killed and procs.signal_tree(pid, signal.SIGKILL):
            log.warning("fleet: migration %s ended without this node (%s; %s owns %s): the "
                        "copy restored here (pid %d) is killed", mig,
                        record.outcome if record is not None else "its record gone", owner,
                        engine, pid)
            self._journal(engine, mig, "killed", pid=pid, owner=owner)
        self.killed.add(engine)
        if self.controller.config.knows(engine):
            self.controller.give_away(engine, op_id=mig, to=str(source))
        del self.fenced[engine]
        self.killed.discard(engine)

    def _journal(self, engine: str, mig: str, action: str, **data) -> None:
        try:
            # with the migration's restore here: ``history`` shows it beside that operation
            self.controller.record("fenced", {"action": action, "migration": mig, **data},
                                   op_id=local_ids(mig, engine)[OperationKind.RESTORE],
                                   engine=engine)
        except Exception as exc:  # policy: the log line says it; the fence holds anyway
            log.error("fleet: could not journal the fence of %s: %s", engine, described(exc))
