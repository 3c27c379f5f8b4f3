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

from ckpt_controller import __version__
from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.errors import CkptError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet.keys import EngineRecord, Keys, NodeRecord, encode

log = logging.getLogger("ckpt_controller.fleet")

#: engines written in one transaction at most (etcd's default limit is 128 operations)
TXN_ENGINES = 60


class FleetNode:
    def __init__(self, config: ControllerConfig, status: Callable[[list[str]], object],
                 last_op: Callable[[str], str | None] = lambda name: None) -> None:
        assert config.fleet is not None
        self.config = config
        self.fleet = config.fleet
        self.keys = Keys(self.fleet.prefix)
        self._status = status
        self._last_op_of = last_op
        self.etcd = e.Etcd(self.fleet.etcd, ca_cert=self.fleet.ca_cert, cert=self.fleet.cert,
                           key=self.fleet.key)
        self.lease: int | None = None
        self._renewed = 0.0
        #: engines this node owns in etcd (claimed), and those another node owns
        self.owned: set[str] = set()
        self.conflicts: dict[str, str] = {}
        #: what etcd holds of each owned engine, as this node last wrote it
        self._written: dict[str, tuple] = {}
        self._last_ops: dict[str, str | None] = {}
        self._moved: dict[str, tuple] = {}  # engine -> its last transition seen (wall, gen)
        self._stop = threading.Event()
        self._nudge = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = False  # whether the last round reached etcd
        self.rounds = 0

    # ---------------------------------------------------------------- life

    def start(self) -> "FleetNode":
        self._thread = threading.Thread(target=self._run, name="fleet-node", daemon=True)
        self._thread.start()
        return self

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
        while not self._stop.is_set():
            try:
                self.round()
                if not self.available:
                    log.info("fleet: node %s registered in etcd (%s)", self.fleet.node,
                             ", ".join(self.fleet.etcd))
                self.available = True
            except CkptError as err:  # policy: etcd down: the node goes on; tried again
                if self.available or self.rounds == 0:
                    log.warning("fleet: etcd unavailable, the node serves on its own: %s", err)
                self.available = False
            except Exception:  # policy: a bug here must not end the fleet thread for good
                log.exception("fleet: publishing failed")
                self.available = False
            self.rounds += 1
            self._nudge.wait(self.fleet.publish_interval_s)
            self._nudge.clear()

    # ---------------------------------------------------------------- one round

    def round(self) -> None:
        """Register (or renew), claim what is unclaimed, write what changed."""
        now = time.monotonic()
        if self.lease is not None and now - self._renewed >= self.fleet.lease_ttl_s / 3:
            if self.etcd.keepalive(self.lease) <= 0:
                log.warning("fleet: the node's lease expired (etcd was out of reach longer "
                            "than %ds); registering again", self.fleet.lease_ttl_s)
                self.lease = None
            else:
                self._renewed = now
        if self.lease is None:
            self.register()
        names = [eng.name for eng in self.config.engines]
        unclaimed = [n for n in names if n not in self.owned and n not in self.conflicts]
        if unclaimed:
            self.claim(unclaimed)
        self.publish([n for n in names if n in self.owned])

    def register(self) -> None:
        lease = self.etcd.grant(self.fleet.lease_ttl_s)
        rec = NodeRecord(node=self.fleet.node, controller=self.config.endpoint, pid=os.getpid(),
                         host=socket.gethostname(), started=time.time(), version=__version__,
                         lease=lease)
        self.etcd.put(self.keys.node(self.fleet.node), encode(rec), lease=lease)
        self.lease, self._renewed = lease, time.monotonic()
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
                self.owned.add(name)
                self._last_ops.setdefault(name, self._last_op_of(name))
            elif owner is not None:
                self.conflicts[name] = owner
                log.error("fleet: engine %s is registered by node %s; this node does not "
                          "publish it (engine names are unique in the fleet)", name, owner)

    def publish(self, names: list[str]) -> None:
        if not names:
            return
        reply = self._status(names)
        changed: list[EngineRecord] = []
        for view in reply.engines:
            rec = self.record(view)
            if self._written.get(rec.engine) != rec.content():
                changed.append(rec)
        for i in range(0, len(changed), TXN_ENGINES):
            self._write(changed[i:i + TXN_ENGINES])

    def record(self, view) -> EngineRecord:
        eng = self.config.engine(view.engine)
        s = view.status
        last = s.last_transition if s is not None else None
        if view.holder:
            self._last_ops[view.engine] = view.holder
        elif last is not None and self._moved.get(view.engine) != (last.wall, last.generation):
            # the engine moved since the last look: the journal names what moved it
            self._moved[view.engine] = (last.wall, last.generation)
            self._last_ops[view.engine] = self._last_op_of(view.engine)
        return EngineRecord(
            engine=view.engine, node=self.fleet.node, state=s.state if s else None,
            generation=s.generation if s else None, holder=view.holder,
            last_op=self._last_ops.get(view.engine), labels=dict(eng.labels),
            endpoints={"control": eng.control}, reachable=view.reachable,
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
