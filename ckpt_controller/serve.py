"""The process ``ckptctl serve`` runs: a node's controller and, with ``[fleet]``, its part in
the fleet, composed above both (nothing in ``controller/`` knows the fleet exists).

``NodeService`` holds the controller's server and, on a node whose TOML has ``[fleet]``, its
``fleet.node.FleetNode`` with the controller's guard (``fleet.guard.FleetGuard``: fleet locks,
the fleet's count of engines out of service, a migration's take-over). The order matters and
is kept in one place, ``serve``: bind first (an endpoint or metrics port in use is refused
before anything is touched); the fleet's guard next, made but not started (nothing waits for
etcd), so a restore that recovery finishes asks it too (an engine adopted by a migration is
resumed only while etcd names this node its owner); then recovery of what a previous
controller left unfinished; then serve (no new operation touches an engine being reconciled:
requests wait in the socket meanwhile), and register in etcd.
Neighbours: ``controller.server`` (``ControllerServer``), ``fleet.node``, ``fleet.guard``,
``sdnotify``, ``procutil`` (the stop signals); above, ``cli.controller_cmds``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading

from ckpt_controller import criu_images
from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.controller.server import ControllerServer
from ckpt_controller.endpoints import check_local_address, resolve_host
from ckpt_controller.procutil import StopSignals

log = logging.getLogger("ckpt_controller.controller")


class NodeService:
    """A node controller's server, and with ``[fleet]`` its fleet node (``fleet``)."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.server = ControllerServer(config)
        self.fleet = None  # with [fleet]: the node's registration in etcd (fleet.node)

    def attach_fleet(self) -> None:
        """For a node with [fleet]: its ``FleetNode`` and the controller's guard, made, not
        started. The fleet layer is loaded only here."""
        if self.config.fleet is None or self.fleet is not None:
            return
        from ckpt_controller.fleet.guard import FleetGuard
        from ckpt_controller.fleet.node import FleetNode

        address = self.config.fleet.address  # the host's name unless given
        ip = resolve_host(address)  # ConfigError: a name that does not resolve
        check_local_address(address, ip)  # ConfigError: not this node's to listen on
        if ipaddress.ip_address(ip).is_loopback:
            log.warning("fleet: this node's address %s is %s, a loopback address: no other "
                        "host or network namespace reaches it (give [fleet] address)",
                        address, ip)
        for pid in criu_images.reap_page_servers(self.config.image_dir):
            log.warning("fleet: ended criu page-server %d, left running by an earlier "
                        "controller killed during a migration", pid)
        self.fleet = FleetNode(self.config, self.server.controller)
        self.server.controller.guard = FleetGuard(self.fleet)

    def start(self) -> "NodeService":
        """Serve (binding first if ``bind`` was not called), and with ``[fleet]`` register in
        etcd; without a recovery first (``serve`` runs one between the two)."""
        self.attach_fleet()
        self.server.start()
        if self.fleet is not None:
            self.fleet.start()
        return self

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        self.server.close()


def serve(config: ControllerConfig, ready=None, notifier=None) -> None:
    """Run the node's controller until SIGTERM/SIGINT: bind, reconcile, then serve (module
    doc). ``ready(info)`` is called once it serves; ``notifier`` (an ``sdnotify.Notifier``)
    is told READY=1 then, pinged while its control thread runs, and told STOPPING=1 when it
    stops."""
    node = NodeService(config)
    server = node.server
    stop = StopSignals()  # from here a SIGTERM waits for the cleanup below
    # a SIGTERM during the recovery below ends it at once (what it has not settled stays
    # running in the journal, for the next start): it once waited out a stalled agent's 60 s
    def stop_recovery() -> None:
        stop.stop.wait()
        server.controller.stopping.set()

    threading.Thread(target=stop_recovery, name="stop-recovery", daemon=True).start()
    try:
        server.bind()
        node.attach_fleet()
        recovered = server.controller.recover()
        if stop.stop.is_set():
            return
        node.start()
        for result in recovered:
            log.warning("recovered interrupted operation %s (%s): %s", result.op_id, result.kind,
                        ", ".join(f"{o.engine} {o.state}"
                                  + (f" ({o.error.message})" if o.error else "")
                                  for o in result.engines))
        if ready is not None:
            ready({"event": "ready", "endpoint": server.endpoint, "pid": os.getpid(),
                   "state_dir": str(config.state_dir), "recovered": len(recovered),
                   "metrics_port": server.metrics_server.port if server.metrics_server else None})
        if notifier is not None:
            notifier.ready(f"serving {server.endpoint}: {len(config.engines)} engines, "
                           f"{len(recovered)} operations recovered",
                           last_round=lambda: server.last_round,
                           rounds_within=server.rounds_within)
        stop.wait()
    finally:
        if notifier is not None:
            notifier.stopping()
        node.close()
