"""Each way a fleet kind runs (``kinds.Drive``), mapped to its code: how it is submitted, the
coordinator's side (``drive``) and a node's side (``run`` of a task in its inbox).

The table of kinds names a ``Drive`` per kind; this module is the one place that turns it
into code, so the coordinator, the node and ``ckptctl fleet`` never name a kind.
Neighbours: ``kinds`` (the table), ``parts`` and ``migration`` (the two drivers),
``coordinator``, ``node``, ``cli.fleet_cmd``.
"""

from __future__ import annotations

from ckpt_controller.fleet import parts
from ckpt_controller.fleet.kinds import Drive
from ckpt_controller.fleet.migration import driver as migration_driver
from ckpt_controller.fleet.migration import record as migration_record

#: the coordinator's side of each drive: made once per coordinator with (etcd, keys)
COORDINATOR = {Drive.PARTS: parts.PartsDriver, Drive.STEPS: migration_driver.MigrationDriver}

#: how an operation of each drive is recorded in etcd (``ckptctl fleet``)
SUBMIT = {Drive.PARTS: parts.submit, Drive.STEPS: migration_record.submit}


def node_runners(node, controller) -> dict:
    """A node's side of each drive: what runs a task in its inbox (``run(task, todo_rev,
    finished)``), with the node's controller."""
    # here, not at the top: the node's side pulls in the controller's configuration and
    # roster, which ``ckptctl fleet`` submitting an operation does not need (46 ms of its start)
    from ckpt_controller.fleet.migration.steps import NodeMigration

    return {Drive.PARTS: parts.PartRunner(node, controller.start),
            Drive.STEPS: NodeMigration(node, controller)}
