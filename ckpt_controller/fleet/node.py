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

from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.errors import CkptError, DamagedRecordError, NodeNameTakenError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import gc, identity
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet import unavailable
from ckpt_controller.fleet.coordinator import Coordinator
from ckpt_controller.fleet.drivers import node_runners
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.kinds import KINDS, Drive
from ckpt_controller.fleet.migration import procs, weights
from ckpt_controller.fleet.migration.record import local_ids
from ckpt_controller.fleet.records import EngineRecord, NodeRecord, encode
from ckpt_controller.fleet.registry import published_endpoints
from ckpt_controller.version import __version__
from ckpt_controller.vocab import CheckpointState

log = logging.getLogger("ckpt_controller.fleet")

#: engines written in one transaction at most (etcd's default limit is 128 operations)
TXN_ENGINES = 60
#: each part of the fleet's work is looked at this often at least, watched or not
SAFETY_S = 2.0


class FleetNode:
    """A node controller's registration in etcd and its part of the fleet's work, beside
    ``controller`` (the node's ``service.Controller``: its engines' status and last
    operations, the node-local operations the fleet runs here, adoptions and give-aways)."""

    def __init__(self, config: ControllerConfig, controller) -> None:
        assert config.fleet is not None
        self.config = config
        self.fleet = config.fleet
        self.keys = Keys(self.fleet.prefix)
        self.controller = controller
        self._status = controller.status
        self._last_op_of = controller.last_op
        self.etcd = e.Etcd(self.fleet.etcd, ca_cert=self.fleet.ca_cert, cert=self.fleet.cert,
                           key=self.fleet.key)
        self.lease: int | None = None
        #: the identity that owns the node's name in etcd (``node-ids/<node>``)
        self.node_id = identity.node_identity(config.state_dir)
        weights.remember_in(config.state_dir)  # the weight files' digests, across restarts
        self._lease_expired = False
        self._said_taken = False
        self._said_replaced = False  # that this node's record was replaced under it
        self._said_damaged = False
        #: engines this node owns in etcd (claimed), and those another node owns
        self.owned: set[str] = set()
        self.conflicts: dict[str, str] = {}
        self._said_conflict: dict[str, str] = {}  # each conflict is logged once
        #: what etcd holds of each owned engine, as this node last wrote it
        self._written: dict[str, tuple] = {}
        self._last_ops: dict[str, str | None] = {}
        self._moved: dict[str, tuple] = {}  # engine -> its last transition seen (wall, gen)
        #: engine -> what its agent last said of where it is reached and what it reloads
        self._endpoints: dict[str, tuple[dict, dict]] = {}
        self._pid_ns: dict[int | None, bool | None] = {}  # engine PID -> own PID namespace
        self._gc_at = 0.0  # when the coordinator next forgets old operations (fleet.gc)
        #: ``[migration] digest_ahead``: the fleet's weight files, digested ahead here
        self._ahead = weights.Ahead(self.etcd, self.keys, self.fleet.node) \
            if config.migration.digest_ahead else None
        self._stop = threading.Event()
        self._nudge = threading.Event()
        self._publishing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._fencing: threading.Thread | None = None
        #: when etcd last answered this node (a lease renewal, a registration)
        self.heard = time.monotonic()
        self.available = False  # whether the last round reached etcd
        self.rounds = 0
        #: tasks of fleet operations running here: local op id -> the task
        self._running: dict[str, r.Task] = {}
        self._running_lock = threading.Lock()
        self.coordinator = Coordinator(self.etcd, self.keys,
                                       lease_ttl_s=self.fleet.lease_ttl_s)
        self.is_coordinator = False
        #: what runs the tasks in this node's inbox, by ``kinds.Drive`` (with the
        #: controller, which runs parts and adopts and gives away migrating engines)
        self.runners = node_runners(self, controller)
        #: the migration steps' runner (``migration.steps.NodeMigration``), if any
        self.migration = self.runners.get(Drive.STEPS)
        #: what the watches saw change since it was last looked at (the rounds look at each
        #: anyway every ``SAFETY_S``, in case a watch missed something)
        self._woken = {"inbox": True, "ops": True, "coordinator": True}
        self._looked = {"inbox": 0.0, "ops": 0.0, "coordinator": 0.0}

    # ---------------------------------------------------------------- life

    def start(self) -> "FleetNode":
        self._thread = threading.Thread(target=self._run, name="fleet-node", daemon=True)
        self._thread.start()
        threading.Thread(target=self._keep_lease, name="fleet-lease", daemon=True).start()
        if self._ahead is not None:  # its own thread: the rounds never wait for its reads
            threading.Thread(target=self._ahead.run, args=(self._stop,),
                             name="fleet-digest-ahead", daemon=True).start()
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
                    self.heard = time.monotonic()
                except CkptError:  # policy: etcd away: tried again soon, the TTL is short
                    wait = min(wait, 0.5)
            silent = time.monotonic() - self.heard
            if silent > self.fleet.lease_ttl_s:
                wait = min(wait, 0.5)
                self._fence(silent)
            self._stop.wait(wait)

    def _fence(self, silent_s: float) -> None:
        """No word from etcd for longer than the lease: the migration's fence stops the
        copies held uncertainly here (``migration.fence``), on a thread of its own (it asks
        the controller about its engines; the lease's renewals never wait for that)."""
        if self.migration is None or (self._fencing is not None and self._fencing.is_alive()):
            return
        self._fencing = threading.Thread(target=self.migration.fence.cut_off,
                                         args=(silent_s,), name="fleet-fence", daemon=True)
        self._fencing.start()

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
                # a round may touch etcd not at all (nothing changed): etcd is available
                # while the lease's renewals (or a registration) are answered
                if time.monotonic() - self.heard <= self.fleet.lease_ttl_s:
                    if not self.available:
                        log.info("fleet: node %s registered in etcd (%s)", self.fleet.node,
                                 ", ".join(self.fleet.etcd))
                    self.available = True
            except NodeNameTakenError:  # policy: said once by register; tried each round
                self.available = False
                self.rounds += 1
            except DamagedRecordError as err:  # policy: etcd answers; the record does not
                if not self._said_damaged:
                    log.error("fleet: %s", err.message)
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
        if self.fleet.coordinator:  # operations, parts, migrations and their steps' ends
            ranges += [("ops", start, end) for start, end in self.keys.watched_by_coordinator()]
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
        elif self.rounds % 8 == 0:
            self._still_registered()
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
        if self.migration is not None and self.migration.fence.fenced:
            self.migration.fence.in_touch()  # copies stopped while etcd was away
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
        if self.is_coordinator and time.monotonic() >= self._gc_at:
            self._gc_at = time.monotonic() + gc.GC_EVERY_S
            done = gc.collect(self.etcd, self.keys, self.fleet.keep_days * 86400.0)
            if done.deleted:
                log.info("fleet: forgot %d fleet operations ended over %g days ago",
                         len(done.deleted), self.fleet.keep_days)

    def _still_registered(self) -> None:
        """This node's record, deleted by hand while its lease lives (it would show as down
        for good, and never register again until restarted): written again, said."""
        key = self.keys.node(self.fleet.node)
        kv = self.etcd.get(key)
        if kv is not None and kv.lease == self.lease:
            return
        if kv is None:
            rec = NodeRecord(node=self.fleet.node, controller=self.config.endpoint,
                             pid=os.getpid(), host=socket.gethostname(), started=time.time(),
                             version=__version__, lease=self.lease,
                             netns=procs.net_namespace())
            ok, _ = self.etcd.txn([e.compare_created(key)],
                                  [e.put_op(key, encode(rec), self.lease)])
            if ok:
                log.warning("fleet: this node's record %s was gone while its lease lived; "
                            "written again", key)
            return
        if not self._said_replaced:  # another lease's, or none: replaced under it; said
            log.error("fleet: %s no longer holds this node's registration (lease %s, not "
                      "%s): another controller, or a person, wrote it", key, kv.lease,
                      self.lease)
            self._said_replaced = True

    def _own_name(self) -> None:
        """The node's name is this controller's (``identity.claim_name``); another identity
        there is another controller with this name, whose lease may only have expired (it
        was paused): refused, said once, tried again each round; the name never passes to
        it by a lease's expiry."""
        held = identity.claim_name(self.etcd, self.keys, self.fleet.node, self.node_id)
        if held is None:
            return
        if not self._said_taken:
            log.error("fleet: node name %s belongs to another controller (node id %s; this "
                      "one's, in %s, is %s): registered by another controller with this name "
                      "and another state dir. Two controllers with one name is a "
                      "configuration error; if that controller and its state dir are gone "
                      "for good, `ckptctl fleet forget-node %s` frees the name",
                      self.fleet.node, held[:64],
                      self.config.state_dir / identity.NODE_ID_FILE, self.node_id,
                      self.fleet.node)
            self._said_taken = True
        raise NodeNameTakenError(f"node name {self.fleet.node} belongs to node id "
                                 f"{held[:64]}, not this controller's {self.node_id}",
                                 node=self.fleet.node)

    def register(self) -> None:
        """The node's record under a new lease, if the node's name is this controller's
        (``_own_name``) and no other controller holds it (this one's previous life whose
        lease has not expired yet): else it says so, and tries again each round."""
        self._own_name()
        lease = self.etcd.grant(self.fleet.lease_ttl_s)
        rec = NodeRecord(node=self.fleet.node, controller=self.config.endpoint, pid=os.getpid(),
                         host=socket.gethostname(), started=time.time(), version=__version__,
                         lease=lease, netns=procs.net_namespace())
        key = self.keys.node(self.fleet.node)
        ok, resp = self.etcd.txn([e.compare_created(key)], [e.put_op(key, encode(rec), lease)],
                                 [e.get_op(key)])
        if not ok and resp[0]["kvs"] and not identity.registration(resp[0]["kvs"][0]):
            # no controller's: written by hand under no lease, or unreadable; it would never
            # expire, and this node would wait for it for ever: replaced, said
            held = resp[0]["kvs"][0]
            ok, _ = self.etcd.txn([e.compare_modified(key, held.mod_revision)],
                                  [e.put_op(key, encode(rec), lease)])
            if ok:
                log.warning("fleet: %s held no controller's registration (under no lease, or "
                            "unreadable: %r); replaced by this node's", key,
                            held.value[:200])
        if not ok:
            self.etcd.revoke(lease)
            held = resp[0]["kvs"][0].value if resp[0]["kvs"] else b"?"
            if not self._said_taken:
                log.error("fleet: node name %s is registered by another controller (%s); "
                          "waiting for that registration to end (a second copy of this node "
                          "is a configuration error; a restarted one waits out its old lease)",
                          self.fleet.node, held.decode(errors="replace")[:300])
                self._said_taken = True
            raise NodeNameTakenError(f"node name {self.fleet.node} is registered already",
                                     node=self.fleet.node)
        self._said_taken = False
        self.heard = time.monotonic()
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
                migrated = self.controller.adopted_by(name) is not None
                if self._said_conflict.get(name) != owner and not migrated:
                    log.error("fleet: engine %s is registered by node %s; this node does not "
                              "publish it (engine names are unique in the fleet)", name, owner)
                self._said_conflict[name] = owner
                self.conflicts[name] = owner

    def publish(self, names: list[str]) -> None:
        """Write what changed of ``names``' records: the rounds, and a migration's adopt as
        soon as the engine runs here (one at a time: none writes what it read before)."""
        if not names:
            return
        with self._publishing:
            self._publish(names)

    def _publish(self, names: list[str]) -> None:
        # an engine a migration is dumping here or holds stopped answers nothing: it is
        # published out of reach without asking (asking waited out a 2 s timeout)
        stopped = self.migration.stopped if self.migration is not None else set()
        asked = [n for n in names if n not in stopped]
        views = [*(self._status(asked).engines if asked else ()),
                 *(self.migration.out_of_reach(n) for n in names if n in stopped)]
        changed: list[EngineRecord] = []
        driven = self.config.roster.by_name  # one snapshot: engines may be given away
        for view in views:
            if view.engine not in driven:
                continue  # given away since ``names`` was read: no longer this node's
            rec = self.record(view, driven[view.engine])
            if self._written.get(rec.engine) != rec.content():
                changed.append(rec)
        for i in range(0, len(changed), TXN_ENGINES):
            self._write(changed[i:i + TXN_ENGINES])
        if self.rounds % 8 == 0:  # rare: a part lost with this node; looked at now and then
            self._back_from_lost(views)

    def _back_from_lost(self, views) -> None:
        """An engine that counts as out of service although it is RUNNING here and free
        counts no more: one whose part was lost with this node (it is back, and sees it),
        or one whose mark names a fleet operation that has ended (a migration that failed
        while a controller was away left it there, and ``--max-unavailable`` was refused for
        it until someone edited etcd)."""
        out, _ = unavailable.read(self.etcd, self.keys)
        free = {v.engine for v in views if v.engine in out and v.status is not None
                and v.status.state == CheckpointState.RUNNING and v.holder is None}
        back = unavailable.stale_marks({k: out[k] for k in free},
                           lambda op_id: r.read(self.etcd, self.keys.op(op_id), r.FleetOp))
        if back:
            unavailable.update(self.etcd, self.keys, lambda cur: {
                k: v for k, v in cur.items() if not (k in back and back[k] == v)})
            log.info("fleet: %s back in service (%s)", ", ".join(sorted(back)),
                     "; ".join(f"{k}: {why}" for k, why in sorted(back.items())))

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
            weights.warm(s.reload_files.values())  # once each, ahead of a migration's send
            self._endpoints[view.engine] = (dict(s.endpoints), dict(s.reload_files))
        # an agent out of reach (stopped for a dump, say) keeps the endpoints it last had:
        # clients following the engine still know where to ask
        said, reloads = self._endpoints.get(view.engine, ({}, {}))
        return EngineRecord(
            engine=view.engine, node=self.fleet.node, state=s.state if s else None,
            generation=s.generation if s else None, holder=view.holder,
            last_op=self._last_ops.get(view.engine), labels=dict(eng.labels),
            endpoints=published_endpoints(said, eng.control, self.fleet.address),
            reload_files=reloads,
            reachable=view.reachable,
            pid=s.pid if s else None, since=last.wall if last is not None else None,
            own_pid_namespace=self._own_pid_namespace(s.pid if s else None),
            updated=time.time())

    def _own_pid_namespace(self, pid) -> bool | None:
        """``procs.own_pid_namespace``, read once per engine process (its PID, not reused
        while the engine lives: a restore gives it another)."""
        if pid not in self._pid_ns:
            if len(self._pid_ns) > 4 * max(16, len(self.config.engines)):
                self._pid_ns.clear()  # PIDs of engines long gone
            self._pid_ns[pid] = procs.own_pid_namespace(pid)
        return self._pid_ns[pid]

    def _write(self, records: list[EngineRecord]) -> None:
        me = self.fleet.node
        compare = [e.compare_value(self.keys.owner(rec.engine), me) for rec in records]
        puts = [e.put_op(self.keys.engine(rec.engine), encode(rec)) for rec in records]
        ok, _ = self.etcd.txn(compare, puts)
        if ok:
            for rec in records:
                self._written[rec.engine] = rec.content()
            return
        for rec in records:  # one of them is no longer this node's: find which, one by one
            ok, _ = self.etcd.txn([e.compare_value(self.keys.owner(rec.engine), me)],
                                  [e.put_op(self.keys.engine(rec.engine), encode(rec))])
            if ok:
                self._written[rec.engine] = rec.content()
            else:
                self.owned.discard(rec.engine)  # claimed again next round (or a conflict)
                self._written.pop(rec.engine, None)

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
        if not ok and resp[0]["kvs"] and resp[0]["kvs"][0].lease == 0 and self.lease:
            # a coordinator key under no lease is no node's election (a put by hand): it
            # would never go, and no node would coordinate; taken over, said
            held = resp[0]["kvs"][0]
            ok, _ = self.etcd.txn([e.compare_modified(key, held.mod_revision)],
                                  [e.put_op(key, me, self.lease)])
            if ok:
                log.warning("fleet: the coordinator key named %r under no lease (no node's "
                            "election); taken over by %s", held.value[:100], me)
        holder = me if ok else (resp[0]["kvs"][0].value.decode() if resp[0]["kvs"] else None)
        if (holder == me) != self.is_coordinator:
            log.info("fleet: node %s %s the coordinator", me,
                     "is now" if holder == me else "is no longer")
        if holder == me and not self.is_coordinator:
            self._woken["ops"] = True  # a new coordinator looks at every operation at once
        self.is_coordinator = holder == me

    def take_parts(self) -> None:
        """Run the tasks in this node's inbox that are not running here yet, each by its
        kind's runner (``kinds.KINDS[kind].drive``)."""
        for kv in self.etcd.get_prefix(self.keys.inbox(self.fleet.node)):
            try:
                task = r.decode(r.Task, kv.value, kv.key)
            except DamagedRecordError as err:  # policy: not a task this node can run: said
                log.error("fleet: %s in the inbox is no task (%s); removed", kv.key,
                          err.message)
                self.etcd.txn([e.compare_modified(kv.key, kv.mod_revision)],
                              [e.delete_op(kv.key)])
                continue
            runner = self.runners.get(KINDS[task.kind].drive)
            if runner is None:
                log.error("fleet: %s of %s needs a node controller that runs it", task.kind,
                          task.engine)
                continue
            with self._running_lock:
                if task.local_op in self._running:
                    continue
                self._running[task.local_op] = task
            if task.step is not None:
                log.info("fleet: migration %s of %s: %s starts here", task.op_id, task.engine,
                         task.step)
            runner.run(task, kv.create_revision, self._task_done)

    def running_tasks(self) -> list[r.Task]:
        """The tasks of fleet operations running on this node now."""
        with self._running_lock:
            return list(self._running.values())

    def is_fleet_part(self, local_op: str) -> bool:
        """Whether ``local_op`` is a fleet operation's part running here, or one of the
        node-local operations of a migration step running here (the coordinator took its
        lock and its place in ``unavailable`` for it)."""
        tasks = self.running_tasks()
        return any(local_op == t.local_op
                   or (t.step is not None and local_op in local_ids(t.op_id, t.engine).values())
                   for t in tasks)

    def _task_done(self, local_op: str) -> None:
        with self._running_lock:
            self._running.pop(local_op, None)
        self.nudge()
