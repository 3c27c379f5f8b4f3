"""What a migration that ended while a node was away left on that node, put right when it is
back (its controller killed and started again, or cut off from etcd).

A source whose engine moved ends its stopped copy and gives the engine away; a source whose
engine did not move lets its tree go on and restores it; a target holding a copy of an engine
that did not come ends it and gives it back, and removes the image it received. Only each
engine's newest migration is looked at (an older one says nothing of where the engine is
now), once per life of the controller (the node calls ``settle`` every few rounds).
Neighbours: ``record`` (the records, local ids), ``procs``, ``local``, ``steps``
(``NodeMigration.settle`` calls it), the controller (``give_away``, ``status``).
"""

from __future__ import annotations

import logging

from ckpt_controller.errors import CkptError
from ckpt_controller.fleet import local
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.migration import procs
from ckpt_controller.fleet.migration.record import capture_op, local_ids
from ckpt_controller.vocab import CheckpointState, MigrationOutcome, MigrationStep, OperationKind

log = logging.getLogger("ckpt_controller.fleet")


def newest_per_engine(records: list[tuple[r.Migration, object]]) -> list[r.Migration]:
    """Of each engine's migrations, the newest only (the one whose record etcd made last,
    ``create_revision``; neither key order nor clocks): an older one that moved the engine
    away must not be settled after a newer one brought it back, nor instead of it."""
    newest: dict[str, tuple[int, r.Migration]] = {}
    for mig, kv in records:
        if mig.engine not in newest or kv.create_revision > newest[mig.engine][0]:
            newest[mig.engine] = (kv.create_revision, mig)
    return [mig for _, mig in newest.values()]


class Settler:
    def __init__(self, node, controller) -> None:
        self.node = node
        self.controller = controller
        self._settled: set[str] = set()  # migrations looked at

    def settle(self) -> None:
        me = self.node.fleet.node
        # (a damaged record is said by the coordinator, which cannot drive it either)
        for mig in newest_per_engine(
                r.read_all(self.node.etcd, self.node.keys.migrations, r.Migration, {})):
            if mig.outcome is MigrationOutcome.RUNNING or mig.op_id in self._settled:
                continue
            self._settled.add(mig.op_id)
            if me not in (mig.source, mig.target):
                continue
            try:
                if mig.target == me and mig.outcome is not MigrationOutcome.MOVED:
                    self._received(mig)
                if not self.controller.config.knows(mig.engine):
                    continue  # given away already, or never here
                if mig.source == me:
                    self._source(mig)
                else:
                    self._target(mig)
            except CkptError as err:  # policy: said; the operator sees the engine's state
                log.error("fleet: could not settle migration %s of %s here: %s", mig.op_id,
                          mig.engine, err)

    def _owner(self, engine: str) -> str | None:
        kv = self.node.etcd.get(self.node.keys.owner(engine))
        return kv.value.decode() if kv is not None else None

    def _source(self, mig: r.Migration) -> None:
        folder = self.node.config.image_dir / mig.engine / capture_op(mig.op_id, mig.engine)
        pid = procs.dumped_pid(folder)
        if self._owner(mig.engine) == mig.target:
            if pid is not None and procs.stopped(pid):
                procs.kill_stopped(pid)
            self.controller.give_away(mig.engine, op_id=mig.op_id, to=mig.target)
            self.node.owned.discard(mig.engine)
            log.info("fleet: %s moved to %s while this node was away (migration %s); its "
                     "stopped copy here is ended", mig.engine, mig.target, mig.op_id)
            return
        procs.continue_tree(folder, pid)
        view = self.controller.status([mig.engine]).engines[0]
        if view.status is not None and view.status.state == CheckpointState.PREPARED:
            local.run(self.controller, local_ids(mig.op_id, mig.engine)[MigrationStep.RESUME],
                      OperationKind.RESTORE, mig.engine, {})
            log.info("fleet: %s stayed here (migration %s %s while this node was away); "
                     "resumed", mig.engine, mig.op_id, mig.outcome)

    def _received(self, mig: r.Migration) -> None:
        """The image received for a migration that did not come here (its target's
        controller was down when it should have adopted or abandoned it): removed, as the
        abandon would have (real images are GiB)."""
        folder = self.node.config.image_dir / mig.engine / capture_op(mig.op_id, mig.engine)
        if not procs.remove_received(folder):
            return
        log.info("fleet: the image received for migration %s of %s, which did not come "
                 "here, is removed", mig.op_id, mig.engine)

    def _target(self, mig: r.Migration) -> None:
        if self._owner(mig.engine) == self.node.fleet.node:
            return  # it is this node's: the migration ended with it here
        view = self.controller.status([mig.engine]).engines[0]
        if view.status is not None and view.status.pid:
            procs.kill_stopped(view.status.pid)
        self.controller.give_away(mig.engine, op_id=mig.op_id, to=mig.source)
        log.info("fleet: %s did not come here (migration %s %s while this node was away); "
                 "the copy restored here is ended", mig.engine, mig.op_id, mig.outcome)
