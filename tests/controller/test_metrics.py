"""Prometheus metrics: the rendered text parses line by line as exposition format 0.0.4, a real
HTTP scrape on a free port returns it, concurrent updates add up, the journal's records count
hook failures, escalations and reconciles, and a real ``ckptctl serve`` keeps every engine's
state gauges current from its heartbeats, with no ``status`` call."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.agent.client import AgentClient
from ckpt_controller.controller.config import ControllerConfig, EngineConfig
from ckpt_controller.controller.metrics import (
    CONTENT_TYPE,
    OPERATION_OUTCOMES,
    PHASE_BUCKETS,
    STATES,
    Metrics,
    MetricsServer,
)
from ckpt_controller.controller.monitor import EngineMonitor
from ckpt_controller.errors import ConfigError
from ckpt_controller.vocab import CheckpointState, HookPoint, OperationKind
from support.config import engines_toml
from support.hooks import write_hook
from support.timing import deadline_in, scaled

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"({_NAME})(?:\{{(.*)\}})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')
_SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """A strict reader of the text format: returns ({family: type}, [(name, labels, value)])."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helped: set[str] = set()
    samples = []
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert re.fullmatch(_NAME, name) and name not in helped
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name in helped and name not in types and kind in _SUFFIXES
            types[name] = kind
        else:
            m = _SAMPLE.fullmatch(line)
            assert m, line
            name, raw, value = m.groups()
            labels = {}
            pos = 0
            while raw and pos < len(raw):
                lm = _LABEL.match(raw, pos)
                assert lm, (line, pos)
                key, escaped = lm.group(1), lm.group(2)
                assert key not in labels
                labels[key] = re.sub(r"\\(.)", lambda c: {"n": "\n"}.get(c.group(1), c.group(1)),
                                     escaped)
                pos = lm.end()
            family = [f for f, kind in types.items()
                      if any(name == f + s for s in _SUFFIXES[kind])]
            assert family == [list(types)[-1]], f"{name} is not in the family declared last"
            samples.append((name, labels, float(value)))
    return types, samples


def values(samples, name):
    return {tuple(sorted(labels.items())): v for n, labels, v in samples if n == name}


def counted(samples, name):
    """``values`` of the series that counted anything (every series of a counter is there at
    0 from the start or from when its engine is known)."""
    return {k: v for k, v in values(samples, name).items() if v}


def test_render_is_valid_exposition_text():
    m = Metrics()
    m.operation_finished("prepare", "ok")
    m.operation_finished("prepare", "ok")
    m.operation_finished("restore", "failed")
    m.transition("engine-a", "running", "preparing")
    m.transition("engine-a", "preparing", "prepared")
    observations = [0.0005, 0.001, 0.2, 0.2, 7.0, 299.0, 1000.0]
    for s in observations:
        m.phase("drain", s, engine="engine-a")
    m.phase("release", 0.03, engine="engine-a")
    m.drained(completed=5, aborted=2, kept=0)
    m.drained(completed=1, aborted=0, kept=3)
    m.freed_bytes(1 << 30)
    m.freed_bytes(512)
    m.engines_known(["engine-a", "engine-b"])
    m.engine_seen("engine-a", "prepared")
    types, samples = parse(m.render())
    assert types == {"ckpt_operations_total": "counter", "ckpt_transitions_total": "counter",
                     "ckpt_phase_duration_seconds": "histogram",
                     "ckpt_drained_requests_total": "counter", "ckpt_freed_bytes_total": "counter",
                     "ckpt_hook_failures_total": "counter",
                     "ckpt_drain_escalations_total": "counter", "ckpt_reconciles_total": "counter",
                     "ckpt_engines": "gauge", "ckpt_engine_state": "gauge",
                     "ckpt_engine_up": "gauge", "ckpt_engine_state_since_timestamp_seconds": "gauge",
                     "ckpt_last_successful_cycle_timestamp_seconds": "gauge",
                     "ckpt_image_bytes": "gauge",
                     "ckpt_engine_capture_deadline_seconds": "gauge",
                     "ckpt_images_bytes": "gauge"}
    assert counted(samples, "ckpt_operations_total") == {
        (("kind", "prepare"), ("outcome", "ok")): 2, (("kind", "restore"), ("outcome", "failed")): 1}
    assert values(samples, "ckpt_transitions_total")[
        (("dest", "prepared"), ("engine", "engine-a"), ("source", "preparing"))] == 1
    assert values(samples, "ckpt_drained_requests_total") == {
        (("outcome", "completed"),): 6, (("outcome", "aborted"),): 2, (("outcome", "kept"),): 3}
    assert values(samples, "ckpt_freed_bytes_total") == {(): (1 << 30) + 512}
    assert values(samples, "ckpt_engines") == {
        (("state", s),): {"prepared": 1, "unknown": 1}.get(s, 0) for s in STATES}

    buckets = [(float(labels["le"]), v) for n, labels, v in samples
               if n == "ckpt_phase_duration_seconds_bucket" and labels["phase"] == "drain"
               and labels["engine"] == "engine-a"]
    assert [le for le, _ in buckets] == [*PHASE_BUCKETS, math.inf]
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))  # cumulative
    for le, count in buckets:
        assert count == sum(1 for s in observations if s <= le)
    count = values(samples, "ckpt_phase_duration_seconds_count")
    total = values(samples, "ckpt_phase_duration_seconds_sum")
    drain, release = (("engine", "engine-a"), ("phase", "drain")), \
        (("engine", "engine-a"), ("phase", "release"))
    assert count[drain] == len(observations) == buckets[-1][1]
    assert total[drain] == pytest.approx(sum(observations))
    assert count[release] == 1


def test_fresh_registry_renders_zeroes():
    types, samples = parse(Metrics().render())
    assert len(types) == 16
    assert {n for n, _, _ in samples} == {"ckpt_drained_requests_total", "ckpt_freed_bytes_total",
                                          "ckpt_engines", "ckpt_operations_total"}
    assert len(values(samples, "ckpt_operations_total")) == (
        len(OperationKind) * len(OPERATION_OUTCOMES))  # each kind and outcome, at 0
    assert all(v == 0 for _, _, v in samples)
    assert {labels["state"] for n, labels, _ in samples if n == "ckpt_engines"} == set(STATES)


def engine_states(samples) -> dict[str, dict[str, float]]:
    """engine -> {state: value} of ``ckpt_engine_state``."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, v in samples:
        if name == "ckpt_engine_state":
            out.setdefault(labels["engine"], {})[labels["state"]] = v
    return out


def test_engine_state_gauges_carry_every_state_for_every_engine():
    m = Metrics()
    m.engines_known(["a", "b"])
    _, samples = parse(m.render())
    assert engine_states(samples) == {e: {s: float(s == "unknown") for s in STATES}
                                      for e in ("a", "b")}
    assert values(samples, "ckpt_engine_up") == {(("engine", "a"),): 0, (("engine", "b"),): 0}
    m.engine_up("a", True)
    m.engine_seen("a", "running", since_wall=1000.5)
    m.engine_up("b", True)
    m.engine_seen("b", "running")
    m.engine_seen("b", "failed", since_wall=2000.25)
    _, samples = parse(m.render())
    assert engine_states(samples) == {"a": {s: float(s == "running") for s in STATES},
                                      "b": {s: float(s == "failed") for s in STATES}}
    assert values(samples, "ckpt_engines") == {
        (("state", s),): {"running": 1, "failed": 1}.get(s, 0) for s in STATES}
    assert values(samples, "ckpt_engine_state_since_timestamp_seconds") == {
        (("engine", "a"),): 1000.5, (("engine", "b"),): 2000.25}
    m.engine_seen("b", "failed")  # a heartbeat in the same state keeps the time of entry
    m.engine_up("a", False)  # heartbeats stopped: down, state unknown
    _, samples = parse(m.render())
    assert values(samples, "ckpt_engine_state_since_timestamp_seconds")[(("engine", "b"),)] \
        == 2000.25
    assert engine_states(samples)["a"] == {s: float(s == "unknown") for s in STATES}
    assert values(samples, "ckpt_engine_up") == {(("engine", "a"),): 0, (("engine", "b"),): 1}
    assert values(samples, "ckpt_engines") == {
        (("state", s),): {"unknown": 1, "failed": 1}.get(s, 0) for s in STATES}
    with pytest.raises(ValueError, match="unknown engine state 'serving'"):
        m.engine_seen("a", "serving")


def test_capture_deadline_is_exported_per_known_engine_and_goes_with_it():
    m = Metrics(capture_deadline_s=42.5)
    m.engines_known(["a", "b"])
    deadlines = values(parse(m.render())[1], "ckpt_engine_capture_deadline_seconds")
    assert deadlines == {(("engine", "a"),): 42.5, (("engine", "b"),): 42.5}
    m.engine_forgotten("a")
    assert values(parse(m.render())[1], "ckpt_engine_capture_deadline_seconds") == {
        (("engine", "b"),): 42.5}
    none = Metrics()  # no deadline given: no series
    none.engines_known(["a"])
    assert values(parse(none.render())[1], "ckpt_engine_capture_deadline_seconds") == {}
    for bad in (0, -1.0, math.inf, math.nan, "600"):
        with pytest.raises(ValueError, match="capture deadline"):
            Metrics(capture_deadline_s=bad)


def record(type_: str, engine: str | None, **data) -> p.JournalRecord:
    return p.JournalRecord(seq=1, op_id="op", engine=engine, type=type_, wall=0.0, monotonic=0.0,
                           data=data)


def test_journal_records_count_hook_failures_escalations_and_reconciles():
    m = Metrics()
    hook = {"path": "/h", "duration_s": 0.1, "stdout_tail": "", "stderr_tail": ""}
    for rec in [record("hook", "a", point="dump", exit_code=0, timed_out=False, **hook),
                record("hook", "a", point="dump", exit_code=7, timed_out=False, **hook),
                record("hook", "a", point="post-restore", exit_code=None, timed_out=True, **hook),
                record("hook", "b", point="dump", exit_code=-9, timed_out=False, **hook),
                record("drain", "a", mode="wait", escalated_to=None, completed=3),
                record("drain", "a", mode="wait", escalated_to="abort", aborted=2),
                record("drain", "b", mode="wait", escalated_to="keep", kept=1),
                record("reconciled", "a", found="prepared", now="running"),
                record("reconciled", "a", found="prepared", now="running"),
                record("transition", "a", trigger="prepare", source="running", dest="preparing",
                       generation=0, reason=""),
                record("operation_end", None, status="succeeded", duration_s=1.0)]:
        m.journaled(rec)
    _, samples = parse(m.render())
    assert values(samples, "ckpt_hook_failures_total") == {
        (("engine", "a"), ("point", "dump")): 1, (("engine", "a"), ("point", "post-restore")): 1,
        (("engine", "b"), ("point", "dump")): 1}
    assert values(samples, "ckpt_drain_escalations_total") == {
        (("engine", "a"), ("to", "abort")): 1, (("engine", "b"), ("to", "keep")): 1}
    assert values(samples, "ckpt_reconciles_total") == {
        (("engine", "a"), ("found", "prepared")): 2}
    assert values(samples, "ckpt_transitions_total") == {}  # counted by the session, not here


def test_a_known_engines_counters_are_there_at_zero_and_go_with_it():
    """A dashboard's increase() cannot count a series' first sample: every series of an
    engine's counters is there at 0 once the engine is known, and goes when it is given away."""
    m = Metrics()
    m.engines_known(["a"])
    _, samples = parse(m.render())
    assert values(samples, "ckpt_hook_failures_total") == {
        (("engine", "a"), ("point", h.value)): 0 for h in HookPoint}
    assert values(samples, "ckpt_drain_escalations_total") == {
        (("engine", "a"), ("to", to)): 0 for to in ("abort", "keep")}
    assert values(samples, "ckpt_reconciles_total") == {
        (("engine", "a"), ("found", s.value)): 0 for s in CheckpointState}
    m.journaled(record("hook", "a", point="dump", exit_code=7, timed_out=False))
    _, samples = parse(m.render())
    assert counted(samples, "ckpt_hook_failures_total") == {
        (("engine", "a"), ("point", "dump")): 1}
    m.engine_forgotten("a")
    _, samples = parse(m.render())
    for name in ("ckpt_hook_failures_total", "ckpt_drain_escalations_total",
                 "ckpt_reconciles_total"):
        assert values(samples, name) == {}, name
    m.engines_known(["a"])  # adopted again: at 0 again (a new series to Prometheus)
    _, samples = parse(m.render())
    assert counted(samples, "ckpt_hook_failures_total") == {}


def test_a_successful_cycle_dates_its_engines_and_a_capture_sizes_its_image(tmp_path):
    m = Metrics()
    ok = p.EngineOutcome(engine="a", status="succeeded", state="running")
    bad = p.EngineOutcome(engine="b", status="failed", state="failed")
    m.operation_finished("prepare", "succeeded", [ok])  # not a cycle
    before = time.time()
    m.operation_finished("cycle", "failed", [ok, bad])
    after = time.time()
    m.operation_finished("cycle", "refused")
    _, samples = parse(m.render())
    (stamp,) = values(samples, "ckpt_last_successful_cycle_timestamp_seconds").items()
    assert stamp[0] == (("engine", "a"),) and before <= stamp[1] <= after
    assert values(samples, "ckpt_operations_total")[
        (("kind", "cycle"), ("outcome", "refused"))] == 1
    image = tmp_path / "image"
    (image / "sub").mkdir(parents=True)
    (image / "pages-1.img").write_bytes(b"x" * 5000)
    (image / "sub" / "core.img").write_bytes(b"y" * 123)
    (image / "link").symlink_to(image / "pages-1.img")  # not counted twice
    m.image_written("a", image)
    assert values(parse(m.render())[1], "ckpt_image_bytes") == {(("engine", "a"),): 5123}


def test_label_values_are_escaped():
    m = Metrics()
    nasty = 'a\\b"c\nd'
    m.transition(nasty, "running", "failed")
    m.phase(nasty, 0.1)
    text = m.render()
    assert 'engine="a\\\\b\\"c\\nd"' in text
    _, samples = parse(text)  # every line still parses: no raw newline leaked into a label
    assert {labels.get("engine") for n, labels, _ in samples if n == "ckpt_transitions_total"} \
        == {nasty}
    assert {labels["phase"] for n, labels, _ in samples if n.endswith("_count")} == {nasty}


@pytest.mark.parametrize("call", [lambda m: m.freed_bytes(-1), lambda m: m.drained(1, -1, 0),
                                  lambda m: m.phase("x", -0.1), lambda m: m.phase("x", math.nan),
                                  lambda m: m.engine_seen("e", "sleeping"),
                                  lambda m: m.freed_bytes(1.5)])
def test_bad_values_are_refused(call):
    m = Metrics()
    with pytest.raises(ValueError):
        call(m)
    assert m.render() == Metrics().render()


def get(url: str) -> tuple[int, str, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with opener.open(url, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as err:  # a 4xx/5xx reply: return it like any other
        with err:
            return err.code, err.headers["Content-Type"], err.read().decode()


def test_http_endpoint_serves_metrics_and_404_elsewhere(caplog, capsys):
    caplog.set_level(logging.DEBUG, logger="ckpt_controller.metrics")
    m = Metrics()
    m.operation_finished("cycle", "ok")
    with MetricsServer(m, "127.0.0.1", 0) as server:
        assert server.port > 0
        base = f"http://127.0.0.1:{server.port}"
        status, ctype, body = get(f"{base}/metrics")
        assert (status, ctype) == (200, CONTENT_TYPE)
        assert body == m.render()
        assert 'ckpt_operations_total{kind="cycle",outcome="ok"} 1.0' in body
        m.freed_bytes(10)
        assert "ckpt_freed_bytes_total 10.0\n" in get(f"{base}/metrics?x=1")[2]
        status, _, body = get(f"{base}/other")
        assert status == 404 and "/metrics" in body and "/healthz" in body
    server.close()  # a second close does nothing
    assert capsys.readouterr().err == ""  # requests are logged, not written to stderr
    logged = [r.getMessage() for r in caplog.records if r.name == "ckpt_controller.metrics"]
    assert any("GET /metrics" in line and "200" in line for line in logged)
    assert any("GET /other" in line and "404" in line for line in logged)
    with pytest.raises(urllib.error.URLError):
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{base}/metrics",
                                                                          timeout=2)


def request(port: int, method: str, path: str, body: bytes | None = None):
    """One raw request: (status, headers, body) as the server sent them."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body)
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def test_healthz_head_and_other_methods(caplog):
    caplog.set_level(logging.DEBUG, logger="ckpt_controller.metrics")
    m = Metrics()
    m.operation_finished("cycle", "succeeded")
    reason: list[str | None] = [None]
    with MetricsServer(m, "127.0.0.1", 0, health=lambda: reason[0]) as server:
        port = server.port
        assert request(port, "GET", "/healthz")[::2] == (200, b"ok\n")
        reason[0] = "starting: recovering"
        status, headers, body = request(port, "GET", "/healthz?verbose")
        assert (status, body) == (503, b"starting: recovering\n")
        assert headers["Content-Type"] == "text/plain; charset=utf-8"
        reason[0] = None
        # HEAD: GET's status and headers, Content-Length included, and no body
        for path, status, ctype in [("/metrics", 200, CONTENT_TYPE),
                                    ("/healthz", 200, "text/plain; charset=utf-8"),
                                    ("/nowhere", 404, "text/plain; charset=utf-8")]:
            got, headers, body = request(port, "HEAD", path)
            _, get_headers, get_body = request(port, "GET", path)
            assert (got, headers["Content-Type"], body) == (status, ctype, b"")
            assert int(headers["Content-Length"]) == len(get_body) > 0
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"):
            status, headers, body = request(port, method, "/metrics", body=b"x=1")
            assert status == 405, method
            assert headers["Allow"] == "GET, HEAD"
            assert body == f"method {method} not allowed; use GET or HEAD\n".encode()
        assert request(port, "GET", "/metrics")[0] == 200  # still serving
    logged = [r.getMessage() for r in caplog.records if r.name == "ckpt_controller.metrics"]
    assert any("HEAD /metrics" in line and "200" in line for line in logged)
    assert any("BREW /metrics" in line and "405" in line for line in logged)


def test_a_burst_of_connections_is_answered_not_left_to_time_out():
    """Many clients at once (probes, scrapers, a curl loop): the kernel queues them for the
    accept loop, so each gets its answer, or is closed at once when all slots are taken;
    with socketserver's default backlog of 5 the SYNs beyond it were dropped and the
    clients waited out their timeouts (1 s, 3 s... of SYN retries)."""
    with MetricsServer(Metrics(), "127.0.0.1", 0) as server:
        assert server._server.request_queue_size >= 128

        def probe(_: int) -> object:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz",
                                            timeout=5) as reply:
                    return reply.status
            except (ConnectionError, http.client.RemoteDisconnected):  # policy: refused
                return "closed"  # at once: all slots taken, the client retries later
            except (TimeoutError, urllib.error.URLError) as err:  # policy: the defect itself
                return type(err).__name__

        with concurrent.futures.ThreadPoolExecutor(200) as pool:
            got = list(pool.map(probe, range(400)))
    assert set(got) <= {200, "closed"}, sorted(map(str, set(got)))
    assert got.count(200) > 0


def test_a_controllers_healthz_says_whether_it_serves(ipc_dir):
    """Bound but not serving yet (recovery runs between ``bind`` and ``start``): 503 saying
    so; serving: 200 ok; stopping: 503."""
    from ckpt_controller.controller.server import ControllerServer

    cfg = ControllerConfig(endpoint=f"ipc://{ipc_dir}/ctl", state_dir=ipc_dir / "state",
                           hooks_dir=None, image_dir=ipc_dir / "images", metrics_port=0,
                           engines=())
    server = ControllerServer(cfg)
    try:
        server.bind()
        url = f"http://127.0.0.1:{server.metrics_server.port}/healthz"
        assert get(url)[::2] == (503, "starting: recovering interrupted operations before "
                                      "serving\n")
        server.start()
        assert get(url)[::2] == (200, "ok\n")
        server._stop.set()  # what close() does first, before the metrics port goes
        assert get(url)[::2] == (503, "stopping\n")
    finally:
        server.close()


def test_a_taken_port_is_a_config_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            MetricsServer(Metrics(), "127.0.0.1", port)


def test_concurrent_updates_add_up():
    m = Metrics()
    threads_n, rounds = 8, 500
    start = threading.Barrier(threads_n)

    def work(i: int) -> None:
        start.wait()
        for _ in range(rounds):
            m.operation_finished("prepare", "ok")
            m.transition(f"e{i % 2}", "running", "preparing")
            m.phase("drain", 0.02, engine=f"e{i % 2}")
            m.drained(1, 2, 3)
            m.freed_bytes(7)
            m.render()  # readers run alongside writers

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = threads_n * rounds
    _, samples = parse(m.render())
    assert counted(samples, "ckpt_operations_total") == {(("kind", "prepare"), ("outcome", "ok")): n}
    assert sum(values(samples, "ckpt_transitions_total").values()) == n
    assert values(samples, "ckpt_phase_duration_seconds_count") == {
        (("engine", "e0"), ("phase", "drain")): n // 2,
        (("engine", "e1"), ("phase", "drain")): n // 2}
    assert values(samples, "ckpt_drained_requests_total") == {
        (("outcome", "completed"),): n, (("outcome", "aborted"),): 2 * n,
        (("outcome", "kept"),): 3 * n}
    assert values(samples, "ckpt_freed_bytes_total") == {(): 7 * n}


# ---------------------------------------------------------------- a real controller's gauges


def engines_config(*engines) -> str:
    return "metrics_port = 0\nmissed_beats = 6\n" + engines_toml(*engines)


def scrape(port: int) -> list:
    return parse(get(f"http://127.0.0.1:{port}/metrics")[2])[1]


def wait_for(port: int, check, timeout_s: float = 20.0):
    """Scrape until ``check(samples)`` is true; returns (samples, seconds it took)."""
    start, limit = time.monotonic(), scaled(timeout_s)
    while True:
        samples = scrape(port)
        if check(samples):
            return samples, time.monotonic() - start
        assert time.monotonic() - start < limit, engine_states(samples)
        time.sleep(0.05)


def in_state(engine: str, state: str):
    return lambda samples: engine_states(samples).get(engine, {}).get(state) == 1


@pytest.mark.slow  # three reference engines start: about 25 s on 2 loaded cores
def test_engine_gauges_follow_heartbeats_with_no_status_call(spawn_reference, spawn_controller,
                                                            ipc_dir):
    """Nobody asks for ``status``: the controller's heartbeat subscriptions keep every engine's
    state current, every state series present, and ``ckpt_engine_up`` at 0 for a killed engine
    until it is started again."""
    a, b = spawn_reference("ga"), spawn_reference("gb")
    (ipc_dir / "hooks").mkdir(mode=0o700)
    ctl = spawn_controller(engines_config(a, b))
    port = ctl.info["metrics_port"]
    samples, _ = wait_for(port, lambda s: in_state("ga", "running")(s)
                          and in_state("gb", "running")(s))
    assert engine_states(samples) == {e: {s: float(s == "running") for s in STATES}
                                      for e in ("ga", "gb")}
    assert values(samples, "ckpt_engine_up") == {(("engine", "ga"),): 1, (("engine", "gb"),): 1}
    assert values(samples, "ckpt_engines")[(("state", "running"),)] == 2

    with AgentClient(a.control, timeout_s=10) as agent:  # behind the controller's back
        reply = agent.prepare(op_id="direct", drain="abort", level=1)
    assert reply.state == "prepared"
    samples, took = wait_for(port, in_state("ga", "prepared"), timeout_s=10)
    assert took < scaled(3.0)  # seen within about a heartbeat
    assert engine_states(samples)["gb"]["running"] == 1
    assert values(samples, "ckpt_engines")[(("state", "prepared"),)] == 1
    entered = reply.transitions[-1]
    assert entered.dest == "prepared"
    assert values(samples, "ckpt_engine_state_since_timestamp_seconds")[(("engine", "ga"),)] \
        == pytest.approx(entered.wall, abs=0.5)

    b.kill9()  # no goodbye: only the missing heartbeats tell
    samples, took = wait_for(port, lambda s: values(s, "ckpt_engine_up")[(("engine", "gb"),)] == 0,
                             timeout_s=15)
    assert took < scaled(8.0)  # the liveness window: 6 beats of 0.2 s, and slack
    assert engine_states(samples)["gb"] == {s: float(s == "unknown") for s in STATES}
    assert values(samples, "ckpt_engine_up")[(("engine", "ga"),)] == 1
    spawn_reference("gb")  # the same endpoints: the controller subscribes again
    samples, _ = wait_for(port, lambda s: values(s, "ckpt_engine_up")[(("engine", "gb"),)] == 1
                          and in_state("gb", "running")(s), timeout_s=30)
    assert not [line for line in (ctl.dir / "controller.log").read_text().splitlines()
                if "Traceback" in line]


def test_a_cycle_dates_the_engine_and_times_its_phases_per_engine(spawn_reference,
                                                                  spawn_controller, ipc_dir):
    """A cycle sets the engine's last-success time, its phases carry ``engine``, the dump
    hook's image is measured and a failing (logged-only) hook is counted."""
    eng = spawn_reference("gc")
    hooks = ipc_dir / "hooks"  # the controller's hooks_dir
    for point, body in [("dump", 'head -c 4096 /dev/zero > "$CKPT_IMAGE_DIR/pages.img"'),
                        ("post-resume", "exit 3")]:  # post-resume: logged only
        write_hook(hooks, point, "50-test", body)
    ctl = spawn_controller(engines_config(eng))
    port = ctl.info["metrics_port"]
    assert get(f"http://127.0.0.1:{port}/healthz")[::2] == (200, "ok\n")  # it serves
    before = time.time()
    out = ctl.ckptctl("cycle", "gc", "--json")
    after = time.time()
    assert out.returncode == 0, out.stdout + out.stderr
    samples = scrape(port)
    stamp = values(samples, "ckpt_last_successful_cycle_timestamp_seconds")[(("engine", "gc"),)]
    assert before <= stamp <= after
    count = values(samples, "ckpt_phase_duration_seconds_count")
    assert count[(("engine", "gc"), ("phase", "capture"))] == 1
    assert count[(("engine", "gc"), ("phase", "restore"))] == 1
    op = json.loads(out.stdout)["op_id"]  # its image: 4096 bytes and the capture's manifest
    manifest = ipc_dir / "state" / "images" / "gc" / op / "ckpt-manifest.json"
    assert values(samples, "ckpt_image_bytes") == {
        (("engine", "gc"),): 4096 + manifest.stat().st_size}
    assert values(samples, "ckpt_engine_capture_deadline_seconds") == {
        (("engine", "gc"),): 600.0}  # [deadlines] capture, its default
    # every series of these counters is there (at 0 until counted): the dashboards'
    # increase() then sees each first failure
    assert counted(samples, "ckpt_hook_failures_total") == {
        (("engine", "gc"), ("point", "post-resume")): 1}
    assert len(values(samples, "ckpt_hook_failures_total")) == len(HookPoint)
    assert counted(samples, "ckpt_operations_total") == {
        (("kind", "cycle"), ("outcome", "succeeded")): 1}
    assert len(values(samples, "ckpt_drain_escalations_total")) == 2
    assert len(values(samples, "ckpt_reconciles_total")) == len(CheckpointState)
    assert values(samples, "ckpt_transitions_total")[
        (("dest", "preparing"), ("engine", "gc"), ("source", "running"))] == 1


def test_monitor_stops_promptly_while_following_and_while_retrying(spawn_reference, ipc_dir):
    eng = spawn_reference("gm")
    cfg = ControllerConfig(endpoint=f"ipc://{ipc_dir}/ctl", state_dir=ipc_dir / "state",
                           hooks_dir=None, image_dir=ipc_dir / "images", heartbeat_interval_s=0.2,
                           engines=(EngineConfig("gm", eng.control),
                                    EngineConfig("nobody", f"ipc://{ipc_dir}/nobody.ctl")))
    m = Metrics()
    monitor = EngineMonitor(cfg, m).start()
    try:
        deadline = deadline_in(20)
        while values(parse(m.render())[1], "ckpt_engine_up")[(("engine", "gm"),)] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # "nobody" has failed an attempt or two meanwhile
        samples = parse(m.render())[1]
        assert engine_states(samples)["nobody"]["unknown"] == 1
        assert engine_states(samples)["gm"]["running"] == 1
    finally:
        start = time.monotonic()
        monitor.close()
        took = time.monotonic() - start
    assert took < scaled(4.0, below=3 * 2.0)  # one request timeout (2 s), not the 6 s join
    assert not [t for t in threading.enumerate() if t.name.startswith("monitor-")]


def test_clients_trickling_their_headers_do_not_keep_healthz_down():
    """Every slot taken by a client sending its request a byte every second (each byte
    reset the idle timeout: /healthz stayed down as long as they trickled): each is closed
    once its headers have taken ``REQUEST_DEADLINE_S``, and /healthz answers again while they
    go on trying."""
    import socket

    from ckpt_controller.controller.metrics import MAX_CONNECTIONS, REQUEST_DEADLINE_S

    with MetricsServer(Metrics(), "127.0.0.1", 0) as server:
        stop = threading.Event()
        closed = []

        def trickle(_: int) -> None:
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
                try:
                    for ch in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                        if stop.is_set():
                            break
                        s.sendall(bytes([ch]))
                        time.sleep(1.0)
                    s.settimeout(5)
                    if s.recv(1) == b"":  # the server hung up on it
                        closed.append(True)
                except OSError:  # policy: the server closed it: what is tested
                    closed.append(True)

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(MAX_CONNECTIONS) as pool:
            for i in range(MAX_CONNECTIONS):
                pool.submit(trickle, i)
            time.sleep(0.5)
            answered = None
            while time.monotonic() - started < scaled(REQUEST_DEADLINE_S + 10):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz",
                                                timeout=5) as reply:
                        if reply.status == 200:
                            answered = time.monotonic() - started
                            break
                except (OSError, http.client.HTTPException):  # policy: slots still held
                    pass
                time.sleep(0.2)
            stop.set()
        assert answered is not None, "healthz never answered while clients trickled"
        assert answered < scaled(REQUEST_DEADLINE_S + 3, below=60), answered
        assert len(closed) == MAX_CONNECTIONS  # each trickler was cut off
