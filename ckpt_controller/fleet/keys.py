"""Where the fleet lives in etcd: every key, under one prefix (default ``/ckpt``).

- ``nodes/<node>``: a ``NodeRecord``, under the node controller's lease: present while the
  node is alive (it keeps the lease alive), gone within the lease's TTL after it dies, at once
  when it stops cleanly (the lease is revoked).
- ``node-ids/<node>``: the identity that owns the node's name (``node_id``, kept in that
  controller's state dir as ``node-id``), written once by its first registration, under no
  lease: a second controller with the same name (another state dir) is refused also after
  the first one's lease expired (it was paused, say), and never deletes the first's records.
  ``ckptctl fleet forget-node`` frees a name whose controller and state dir are gone.
- ``owners/<engine>``: the name of the node that owns the engine; engine names are unique in
  the fleet. Written only by a transaction that finds it absent (or the node's own), so two
  nodes configured with one name do not both publish it.
- ``engines/<engine>``: an ``EngineRecord``, written by its owner only (a transaction that
  checks ``owners/<engine>``). Not under the lease: when a node dies its engines stay listed,
  with their last state, and ``fleet status`` shows their node as down.
- ``locks/<engine>``: the id of the (node-local) operation running on the engine, under its
  node's lease: one operation per engine across the fleet.
- ``unavailable``: the engines out of service, fleet-wide, each with the operation that took
  it out (``{"engine": "op id"}``), changed only by transactions that check its revision:
  what ``--max-unavailable`` counts (``unavailable``).
- ``ops/<op>``: a fleet operation (``FleetOp``); ``parts/<op>/<engine>``: its part on one
  engine (``Part``); ``todo/<node>/<op>/<engine>``: a started part or migration step
  (``Task``), in its node's inbox until the node has written its end.
- ``coordinator``: the node that drives the fleet operations, under that node's lease.
- ``migrations/<op>``: a migration (``Migration``); ``migration-steps/<op>/<step>``: a step's
  end (``StepEnd``); ``migration-images/<op>/<n>``: the image's small files while it runs;
  ``moving/<engine>``: the migration whose target may take the engine over.

The records stored there are in ``records``. Neighbours: ``records``, ``node`` (writes),
``registry`` (reads), ``coordinator``.
"""

from __future__ import annotations


class Keys:
    """The keys under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/")
        self.nodes = f"{self.prefix}/nodes/"
        self.owners = f"{self.prefix}/owners/"
        self.node_ids = f"{self.prefix}/node-ids/"
        self.locks = f"{self.prefix}/locks/"
        self.engines = f"{self.prefix}/engines/"
        self.ops = f"{self.prefix}/ops/"
        #: every migration record (a range read of it gets the records only: the steps and
        #: images live under other prefixes)
        self.migrations = f"{self.prefix}/migrations/"
        self.unavailable = f"{self.prefix}/unavailable"
        self.coordinator = f"{self.prefix}/coordinator"

    def node(self, name: str) -> str:
        return self.nodes + name

    def node_id(self, name: str) -> str:
        return self.node_ids + name

    def owner(self, engine: str) -> str:
        return self.owners + engine

    def engine(self, engine: str) -> str:
        return self.engines + engine

    def lock(self, engine: str) -> str:
        return self.locks + engine

    def op(self, op_id: str) -> str:
        return self.ops + op_id

    def parts(self, op_id: str) -> str:
        return f"{self.prefix}/parts/{op_id}/"

    def part(self, op_id: str, engine: str) -> str:
        return f"{self.prefix}/parts/{op_id}/{engine}"

    def inbox(self, node: str) -> str:
        return f"{self.prefix}/todo/{node}/"

    def todo(self, node: str, op_id: str, engine: str) -> str:
        return f"{self.prefix}/todo/{node}/{op_id}/{engine}"

    def migration(self, op_id: str) -> str:
        return self.migrations + op_id

    def step_ends(self, op_id: str) -> str:
        return f"{self.prefix}/migration-steps/{op_id}/"

    def step_end(self, op_id: str, step: str) -> str:
        return self.step_ends(op_id) + step

    def images(self, op_id: str) -> str:
        """The prefix of a migration's small image files (``<n>``: their chunks in order)."""
        return f"{self.prefix}/migration-images/{op_id}/"

    def moving(self, engine: str) -> str:
        """``moving/<engine>``: the migration whose target may take the engine over."""
        return f"{self.prefix}/moving/{engine}"

    def watched_by_coordinator(self) -> list[tuple[str, str]]:
        """The key ranges ``[start, end)`` whose changes may give the coordinator work: the
        operations and their parts (``ops/`` up to the end of ``parts/``), the migrations
        and the ends of their steps (``migration*``)."""
        from ckpt_controller.fleet.etcd import prefix_end

        migration = f"{self.prefix}/migration"
        return [(self.ops, prefix_end(f"{self.prefix}/parts/")),
                (migration, prefix_end(migration))]
