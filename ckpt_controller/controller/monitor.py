"""Follows every driven engine's heartbeats, so the engine gauges stay current unasked.

``EngineMonitor`` keeps one subscribed ``AgentClient`` per engine, each on a thread of its
own: the agent's heartbeats carry its state and its ``StateChanged`` events the exact time of
each transition, and both go to ``Metrics`` (``ckpt_engine_state``, ``ckpt_engine_up``, ...).
An engine silent for its liveness window (``missed_beats`` heartbeat intervals) is down, state
``unknown``; the thread then reconnects and subscribes again until the engine answers (a
restarted or restored agent forgets its subscribers). It only reads: it journals nothing and
holds no engine, so it never blocks an operation, and ``close`` stops every thread within
about one request timeout. ``watch`` and ``unwatch`` follow an adopted engine and stop
following a given-away one while it runs. Neighbours: ``metrics`` (the gauges), ``agent.client`` and ``rpc``
(subscribe, heartbeats, liveness), ``server`` (starts and closes it), ``config``.
"""

from __future__ import annotations

import logging
import threading
import time

from ckpt_controller import protocol as p
from ckpt_controller.agent.client import AgentClient
from ckpt_controller.controller.config import ControllerConfig, EngineConfig
from ckpt_controller.controller.metrics import Metrics
from ckpt_controller.errors import CkptError
from ckpt_controller.security import CurveClient

log = logging.getLogger("ckpt_controller.monitor")

#: how long a handshake or status request to an engine may take before it counts as down
REQUEST_TIMEOUT_S = 2.0


class EngineMonitor:
    """One thread per driven engine, from ``start`` (or ``watch``) until ``close`` (or
    ``unwatch``)."""

    def __init__(self, config: ControllerConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self._stop = threading.Event()
        #: the pause between two attempts to reach an engine that is down
        self.retry_s = min(REQUEST_TIMEOUT_S, config.heartbeat_interval_s * 2)
        self._lock = threading.Lock()
        #: engine -> its thread and the event that stops that thread alone
        self._watched: dict[str, tuple[threading.Thread, threading.Event]] = {}
        #: threads of engines no longer watched, still ending (joined by ``close``)
        self._ending: list[threading.Thread] = []
        self._started = False

    def start(self) -> EngineMonitor:
        with self._lock:
            self._started = True
        for e in self.config.engines:
            self.watch(e)
        return self

    def watch(self, engine: EngineConfig) -> None:
        """Follow ``engine`` (an adopted one; again, with its new configuration, when it is
        followed already): it is ``unknown`` and down until it answers."""
        self.unwatch(engine.name)
        self.metrics.engines_known([engine.name])
        stop = threading.Event()
        t = threading.Thread(target=self._follow, args=(engine, stop), daemon=True,
                             name=f"monitor-{engine.name}")
        with self._lock:
            if not self._started or self._stop.is_set():
                return
            self._watched[engine.name] = (t, stop)
        t.start()

    def unwatch(self, name: str) -> None:
        """Stop following ``name`` (given away); its thread ends within about one request
        timeout, without waiting here."""
        with self._lock:
            t, stop = self._watched.pop(name, (None, None))
            if t is not None:
                stop.set()
                self._ending = [x for x in self._ending if x.is_alive()] + [t]

    def close(self) -> None:
        """Stop following: each thread closes its client and ends within about one request
        timeout (one still running after three is logged and left). A second call does
        nothing."""
        self._stop.set()
        with self._lock:
            for _, stop in self._watched.values():
                stop.set()
            threads = [t for t, _ in self._watched.values()] + self._ending
        for t in threads:
            if t.is_alive():
                t.join(timeout=3 * REQUEST_TIMEOUT_S)  # a request in flight ends by then
                if t.is_alive():
                    log.warning("%s did not stop in time; left to end with the process", t.name)

    def __enter__(self) -> EngineMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _follow(self, engine: EngineConfig, stop: threading.Event) -> None:
        while not (self._stop.is_set() or stop.is_set()):
            seen: list[bool] = []  # set once the engine answered: an outage is said once
            try:
                self._watch(engine, seen, stop)
                reason = "no heartbeat within its liveness window"
            except CkptError as err:  # policy: unreachable or refused: down, try again soon
                reason = err.message
            except Exception as exc:  # policy: a bug must not end the monitor: log, go on
                log.exception("%s: following heartbeats failed", engine.name)
                reason = repr(exc)
            if stop.is_set():
                return  # unwatched: its gauges are gone, nothing more to say
            self.metrics.engine_up(engine.name, False)
            if seen and not self._stop.is_set():
                log.warning("%s: down (%s)", engine.name, reason)
            stop.wait(self.retry_s)

    def _watch(self, engine: EngineConfig, seen: list[bool], stop: threading.Event) -> None:
        """Subscribe and follow until the heartbeats stop (return) or a request fails
        (raise); returns at once when the monitor closes or stops following the engine."""
        cfg = self.config
        name = engine.name
        with AgentClient(engine.control, timeout_s=REQUEST_TIMEOUT_S, retries=0,
                         heartbeat_interval_s=cfg.heartbeat_interval_s,
                         missed_beats=cfg.missed_beats, name="controller/monitor",
                         curve=None if engine.curve_server_key is None
                         or cfg.curve_secret_key is None
                         else CurveClient(cfg.curve_secret_key, engine.curve_server_key)
                         ) as client:
            client.subscribe()
            status = client.status()
            last = status.last_transition
            self.metrics.engine_seen(name, status.state, last.wall if last else None)
            self.metrics.engine_up(name, True)
            seen.append(True)
            log.info("%s: up, %s", name, status.state)
            heard = time.monotonic()
            while not (self._stop.is_set() or stop.is_set()):
                events = client.poll_events(min(cfg.heartbeat_interval_s, 0.5))
                now = time.monotonic()
                for ev in events:
                    heard = now
                    if isinstance(ev, p.Heartbeat):
                        self.metrics.engine_seen(name, ev.state)
                    elif isinstance(ev, p.StateChanged):
                        t = ev.transition
                        self.metrics.engine_seen(name, t.dest, t.wall)
                if now - heard > client.liveness_s:
                    return
