"""Prometheus metrics of the controller: one registry (``prometheus_client``) and its endpoint.

Counters: operations by kind and outcome, lifecycle transitions, drained requests by outcome,
freed bytes, hook failures, drain escalations and reconciles; each series but the transitions'
is there at 0 from the start or from when its engine is known (a dashboard's ``increase()``
cannot count a series' first sample). A histogram of phase durations by phase and engine. Gauges
per engine, kept current by ``monitor`` from the engines' heartbeats (nobody has to ask for
``status``): its state (``ckpt_engine_state``, every state present, 1 for the current one),
whether it is up, since when it is in its state, its last successful cycle and the size of its
last capture's image and of all its images, and its capture deadline (``[deadlines] capture``,
for the alert on an engine left PREPARED); and ``ckpt_engines``, engines per state. Neighbours:
``service`` and ``session`` report operations, ``journaled`` reads the journal's records as they
are written, ``monitor`` reports what heartbeats say; ``MetricsServer`` serves ``GET``/``HEAD``
on ``/metrics`` and ``/healthz`` on ``controller.metrics_host:metrics_port`` (config), its
health asked of ``server.ControllerServer``. deploy/prometheus/ holds alert rules and
deploy/grafana/ a dashboard written against these names (tests/controller/test_prometheus.py)."""

from __future__ import annotations

import http.server
import io
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

import prometheus_client as prom

from ckpt_controller import protocol as p
from ckpt_controller.criu_images import image_bytes
from ckpt_controller.errors import ConfigError
from ckpt_controller.vocab import (CheckpointState, Escalation, HookPoint, OperationKind,
                                   OperationStatus, OutcomeStatus)

log = logging.getLogger("ckpt_controller.metrics")

# a ``*_created`` series per counter and histogram only doubles what a scrape shows
prom.disable_created_metrics()

#: Upper bounds (seconds) of the phase-duration buckets; ``+Inf`` follows implicitly.
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
#: the methods the endpoint answers; any other is 405 with this ``Allow``
ALLOWED_METHODS = "GET, HEAD"
#: connections the metrics endpoint serves at once (a thread each); one more is closed at once
MAX_CONNECTIONS = 16
#: seconds a metrics connection may stay silent (or not read its answer) before it is closed
IDLE_TIMEOUT_S = 5.0
#: seconds a request's line and headers may take to arrive, all of them: a client trickling
#: a byte every few seconds is closed then (a few such held every slot: /healthz went down)
REQUEST_DEADLINE_S = 5.0
DRAIN_OUTCOMES = ("completed", "aborted", "kept")
#: the state of an engine whose heartbeats stopped, or that was never reached
UNKNOWN = "unknown"
#: every value ``ckpt_engine_state`` and ``ckpt_engines`` carry in their ``state`` label
STATES = (*(s.value for s in CheckpointState), UNKNOWN)
#: every outcome ``ckpt_operations_total`` counts (``refused``: turned away before it began)
OPERATION_OUTCOMES = (*(s.value for s in OperationStatus if s != OperationStatus.RUNNING),
                      "refused")
#: what a wait drain escalates to (``ckpt_drain_escalations_total``'s ``to``)
ESCALATED_TO = (Escalation.ABORT.value, Escalation.KEEP.value)


class Metrics:
    """The controller's metrics in a registry of their own. Every method is thread-safe.

    ``capture_deadline_s``: the seconds a capture may take (``[deadlines] capture``), exported
    per known engine as ``ckpt_engine_capture_deadline_seconds``; None leaves it out."""

    #: the record types ``journaled`` counts anything of (a caller may skip the others)
    COUNTED_RECORDS = frozenset({"hook", "drain", "reconciled"})

    def __init__(self, capture_deadline_s: float | None = None) -> None:
        if capture_deadline_s is not None and not (
                isinstance(capture_deadline_s, int | float) and math.isfinite(capture_deadline_s)
                and capture_deadline_s > 0):
            raise ValueError("a capture deadline must be a finite number of seconds > 0, got "
                             f"{capture_deadline_s!r}")
        self._capture_deadline_s = capture_deadline_s
        self.registry = r = prom.CollectorRegistry(auto_describe=True)
        self._operations = prom.Counter("ckpt_operations", "Operations finished, by kind and "
                                        "outcome.", ["kind", "outcome"], registry=r)
        self._transitions = prom.Counter("ckpt_transitions", "Lifecycle transitions, by engine.",
                                         ["engine", "source", "dest"], registry=r)
        self._phases = prom.Histogram("ckpt_phase_duration_seconds", "How long each phase of an "
                                      "operation took, by phase and engine.",
                                      ["phase", "engine"], buckets=PHASE_BUCKETS, registry=r)
        self._drained = prom.Counter("ckpt_drained_requests", "In-flight requests drained "
                                     "before a release, by outcome.", ["outcome"], registry=r)
        self._freed = prom.Counter("ckpt_freed_bytes", "Bytes of memory freed by releases.",
                                   registry=r)
        self._hook_failures = prom.Counter(
            "ckpt_hook_failures", "Hook runs that exited non-zero or timed out, by engine and "
            "point.", ["engine", "point"], registry=r)
        self._escalations = prom.Counter(
            "ckpt_drain_escalations", "Wait drains escalated at their deadline, by engine and "
            "what they escalated to.", ["engine", "to"], registry=r)
        self._reconciles = prom.Counter(
            "ckpt_reconciles", "Engines an interrupted operation left behind that the "
            "controller settled, by engine and the state it found.", ["engine", "found"],
            registry=r)
        self._engines = prom.Gauge("ckpt_engines", "Configured engines in each state (unknown: "
                                   "no heartbeat).", ["state"], registry=r)
        self._state = prom.Gauge("ckpt_engine_state", "1 for the engine's current state, 0 for "
                                 "the others (unknown: no heartbeat).", ["engine", "state"],
                                 registry=r)
        self._up = prom.Gauge("ckpt_engine_up", "1 while the engine's heartbeats arrive.",
                              ["engine"], registry=r)
        self._since = prom.Gauge("ckpt_engine_state_since_timestamp_seconds",
                                 "When the engine entered its current state (Unix time).",
                                 ["engine"], registry=r)
        self._last_cycle = prom.Gauge("ckpt_last_successful_cycle_timestamp_seconds",
                                      "When the engine's last successful cycle ended (Unix "
                                      "time).", ["engine"], registry=r)
        self._image = prom.Gauge("ckpt_image_bytes", "Size of the engine's last captured "
                                 "image.", ["engine"], registry=r)
        self._images_bytes = prom.Gauge(
            "ckpt_images_bytes", "Bytes all of the engine's capture images take on disk "
            "([images] keep bounds them).", ["engine"], registry=r)
        self._capture_deadline = prom.Gauge(
            "ckpt_engine_capture_deadline_seconds", "Seconds the engine's capture may take "
            "([deadlines] capture); an engine PREPARED longer is stuck.", ["engine"], registry=r)
        self._lock = threading.Lock()
        #: (metric, label values) -> its child: ``labels()`` takes a lock and builds a key on
        #: every call, the most of what counting a transition or a phase costs
        self._children: dict[tuple, object] = {}
        #: engine -> its state as last seen, and how many engines are in each state
        self._current: dict[str, str] = {}
        self._per_state: dict[str, int] = dict.fromkeys(STATES, 0)
        #: engines given away: their gauges are gone and stay gone until adopted again
        self._forgotten: set[str] = set()
        for state in STATES:
            self._engines.labels(state).set(0)
        # every series a counter can have is there at 0 from the start (its kind and outcome
        # are known) or from when its engine is known (``engines_known``): Prometheus's
        # increase() cannot count a series' first sample, so one born at 1 (the first hook
        # failure of an engine) would read 0 on a dashboard
        for outcome in DRAIN_OUTCOMES:
            self._drained.labels(outcome)
        for kind in OperationKind:
            for outcome in OPERATION_OUTCOMES:
                self._child(self._operations, kind.value, outcome)

    def _child(self, metric, *labels: str):
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:  # two threads may both make it: labels() returns the same child
            child = self._children[key] = metric.labels(*labels)
        return child

    # ---------------------------------------------------------------- operations

    def operation_finished(self, kind: str, outcome: str,
                           engines: Iterable[p.EngineOutcome] = ()) -> None:
        """Count one finished operation (``kind`` prepare/restore/..., ``outcome`` succeeded/
        failed/refused/...); ``engines``' outcomes of a cycle date each engine's last
        successful cycle."""
        self._child(self._operations, str(kind), str(outcome)).inc()
        if kind == OperationKind.CYCLE:
            now = time.time()
            for o in engines:
                if o.status == OutcomeStatus.SUCCEEDED:
                    self.last_cycle(o.engine, now)

    def last_cycle(self, engine: str, wall: float) -> None:
        """``engine``'s last successful cycle ended at ``wall`` (Unix time); also how a
        restarted controller carries it over from its journal."""
        self._last_cycle.labels(str(engine)).set(wall)

    def transition(self, engine: str, source: str, dest: str) -> None:
        """Count one lifecycle transition of ``engine``."""
        self._child(self._transitions, str(engine), str(source), str(dest)).inc()

    def phase(self, phase: str, seconds: float, engine: str = "") -> None:
        """Observe one phase (drain, release, capture, ...) of ``engine`` that took
        ``seconds``."""
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a phase duration must be a finite number >= 0, got {seconds!r}")
        self._child(self._phases, str(phase), str(engine)).observe(seconds)

    def drained(self, completed: int, aborted: int, kept: int) -> None:
        """Count the requests one drain completed, aborted and kept."""
        counts = dict(zip(DRAIN_OUTCOMES, (completed, aborted, kept), strict=True))
        for outcome, n in counts.items():
            _check_count(f"drained {outcome}", n)
        for outcome, n in counts.items():
            if n:
                self._child(self._drained, outcome).inc(n)

    def freed_bytes(self, n: int) -> None:
        """Count ``n`` bytes of memory freed by a release."""
        _check_count("freed bytes", n)
        self._freed.inc(n)

    def image_written(self, engine: str, image_dir: Path | None) -> None:
        """Set ``engine``'s image size from what a capture left in ``image_dir`` (None: it
        dumped nothing, 0)."""
        self._image.labels(str(engine)).set(0 if image_dir is None else image_bytes(image_dir))

    def images_bytes(self, engine: str, n: int) -> None:
        """``engine``'s capture images take ``n`` bytes on disk (counted again after a
        capture or a prune)."""
        with self._lock:
            if engine in self._forgotten:
                return
        self._images_bytes.labels(str(engine)).set(n)

    def journaled(self, rec: p.JournalRecord) -> None:
        """Count what one journal record tells: a failed hook run, a drain escalation, an
        engine reconciled. Other records are not counted here."""
        engine = rec.engine or ""
        data = rec.data
        if rec.type == "hook" and (data.get("timed_out") or data.get("exit_code") != 0):
            self._child(self._hook_failures, engine, str(data.get("point"))).inc()
        elif rec.type == "drain" and data.get("escalated_to"):
            self._child(self._escalations, engine, str(data["escalated_to"])).inc()
        elif rec.type == "reconciled":
            self._child(self._reconciles, engine, str(data.get("found"))).inc()

    # ---------------------------------------------------------------- engines (heartbeats)

    def _engine_counters(self, engine: str) -> list[tuple[object, tuple[str, ...]]]:
        """Every (counter, label values) series of ``engine``: its hook failures at each
        point, drain escalations to each word, reconciles from each state."""
        return ([(self._hook_failures, (engine, h.value)) for h in HookPoint]
                + [(self._escalations, (engine, to)) for to in ESCALATED_TO]
                + [(self._reconciles, (engine, s.value)) for s in CheckpointState])

    def engines_known(self, names: Iterable[str]) -> None:
        """Declare the configured engines: each is ``unknown`` and down until it is seen;
        its counters are there at 0."""
        for name in names:
            with self._lock:
                self._forgotten.discard(name)
            for metric, labels in self._engine_counters(name):
                self._child(metric, *labels)
            self._up.labels(name).set(0)
            if self._capture_deadline_s is not None:
                self._capture_deadline.labels(name).set(self._capture_deadline_s)
            self.engine_seen(name, UNKNOWN)

    def engine_seen(self, engine: str, state: str, since_wall: float | None = None) -> None:
        """``engine`` is in ``state``, since ``since_wall`` when known (a transition's wall
        time), else since now if the state is new. A state outside ``STATES`` is a
        ``ValueError``."""
        if state not in STATES:
            raise ValueError(f"unknown engine state {state!r}; states: {', '.join(STATES)}")
        with self._lock:  # one engine's gauges and the per-state counts change together
            if engine in self._forgotten:
                return
            before = self._current.get(engine)
            changed = before != state
            self._current[engine] = state
            if changed:
                for s in STATES:
                    self._state.labels(engine, s).set(1 if s == state else 0)
                # counted as they change: a count over every engine at each change made a
                # cycle of N engines cost N * N
                if before is not None:
                    self._per_state[before] -= 1
                    self._engines.labels(before).set(self._per_state[before])
                self._per_state[state] += 1
                self._engines.labels(state).set(self._per_state[state])
            if since_wall is not None:
                self._since.labels(engine).set(since_wall)
            elif changed:
                self._since.labels(engine).set(time.time())

    def engine_forgotten(self, engine: str) -> None:
        """``engine`` was given away: its gauges go, it leaves the per-state counts, and
        what its monitor thread still reports (until it stops) is ignored."""
        with self._lock:
            self._forgotten.add(engine)
            before = self._current.pop(engine, None)
            if before is not None:
                self._per_state[before] -= 1
                self._engines.labels(before).set(self._per_state[before])
            for metric, labels in ((self._up, [(engine,)]), (self._since, [(engine,)]),
                                   (self._last_cycle, [(engine,)]), (self._image, [(engine,)]),
                                   (self._images_bytes, [(engine,)]),
                                   (self._capture_deadline, [(engine,)]),
                                   (self._state, [(engine, s) for s in STATES]),
                                   *((m, [v]) for m, v in self._engine_counters(engine))):
                for values in labels:
                    try:
                        metric.remove(*values)
                    except KeyError:  # policy: a series never set: nothing to remove
                        pass
                    self._children.pop((id(metric), *values), None)

    def engine_up(self, engine: str, up: bool) -> None:
        """Whether ``engine``'s heartbeats arrive; one that goes down is in state ``unknown``."""
        with self._lock:
            if engine in self._forgotten:
                return
            self._up.labels(engine).set(1 if up else 0)
        if not up:
            self.engine_seen(engine, UNKNOWN)

    # ---------------------------------------------------------------- exposition

    def render(self) -> str:
        """All metrics as exposition text (format 0.0.4), ending with a newline."""
        return prom.generate_latest(self.registry).decode("utf-8")


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` (404 elsewhere) from a daemon thread until
    ``close()``: ``GET`` and ``HEAD`` (the same status and headers, no body); any other method
    is 405 with ``Allow: GET, HEAD``.

    ``/healthz`` is 200 ``ok`` while ``health()`` returns None, else 503 with the reason it
    returned (the default: always healthy). ``port`` 0 binds any free port; ``.port`` is the one
    bound. A port that cannot be bound raises ``ConfigError``. Requests are logged to
    ``ckpt_controller.metrics`` at DEBUG.
    """

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0,
                 health: Callable[[], str | None] = lambda: None) -> None:
        handler = type("MetricsHandler", (_Handler,),
                       {"metrics": metrics, "health": staticmethod(health)})
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("MetricsHTTPServer", (_Server,), {"address_family": family})
        try:
            self._server = server_class((host, port), handler)
        except OSError as err:  # a taken port or a bad host is the operator's to fix: say which
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}",
                              host=host, port=port, problem=str(err)) from None
        self.host, self.port = host, self._server.server_address[1]
        self._closed = False
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,),
                                        name=f"metrics-http-{self.port}", daemon=True)
        self._thread.start()
        log.debug("serving metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        """Stop serving and close the socket; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Server(http.server.ThreadingHTTPServer):
    """One thread per connection, at most ``MAX_CONNECTIONS`` at once: one more is closed at
    once (a scraper retries next interval), so idle or slow clients cannot pile up threads in
    the controller, which its operations need."""

    daemon_threads = True
    #: the listen backlog: a burst of clients waits in the kernel for the accept loop (which
    #: answers or closes each at once) instead of having its SYNs dropped and timing out, as
    #: socketserver's default of 5 did
    request_queue_size = 128

    def __init__(self, *args, **kw) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kw)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("metrics: %d connections open, %s refused", MAX_CONNECTIONS,
                      client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # policy: no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        # a scraper that hangs up mid-reply is its own problem: log quietly, keep serving
        log.debug("metrics request from %s failed", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    metrics: Metrics
    health: Callable[[], str | None]
    server_version = "ckpt-controller-metrics"
    #: a connection silent (or not reading) this long is closed, and its thread ends
    timeout = IDLE_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self._deadline = _Deadline(self.connection)
        self.rfile = io.BufferedReader(self._deadline)

    def handle_one_request(self) -> None:
        self._deadline.until = time.monotonic() + REQUEST_DEADLINE_S  # each request anew
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()  # the headers are in: the answer gets the idle bound
        self._deadline.until = math.inf
        self.connection.settimeout(self.timeout)
        return ok

    def do_GET(self) -> None:  # noqa: N802 - the name http.server looks up
        self._reply(*self._answer())

    def do_HEAD(self) -> None:  # noqa: N802 - the name http.server looks up
        self._reply(*self._answer(), with_body=False)

    def __getattr__(self, name: str):
        # http.server looks up do_<METHOD> for each request: every method other than GET and
        # HEAD (POST, PUT, DELETE, OPTIONS, any token at all) is 405, not the base's 501
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self._reply(405, f"method {self.command} not allowed; use GET or HEAD\n".encode(), TEXT,
                    extra={"Allow": ALLOWED_METHODS})

    def _answer(self) -> tuple[int, bytes, str]:
        path = urlsplit(self.path).path
        if path == "/metrics":
            return 200, self.metrics.render().encode("utf-8"), CONTENT_TYPE
        if path == "/healthz":
            reason = self.health()
            if reason is None:
                return 200, b"ok\n", TEXT
            return 503, f"{reason}\n".encode(), TEXT
        return 404, b"not found; metrics are at /metrics, health at /healthz\n", TEXT

    def _reply(self, status: int, body: bytes, content_type: str, *, with_body: bool = True,
               extra: dict[str, str] | None = None) -> None:
        """``status`` with ``body``'s headers; ``with_body`` False (HEAD): the headers only."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        log.debug("%s %s", self.address_string(), format % args)


class _Deadline(io.RawIOBase):
    """A connection's input with one deadline (``until``) for a request's line and headers
    together: each receive may wait only what is left of it, then ``TimeoutError`` (which
    http.server answers by closing the connection)."""

    def __init__(self, conn) -> None:
        self._conn, self.until = conn, math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's line and headers took too long")
        self._conn.settimeout(min(left, IDLE_TIMEOUT_S))
        return self._conn.recv_into(buffer)


def _check_count(what: str, n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{what} must be an integer >= 0 (counters only grow), got {n!r}")
