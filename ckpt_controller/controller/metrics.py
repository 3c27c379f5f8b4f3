"""Prometheus metrics of the controller: a small thread-safe registry and its HTTP endpoint.

Written by hand in the text exposition format 0.0.4, with no client library. Families:
operations by kind and outcome, lifecycle transitions, drained requests by outcome and freed
bytes (counters), phase durations (a histogram) and engines per state (a gauge).
Neighbours: the controller's operations and server feed ``Metrics``; ``MetricsServer`` serves
``GET /metrics`` for a Prometheus scrape on ``controller.metrics_host:metrics_port`` (config).
"""

from __future__ import annotations

import bisect
import http.server
import logging
import math
import socket
import threading
from collections.abc import Mapping
from urllib.parse import urlsplit

from ckpt_controller.errors import ConfigError

log = logging.getLogger("ckpt_controller.metrics")

#: Upper bounds (seconds) of the phase-duration buckets; ``+Inf`` follows implicitly.
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DRAIN_OUTCOMES = ("completed", "aborted", "kept")


class Metrics:
    """The controller's counters, histogram and gauge. Every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._operations: dict[tuple[str, str], int] = {}
        self._transitions: dict[tuple[str, str, str], int] = {}
        self._buckets: dict[str, list[int]] = {}  # per bucket, not cumulative; last is +Inf
        self._sums: dict[str, float] = {}
        self._drained = dict.fromkeys(DRAIN_OUTCOMES, 0)
        self._freed = 0
        self._engines: dict[str, int] = {}

    def operation_finished(self, kind: str, outcome: str) -> None:
        """Count one finished operation (``kind`` prepare/restore/..., ``outcome`` ok/failed/...)."""
        key = (str(kind), str(outcome))
        with self._lock:
            self._operations[key] = self._operations.get(key, 0) + 1

    def transition(self, engine: str, source: str, dest: str) -> None:
        """Count one lifecycle transition of ``engine``."""
        key = (str(engine), str(source), str(dest))
        with self._lock:
            self._transitions[key] = self._transitions.get(key, 0) + 1

    def phase(self, phase: str, seconds: float) -> None:
        """Observe one phase (drain, release, capture, ...) that took ``seconds``."""
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a phase duration must be a finite number >= 0, got {seconds!r}")
        index = bisect.bisect_left(PHASE_BUCKETS, seconds)  # the first bound >= seconds
        with self._lock:
            counts = self._buckets.setdefault(str(phase), [0] * (len(PHASE_BUCKETS) + 1))
            counts[index] += 1
            self._sums[str(phase)] = self._sums.get(str(phase), 0.0) + seconds

    def drained(self, completed: int, aborted: int, kept: int) -> None:
        """Count the requests one drain completed, aborted and kept."""
        counts = dict(zip(DRAIN_OUTCOMES, (completed, aborted, kept), strict=True))
        for outcome, n in counts.items():
            _check_count(f"drained {outcome}", n)
        with self._lock:
            for outcome, n in counts.items():
                self._drained[outcome] += n

    def freed_bytes(self, n: int) -> None:
        """Count ``n`` bytes of memory freed by a release."""
        _check_count("freed bytes", n)
        with self._lock:
            self._freed += n

    def engine_states(self, counts: Mapping[str, int]) -> None:
        """Set how many engines are in each state; states seen before and absent now read 0."""
        for state, n in counts.items():
            _check_count(f"engines in {state}", n)
        with self._lock:
            self._engines = {**dict.fromkeys(self._engines, 0),
                             **{str(state): n for state, n in counts.items()}}

    def render(self) -> str:
        """All metrics as exposition text (format 0.0.4), ending with a newline."""
        with self._lock:  # copy under the lock, format outside it
            operations, transitions = dict(self._operations), dict(self._transitions)
            buckets = {phase: list(c) for phase, c in self._buckets.items()}
            sums, drained = dict(self._sums), dict(self._drained)
            freed, engines = self._freed, dict(self._engines)
        out: list[str] = []
        _family(out, "ckpt_operations_total", "counter", "Operations finished, by kind and outcome.",
                [({"kind": k, "outcome": o}, n) for (k, o), n in sorted(operations.items())])
        _family(out, "ckpt_transitions_total", "counter", "Lifecycle transitions, by engine.",
                [({"engine": e, "source": s, "dest": d}, n)
                 for (e, s, d), n in sorted(transitions.items())])
        _family(out, "ckpt_phase_duration_seconds", "histogram",
                "How long each phase of an operation took.", [])
        for phase in sorted(buckets):
            total = 0
            for bound, n in zip((*PHASE_BUCKETS, math.inf), buckets[phase], strict=True):
                total += n
                _sample(out, "ckpt_phase_duration_seconds_bucket",
                        {"phase": phase, "le": _number(float(bound))}, total)
            _sample(out, "ckpt_phase_duration_seconds_sum", {"phase": phase}, sums[phase])
            _sample(out, "ckpt_phase_duration_seconds_count", {"phase": phase}, total)
        _family(out, "ckpt_drained_requests_total", "counter",
                "In-flight requests drained before a release, by outcome.",
                [({"outcome": o}, n) for o, n in drained.items()])
        _family(out, "ckpt_freed_bytes_total", "counter", "Bytes of memory freed by releases.",
                [({}, freed)])
        _family(out, "ckpt_engines", "gauge", "Engines in each lifecycle state.",
                [({"state": s}, n) for s, n in sorted(engines.items())])
        return "\n".join(out) + "\n"


class MetricsServer:
    """Serves ``GET /metrics`` (404 elsewhere) from a daemon thread until ``close()``.

    ``port`` 0 binds any free port; ``.port`` is the one bound. A port that cannot be bound
    raises ``ConfigError``. Requests are logged to ``ckpt_controller.metrics`` at DEBUG.
    """

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("MetricsHandler", (_Handler,), {"metrics": metrics})
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
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # a scraper that hangs up mid-reply is its own problem: log quietly, keep serving
        log.debug("metrics request from %s failed", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    metrics: Metrics
    server_version = "ckpt-controller-metrics"

    def do_GET(self) -> None:  # noqa: N802 - the name http.server looks up
        if urlsplit(self.path).path == "/metrics":
            self._reply(200, self.metrics.render().encode("utf-8"), CONTENT_TYPE)
        else:
            self._reply(404, b"not found; metrics are at /metrics\n", "text/plain; charset=utf-8")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        log.debug("%s %s", self.address_string(), format % args)


def _family(out: list[str], name: str, kind: str, help_text: str,
            samples: list[tuple[dict[str, str], float]]) -> None:
    escaped = help_text.replace("\\", "\\\\").replace("\n", "\\n")  # HELP escapes these two
    out.append(f"# HELP {name} {escaped}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        _sample(out, name, labels, value)


def _sample(out: list[str], name: str, labels: dict[str, str], value: float) -> None:
    text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
    out.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")


def _escape(value: str) -> str:
    """A label value as the format wants it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(value)


def _check_count(what: str, n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{what} must be an integer >= 0 (counters only grow), got {n!r}")
