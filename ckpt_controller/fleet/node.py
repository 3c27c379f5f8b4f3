"""A node controller's part of the fleet: its registration in etcd and its engines' records.

``FleetNode`` runs one thread beside the node controller. It registers the node
(``nodes/<node>`` under a lease of ``lease_ttl_s``), claims each configured engine
(``owners/<engine>``, a transaction that finds it absent or already this node's), and then,
every ``publish_interval_s``: renews the lease when a third of its TTL has passed, asks the
controller for its engines' status, and writes the records that changed (``engines/<engine>``,
a transaction that checks the node still owns the engine). So a change reaches etcd within
about ``publish_interval_s`` plus one status round.

etcd unavailable: the node goes on serving its own operations with its own guarantees (the
thread only reads the controller's status; nothing local waits for etcd). The thread logs
once that etcd is gone, tries again every interval, and when etcd answers again it renews
or (if the lease expired meanwhile) registers anew and writes every record again. An engine
another node owns is logged as an error and not published. ``close`` revokes the lease, so
the node's record goes at once; its engines' records stay, with their last state.
Neighbours: ``etcd`` (the client), ``keys`` (the records), the controller's ``service``
(status, history) through the two callables it is given.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import msgspec

from ckpt_controller import __version__
from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.errors import CkptError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import ops as fops
from ckpt_controller.fleet.keys import EngineRecord, Keys, NodeRecord, encode

log = logging.getLogger("ckpt_controller.fleet")

#: engines written in one transaction at most (etcd's default limit is 128 operations)
TXN_ENGINES = 60
#: each part of the fleet's work is looked at this often at least, watched or not
SAFETY_S = 2.0


#: hosts an endpoint binds to for every address: clients cannot reach the engine there
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]"})


def published_endpoints(endpoints: dict[str, str], control: str, address: str) -> dict[str, str]:
    """What an engine record publishes: the agent's endpoints (``StatusReply.endpoints``),
    each tcp:// one bound to a wildcard host given this node's ``[fleet] address`` instead;
    ``control`` (the configured one) when the agent names none (an older agent, or none
    reached)."""
    out = {kind: reachable_at(endpoint, address) for kind, endpoint in endpoints.items()}
    out.setdefault("control", control)
    return out


def reachable_at(endpoint: str, address: str) -> str:
    """``endpoint`` (``tcp://``, ``http://`` or ``https://``) with a wildcard host (0.0.0.0,
    *, ::) replaced by ``address`` (an IPv6 address in brackets); any other endpoint as it
    is. An http URL keeps its path."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "http", "https"):
        return endpoint
    authority, slash, path = rest.partition("/")
    host, sep, port = authority.rpartition(":")
    if not sep or host not in WILDCARD_HOSTS:
        return endpoint
    return f"{scheme}://{f'[{address}]' if ':' in address else address}:{port}{slash}{path}"


class FleetNode:
    def __init__(self, config: ControllerConfig, status: Callable[[list[str]], object],
                 last_op: Callable[[str], str | None] = lambda name: None,
                 start: Callable | None = None, controller=None) -> None:
        assert config.fleet is not None
        self.config = config
        self.fleet = config.fleet
        self.keys = Keys(self.fleet.prefix)
        self._status = status
        self._last_op_of = last_op
        self.etcd = e.Etcd(self.fleet.etcd, ca_cert=self.fleet.ca_cert, cert=self.fleet.cert,
                           key=self.fleet.key)
        self.lease: int | None = None
        self._lease_expired = False
        self._said_taken = False
        self._said_damaged = False
        #: engines this node owns in etcd (claimed), and those another node owns
        self.owned: set[str] = set()
        self.conflicts: dict[str, str] = {}
        self._said_conflict: dict[str, str] = {}  # each conflict is logged once
        #: what etcd holds of each owned engine, as this node last wrote it
        self._written: dict[str, tuple] = {}
        self._last_ops: dict[str, str | None] = {}
        self._moved: dict[str, tuple] = {}  # engine -> its last transition seen (wall, gen)
        self._endpoints: dict[str, dict] = {}  # engine -> the endpoints its agent last said
        self._stop = threading.Event()
        self._nudge = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = False  # whether the last round reached etcd
        self.rounds = 0
        #: runs a node-local operation: ``start(OperationCommand, done)`` (the controller's)
        self._start_local = start
        #: parts of fleet operations running here: local op id -> (task, its inbox revision)
        self._running: dict[str, tuple] = {}
        self._running_lock = threading.Lock()
        self.coordinator = fops.Coordinator(self.etcd, self.keys)
        self.is_coordinator = False
        #: runs the migration steps this node's inbox holds (``migration``): with the
        #: controller, which it asks to adopt and give away engines
        self.migration = None
        if controller is not None:
            from ckpt_controller.fleet.migration import NodeMigration

            self.migration = NodeMigration(self, controller)
        #: what the watches saw change since it was last looked at (the rounds look at each
        #: anyway every ``SAFETY_S``, in case a watch missed something)
        self._woken = {"inbox": True, "ops": True, "coordinator": True}
        self._looked = {"inbox": 0.0, "ops": 0.0, "coordinator": 0.0}

    # ---------------------------------------------------------------- life

    def start(self) -> "FleetNode":
        self._thread = threading.Thread(target=self._run, name="fleet-node", daemon=True)
        self._thread.start()
        threading.Thread(target=self._keep_lease, name="fleet-lease", daemon=True).start()
        return self

    def _keep_lease(self) -> None:
        """Renew the node's lease every third of its TTL, on a thread of its own: however
        long a round of the fleet's work takes, the lease never waits for it. An expired
        lease (etcd away longer than the TTL) is told to the main thread, which registers
        again."""
        while not self._stop.is_set():
            lease, wait = self.lease, self.fleet.lease_ttl_s / 3
            if lease is not None:
                try:
                    if self.etcd.keepalive(lease) <= 0 and lease == self.lease:
                        log.warning("fleet: the node's lease expired (etcd was out of reach "
                                    "longer than %ds); registering again",
                                    self.fleet.lease_ttl_s)
                        self._lease_expired = True
                        self.nudge()
                except CkptError:  # policy: etcd away: tried again soon, the TTL is short
                    wait = min(wait, 0.5)
            self._stop.wait(wait)

    def nudge(self) -> None:
        """Publish now rather than at the next interval (an engine just changed)."""
        self._nudge.set()

    def close(self) -> None:
        self._stop.set()
        self._nudge.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * e.REQUEST_TIMEOUT_S + 1)
        if self.lease is not None:
            try:
                self.etcd.revoke(self.lease)
            except CkptError as err:  # policy: the lease then expires by itself within its TTL
                log.warning("fleet: could not revoke the node's lease: %s", err)
            self.lease = None
        self.etcd.close()

    def _run(self) -> None:
        self._watches()
        next_round = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_round:
                    next_round = time.monotonic() + self.fleet.publish_interval_s
                    self.round()
                    self.rounds += 1
                elif self.lease is not None:
                    self.fleet_work()  # woken by a watch: only the fleet operations' part
                if not self.available:
                    log.info("fleet: node %s registered in etcd (%s)", self.fleet.node,
                             ", ".join(self.fleet.etcd))
                self.available = True
            except NodeNameTaken:  # policy: said once by register; tried again each round
                self.available = False
                self.rounds += 1
            except fops.DamagedRecord as err:  # policy: etcd answers; the record does not
                if not self._said_damaged:
                    log.error("fleet: %s", err)
                    self._said_damaged = True
            except CkptError as err:  # policy: etcd down: the node goes on; tried again
                if self.available or self.rounds == 0:
                    log.warning("fleet: etcd unavailable, the node serves on its own: %s", err)
                self.available = False
                self.rounds += 1
            except Exception:  # policy: a bug here must not end the fleet thread for good
                log.exception("fleet: publishing failed")
                self.available = False
            self._nudge.wait(max(0.0, next_round - time.monotonic()))
            self._nudge.clear()

    def _watches(self) -> None:
        """Threads that wake this one as soon as its inbox changes, and (a node that may
        coordinate) the operations or their parts: the rounds alone would be
        ``publish_interval_s`` late each time."""
        from ckpt_controller.fleet.etcd import prefix_end

        inbox = self.keys.inbox(self.fleet.node)
        ranges = [("inbox", inbox, prefix_end(inbox))]
        if self.fleet.coordinator:  # ops/ ... parts/ (owners/ between them changes rarely)
            ranges.append(("ops", self.keys.ops, prefix_end(f"{self.keys.prefix}/parts/")))
            # and the migrations: their records and the ends of their steps
            migrations = f"{self.keys.prefix}/migration"
            ranges.append(("ops", migrations, prefix_end(migrations)))
            ranges.append(("coordinator", self.keys.coordinator,
                           self.keys.coordinator + "\x00"))
        for what, start, end in ranges:
            threading.Thread(target=self.etcd.watch,
                             args=(start, end, lambda w=what: self._wake(w), self._stop),
                             name=f"fleet-watch-{what}", daemon=True).start()

    def _wake(self, what: str) -> None:
        self._woken[what] = True
        self.nudge()

    def _due(self, what: str) -> bool:
        """Whether to look at ``what`` now: a watch saw it change, or ``SAFETY_S`` passed."""
        now = time.monotonic()
        if self._woken[what] or now - self._looked[what] >= SAFETY_S:
            self._woken[what] = False
            self._looked[what] = now
            return True
        return False

    # ---------------------------------------------------------------- one round

    def round(self) -> None:
        """Register (or renew), claim what is unclaimed, write what changed."""
        if self._lease_expired:
            self._lease_expired = False
            self.lease = None
        if self.lease is None:
            self.register()
        names = [eng.name for eng in self.config.engines]
        for name in (self.owned | set(self.conflicts)) - set(names):  # given away
            self.owned.discard(name)
            self.conflicts.pop(name, None)
            self._written.pop(name, None)
            self._endpoints.pop(name, None)
        # an engine migrating to or from here is claimed by the migration's own transactions
        moving = (self.migration.arriving | self.migration.leaving
                  if self.migration is not None else set())
        if self.rounds % 8 == 0:  # another node's engine now and then: it may have gone
            self.conflicts.clear()
        unclaimed = [n for n in names if n not in self.owned and n not in self.conflicts
                     and n not in moving]
        if unclaimed:
            self.claim(unclaimed)
        self.publish([n for n in names if n in self.owned])
        if self.migration is not None and self.rounds % 8 == 0:
            self.migration.settle()  # migrations that ended while this node was away
        self.fleet_work()

    def fleet_work(self) -> None:
        """Run this node's new parts; coordinate (a few rounds while they move things on):
        each only when a watch saw its keys change, or ``SAFETY_S`` passed."""
        if self._due("inbox"):
            self.take_parts()
        if self._due("coordinator"):
            self.elect()
        if self.is_coordinator and self._due("ops"):
            for _ in range(8):
                if not self.coordinator.drive():
                    break

    def register(self) -> None:
        """The node's record under a new lease, if no other controller holds the node's name
        (a second copy of this node, or this one's previous life whose lease has not expired
        yet): then it says so, and tries again each round."""
        lease = self.etcd.grant(self.fleet.lease_ttl_s)
        rec = NodeRecord(node=self.fleet.node, controller=self.config.endpoint, pid=os.getpid(),
                         host=socket.gethostname(), started=time.time(), version=__version__,
                         lease=lease)
        key = self.keys.node(self.fleet.node)
        ok, resp = self.etcd.txn([e.compare_created(key)], [e.put_op(key, encode(rec), lease)],
                                 [e.get_op(key)])
        if not ok:
            self.etcd.revoke(lease)
            held = resp[0]["kvs"][0].value if resp[0]["kvs"] else b"?"
            if not self._said_taken:
                log.error("fleet: node name %s is registered by another controller (%s); "
                          "waiting for that registration to end (a second copy of this node "
                          "is a configuration error; a restarted one waits out its old lease)",
                          self.fleet.node, held.decode(errors="replace")[:300])
                self._said_taken = True
            raise NodeNameTaken(f"node name {self.fleet.node} is registered already",
                                node=self.fleet.node)
        self._said_taken = False
        self.lease = lease
        self._woken = dict.fromkeys(self._woken, True)  # look at everything again
        self._written.clear()  # write every record again: etcd may have lost or missed some
        self.owned.clear()
        self.conflicts.clear()
        self._forget_removed()

    def _forget_removed(self) -> None:
        """Engines this node owns in etcd that its TOML no longer has: their records go."""
        configured = {eng.name for eng in self.config.engines}
        for kv in self.etcd.get_prefix(self.keys.owners):
            engine = kv.key[len(self.keys.owners):]
            if kv.value.decode() == self.fleet.node and engine not in configured:
                self.etcd.txn([e.compare_value(kv.key, self.fleet.node)],
                              [e.delete_op(kv.key), e.delete_op(self.keys.engine(engine))])
                log.info("fleet: %s is no longer configured here; its record is removed",
                         engine)

    def claim(self, names: list[str]) -> None:
        me = self.fleet.node
        for name in names:
            key = self.keys.owner(name)
            ok, resp = self.etcd.txn([e.compare_created(key)], [e.put_op(key, me)],
                                     [e.get_op(key)])
            owner = me if ok else (resp[0]["kvs"][0].value.decode() if resp[0]["kvs"] else None)
            if owner == me:
                self._said_conflict.pop(name, None)
                self.owned.add(name)
                self._last_ops.setdefault(name, self._last_op_of(name))
            elif owner is not None:
                migrated = (self.migration is not None
                            and self.migration.controller.adopted_by(name) is not None)
                if self._said_conflict.get(name) != owner and not migrated:
                    log.error("fleet: engine %s is registered by node %s; this node does not "
                              "publish it (engine names are unique in the fleet)", name, owner)
                self._said_conflict[name] = owner
                self.conflicts[name] = owner

    def publish(self, names: list[str]) -> None:
        if not names:
            return
        reply = self._status(names)
        changed: list[EngineRecord] = []
        driven = self.config.roster.by_name  # one snapshot: engines may be given away
        for view in reply.engines:
            if view.engine not in driven:
                continue  # given away since ``names`` was read: no longer this node's
            rec = self.record(view, driven[view.engine])
            if self._written.get(rec.engine) != rec.content():
                changed.append(rec)
        for i in range(0, len(changed), TXN_ENGINES):
            self._write(changed[i:i + TXN_ENGINES])
        if self.rounds % 8 == 0:  # rare: a part lost with this node; looked at now and then
            self._back_from_lost(reply.engines)

    def _back_from_lost(self, views) -> None:
        """An engine whose part was lost with this node counts as out of service until the
        node is back and sees it RUNNING and free: then it counts no more."""
        out, _ = fops.read_unavailable(self.etcd, self.keys)
        back = {v.engine for v in views
                if out.get(v.engine, "").startswith("lost:") and v.status is not None
                and v.status.state == "running" and v.holder is None}
        if back:
            fops.update_unavailable(self.etcd, self.keys, lambda cur: {
                k: v for k, v in cur.items() if not (k in back and v.startswith("lost:"))})
            log.info("fleet: %s back in service after a lost part", ", ".join(sorted(back)))

    def record(self, view, eng=None) -> EngineRecord:
        eng = eng or self.config.engine(view.engine)
        s = view.status
        last = s.last_transition if s is not None else None
        if view.holder:
            self._last_ops[view.engine] = view.holder
        elif last is not None and self._moved.get(view.engine) != (last.wall, last.generation):
            # the engine moved since the last look: the journal names what moved it
            self._moved[view.engine] = (last.wall, last.generation)
            self._last_ops[view.engine] = self._last_op_of(view.engine)
        if s is not None and s.endpoints:
            self._endpoints[view.engine] = dict(s.endpoints)
        # an agent out of reach (stopped for a dump, say) keeps the endpoints it last had:
        # clients following the engine still know where to ask
        said = s.endpoints if s is not None and s.endpoints else self._endpoints.get(
            view.engine, {})
        return EngineRecord(
            engine=view.engine, node=self.fleet.node, state=s.state if s else None,
            generation=s.generation if s else None, holder=view.holder,
            last_op=self._last_ops.get(view.engine), labels=dict(eng.labels),
            endpoints=published_endpoints(said, eng.control, self.fleet.address),
            reachable=view.reachable,
            pid=s.pid if s else None, since=last.wall if last is not None else None,
            updated=time.time())

    def _write(self, records: list[EngineRecord]) -> None:
        me = self.fleet.node
        compare = [e.compare_value(self.keys.owner(r.engine), me) for r in records]
        puts = [e.put_op(self.keys.engine(r.engine), encode(r)) for r in records]
        ok, _ = self.etcd.txn(compare, puts)
        if ok:
            for r in records:
                self._written[r.engine] = r.content()
            return
        for r in records:  # one of them is no longer this node's: find which, one by one
            ok, _ = self.etcd.txn([e.compare_value(self.keys.owner(r.engine), me)],
                                  [e.put_op(self.keys.engine(r.engine), encode(r))])
            if ok:
                self._written[r.engine] = r.content()
            else:
                self.owned.discard(r.engine)  # claimed again next round (or a conflict)
                self._written.pop(r.engine, None)

    # ---------------------------------------------------------------- fleet operations

    def elect(self) -> None:
        """Be the coordinator if no node is: the key lives under this node's lease, so it
        goes with this node (a watch on it wakes the others)."""
        if not self.fleet.coordinator:
            return
        key = self.keys.coordinator
        me = self.fleet.node
        ok, resp = self.etcd.txn([e.compare_created(key)], [e.put_op(key, me, self.lease or 0)],
                                 [e.get_op(key)])
        holder = me if ok else (resp[0]["kvs"][0].value.decode() if resp[0]["kvs"] else None)
        if (holder == me) != self.is_coordinator:
            log.info("fleet: node %s %s the coordinator", me,
                     "is now" if holder == me else "is no longer")
        if holder == me and not self.is_coordinator:
            self._woken["ops"] = True  # a new coordinator looks at every operation at once
        self.is_coordinator = holder == me

    def take_parts(self) -> None:
        """Run the parts in this node's inbox that are not running here yet."""
        if self._start_local is None:
            return
        from ckpt_controller import protocol as p

        inbox = self.keys.inbox(self.fleet.node)
        for kv in self.etcd.get_prefix(inbox):
            try:
                task = fops.task_dec.decode(kv.value)
            except msgspec.DecodeError as err:  # policy: not a task this node can run: said
                log.error("fleet: %s in the inbox is no task (%s); removed", kv.key, err)
                self.etcd.txn([e.compare_modified(kv.key, kv.mod_revision)],
                              [e.delete_op(kv.key)])
                continue
            with self._running_lock:
                if task.local_op in self._running:
                    continue
                self._running[task.local_op] = (task, kv.create_revision)
            if task.kind.startswith("migrate-"):
                if self.migration is None:
                    log.error("fleet: %s needs a node controller that runs migrations",
                              task.kind)
                    continue
                log.info("fleet: migration %s of %s: %s starts here", task.op_id,
                         task.engine, task.kind.removeprefix("migrate-"))
                self.migration.run(task, kv.create_revision, self._migration_step_done)
                continue
            try:
                cmd = msgspec.convert(dict(task.params, call_id=0, op_id=task.local_op,
                                           kind=task.kind, engines=[task.engine]),
                                      p.OperationCommand)
            except msgspec.ValidationError as err:  # policy: a part that cannot run fails
                self._local_done(task.local_op, CkptError(f"bad parameters: {err}"))
                continue
            log.info("fleet: %s of %s for fleet operation %s starts here", task.kind,
                     task.engine, task.op_id)
            try:
                self._start_local(cmd, lambda r, lo=task.local_op: self._local_done(lo, r))
            except CkptError as err:  # policy: refused at once (busy, bad state): the part's end
                self._local_done(task.local_op, err)

    def is_fleet_part(self, local_op: str) -> bool:
        """Whether ``local_op`` is a fleet operation's part running here, or one of the
        node-local operations of a migration step running here (the coordinator took its
        lock and its place in ``unavailable`` for it)."""
        from ckpt_controller.fleet.migration import local_ids

        with self._running_lock:
            if local_op in self._running:
                return True
            return any(local_op in local_ids(t.op_id, t.engine).values()
                       for t, _ in self._running.values() if t.kind.startswith("migrate-"))

    def _migration_step_done(self, local_op: str) -> None:
        with self._running_lock:
            self._running.pop(local_op, None)
        self.nudge()

    def _local_done(self, local_op: str, result) -> None:
        with self._running_lock:
            task, todo_rev = self._running[local_op]
        try:
            if isinstance(result, CkptError):
                state, error = None, f"{result.kind}: {result.message}"
            else:
                outcome = next((o for o in result.engines if o.engine == task.engine), None)
                state = outcome.state if outcome is not None else None
                error = None if result.status == "succeeded" else (
                    (outcome.error.message if outcome is not None and outcome.error else None)
                    or (result.error.message if result.error else result.status))
            self._part_ended(task, todo_rev, state, error)
        except CkptError as err:  # policy: etcd away: the inbox still has it; tried again
            log.warning("fleet: could not write the end of %s's part of %s: %s", task.engine,
                        task.op_id, err)
        finally:
            with self._running_lock:
                self._running.pop(local_op, None)
            self.nudge()

    def _part_ended(self, task, todo_rev: int, state, error: str | None) -> None:
        """One transaction: the part's end written, out of the inbox, the lock freed; only
        while the inbox still holds the task (a coordinator that found this node lost took it
        out, and the part is lost then)."""
        k = self.keys
        ended = fops.Part(engine=task.engine, node=task.node, local_op=task.local_op,
                          status="succeeded" if error is None else "failed",
                          state=str(state) if state is not None else None, error=error,
                          started=task.started, ended=time.time())
        todo = k.todo(task.node, task.op_id, task.engine)
        writes = [e.put_op(k.part(task.op_id, task.engine), encode(ended)), e.delete_op(todo)]
        ok, _ = self.etcd.txn([e.compare_created(todo, todo_rev),
                               e.compare_value(k.lock(task.engine), task.local_op)],
                              writes + [e.delete_op(k.lock(task.engine))])
        if not ok:  # the lock went with an expired lease (or was never there): not ours
            self.etcd.txn([e.compare_created(todo, todo_rev)], writes)


class NodeNameTaken(CkptError):
    """Another controller holds this node's name in etcd."""
