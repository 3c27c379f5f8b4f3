"""The coordinator: drives every running fleet operation further, on one node at a time.

The node that holds the ``coordinator`` key (``node.FleetNode.elect``, under its lease) calls
``drive`` whenever a watch saw an operation, a part or a migration change (and every few
seconds anyway). A round reads the running operations and the live nodes once, then hands
each operation to its kind's driver (``kinds.KINDS[op.kind].drive``, through ``drivers``),
which writes what changed in transactions on the revisions it read: a coordinator that dies
between two writes leaves nothing half done, and the next one goes on from etcd's state. A
damaged operation (or one whose parts are) is said once and left alone; the others go on.
Neighbours: ``kinds``, ``drivers`` (``parts``, ``migration.driver``), ``ops``, ``node``.
"""

from __future__ import annotations

import logging

from ckpt_controller.errors import DamagedRecordError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import ops
from ckpt_controller.fleet.drivers import COORDINATOR
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.kinds import KINDS

log = logging.getLogger("ckpt_controller.fleet")


class Coordinator:
    def __init__(self, client: e.Etcd, keys: Keys, *, lease_ttl_s: float = 5.0) -> None:
        self.etcd = client
        self.keys = keys
        self.drivers = {drive: cls(client, keys, lease_ttl_s=lease_ttl_s)
                        for drive, cls in COORDINATOR.items()}
        self._unreadable: set[str] = set()  # keys and operations said to be damaged

    def drive(self) -> bool:
        """One round; whether it wrote anything (then another round may do more)."""
        damaged: dict[str, str] = {}
        running = ops.running(self.etcd, self.keys, damaged)
        for key, why in damaged.items():
            if key not in self._unreadable:  # policy: not an operation: said, left alone
                log.error("fleet: %s is no fleet operation (%s); left alone", key, why)
                self._unreadable.add(key)
        if not running:
            return False
        nodes = ops.live_nodes(self.etcd, self.keys)
        wrote = False
        for op, rev in running:
            try:
                wrote |= self.drive_op(op, rev, nodes)
            except (DamagedRecordError, KeyError) as err:
                if isinstance(err, DamagedRecordError) and \
                        err.details.get("key") == self.keys.unavailable:
                    raise  # policy: nothing can be counted: no operation goes on
                # policy: its parts or record are damaged or missing: that operation stays
                # as it is, said once; the others go on
                if op.op_id not in self._unreadable:
                    log.error("fleet: operation %s has unreadable or missing records (%s); "
                              "left alone", op.op_id, err)
                    self._unreadable.add(op.op_id)
        return wrote

    def drive_op(self, op, op_rev: int, nodes: dict) -> bool:
        return self.drivers[KINDS[op.kind].drive].drive(op, op_rev, nodes)
