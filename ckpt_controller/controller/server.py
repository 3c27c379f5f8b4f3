"""The controller's socket in front of ``service.Controller`` (what ``ckptctl serve`` runs,
composed with the fleet in ``ckpt_controller.serve``).

Serves handshake, status, operation, history, heartbeat and subscribe (``watch``: every
journal record as it is written, plus heartbeats). Operations run on their own threads; status
and history queries on the server's bounded workers (``RpcServer.offload``: a burst of them is
shed with ``OverloadedError``); all answer through the outbox, so the control thread never
blocks. It binds its endpoint and the optional Prometheus endpoint (``bind``), then serves
and starts the ``monitor`` that keeps its engine gauges current (``start``); recovering what a
previous controller left unfinished comes between the two (``ckpt_controller.serve``).
Neighbours: ``rpcserver`` (socket loop), ``service``, ``metrics``, ``monitor``; above,
``ckpt_controller.serve`` (the process: this server, recovery, the fleet).
"""

from __future__ import annotations

import logging
import os
import time

from ckpt_controller import protocol as p
from ckpt_controller.controller import openfiles
from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.controller.metrics import Metrics, MetricsServer
from ckpt_controller.controller.monitor import EngineMonitor
from ckpt_controller.controller.service import Controller
from ckpt_controller.rpcserver import RpcServer
from ckpt_controller.security import CurveServer

log = logging.getLogger("ckpt_controller.controller")

#: while operations run, journal records reach subscribers at most about this late: they go
#: with the next message that wakes the control thread (an operation's reply) instead of each
#: waking it, and the thread looks at least this often meanwhile
RECORDS_DELAY_S = 0.02


class ControllerServer(RpcServer):
    serves = frozenset({p.RequestType.HANDSHAKE, p.RequestType.STATUS,
                        p.RequestType.OPERATION, p.RequestType.HISTORY,
                        p.RequestType.COMPACT, p.RequestType.IMAGES})

    def __init__(self, config: ControllerConfig) -> None:
        super().__init__(config.endpoint, name="controller",
                         heartbeat_interval_s=config.heartbeat_interval_s,
                         curve=CurveServer(config.curve_secret_key, config.curve_clients)
                         if config.curve_clients is not None else None)
        self.config = config
        self.metrics = Metrics(capture_deadline_s=config.deadlines.capture)
        self.controller = Controller(
            config, metrics=self.metrics, publish=self.publish,
            publish_records=lambda recs: self.publish_gathered(recs, _journaled))
        # after the controller: its journal's adopted engines count too
        try:  # a roster the open-files limit cannot hold: ConfigError, the start refused
            openfiles.ensure(len(config.engines))
        except Exception:  # policy: close what the controller opened, then refuse
            self.controller.close()
            raise
        self.controller.on_roster.append(self._roster_changed)
        self.metrics_server: MetricsServer | None = None
        self.monitor: EngineMonitor | None = None  # follows heartbeats for the engine gauges
        #: records are being sent lazily (``RECORDS_DELAY_S``): operations run
        self._records_lazy = False

    def bind(self) -> None:
        """Bind the endpoint and the metrics port, serving nothing yet: ``serve`` does this
        before it recovers, so a port in use is refused before any engine is touched."""
        super().bind()
        if self.config.metrics_port is not None and self.metrics_server is None:
            self.metrics_server = MetricsServer(self.metrics, self.config.metrics_host,
                                                self.config.metrics_port, health=self.health)
            log.info("metrics on http://%s:%d/metrics", self.config.metrics_host,
                     self.metrics_server.port)

    def health(self) -> str | None:
        """Why the controller does not serve requests now (None: it does): ``/healthz`` on the
        metrics port answers 503 with this reason, else 200 ``ok``."""
        if self._stop.is_set():
            return "stopping"
        if self._thread is None:
            return "starting: recovering interrupted operations before serving"
        if not self._thread.is_alive():
            return "not serving: the request thread ended"
        return None

    def start(self) -> "ControllerServer":
        if self._router is None:
            self.bind()
        super().start()
        self.controller.start_reconciler()
        self.controller.retention.start()
        if self.config.metrics_port is not None:
            self.monitor = EngineMonitor(self.config, self.metrics).start()
        return self

    def close(self) -> None:
        self.controller.stop()  # running operations end and answer while this still serves
        super().close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.monitor is not None:
            self.monitor.close()
        self.controller.close()

    def _roster_changed(self, name: str, engine) -> None:
        """An engine adopted (``engine`` its config) or given away (None): the monitor
        follows it or stops (the adoption raised the open-files limit already)."""
        monitor = self.monitor
        if monitor is not None:
            if engine is not None:
                monitor.watch(engine)
            else:
                monitor.unwatch(name)

    def before_wait(self) -> None:
        busy = bool(self.controller.admission.running)
        if busy != self._records_lazy:
            self._records_lazy = busy
            self._outbox.set_lazy(busy)

    def wake_by(self) -> float | None:
        return time.monotonic() + RECORDS_DELAY_S if self._records_lazy else None

    def heartbeat_body(self, seq: int) -> p.Heartbeat:
        return p.Heartbeat(engine="controller", state="serving", seq=seq,
                           monotonic=self.clock.monotonic(), incarnation=0)

    def handle(self, identity: bytes, rtype: p.RequestType, cmd: p.Command) -> None:
        call_id = cmd.call_id
        if rtype is p.RequestType.HANDSHAKE:
            self.reply(identity, call_id, p.HandshakeReply(
                protocol_version=p.PROTOCOL_VERSION, engine="controller", pid=os.getpid(),
                incarnation=0, state="serving", heartbeat_interval_s=self.heartbeat_interval_s))
        elif rtype is p.RequestType.HISTORY:
            self.offload(identity, call_id, "HISTORY", lambda: self.controller.history(cmd))
        elif rtype is p.RequestType.COMPACT:
            self.offload(identity, call_id, "COMPACT", self.controller.retention.compact)
        elif rtype is p.RequestType.IMAGES:
            self.controller.status_names(cmd.engines)  # unknown names: a UsageError now
            self.offload(identity, call_id, "IMAGES", lambda: self.controller.images.handle(cmd))
        elif rtype is p.RequestType.OPERATION:
            # the result, or the error of a refusal found by asking the engines
            self.controller.start(cmd, lambda r: self.reply(identity, call_id, r)
                                  if isinstance(r, p.OperationResult)
                                  else self.reply_error(identity, call_id, r))
        else:
            self.controller.status_names(cmd.engines)  # unknown names: a UsageError now
            self.offload(identity, call_id, "STATUS",
                         lambda: self.controller.status(cmd.engines))


def _journaled(records: list[p.JournalRecord]) -> p.EventBody:
    """The event for records gathered in a burst (``RpcServer.publish_gathered``)."""
    return p.Journaled(record=records[0]) if len(records) == 1 else p.JournaledMany(
        records=records)
