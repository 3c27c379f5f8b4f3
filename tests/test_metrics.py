"""Prometheus metrics: the rendered text parses line by line as exposition format 0.0.4, a real
HTTP scrape on a free port returns it, and concurrent updates add up."""

from __future__ import annotations

import logging
import math
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest

from ckpt_controller.controller.metrics import (
    CONTENT_TYPE,
    PHASE_BUCKETS,
    Metrics,
    MetricsServer,
)
from ckpt_controller.errors import ConfigError

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


def test_render_is_valid_exposition_text():
    m = Metrics()
    m.operation_finished("prepare", "ok")
    m.operation_finished("prepare", "ok")
    m.operation_finished("restore", "failed")
    m.transition("engine-a", "running", "preparing")
    m.transition("engine-a", "preparing", "prepared")
    observations = [0.0005, 0.001, 0.2, 0.2, 7.0, 299.0, 1000.0]
    for s in observations:
        m.phase("drain", s)
    m.phase("release", 0.03)
    m.drained(completed=5, aborted=2, kept=0)
    m.drained(completed=1, aborted=0, kept=3)
    m.freed_bytes(1 << 30)
    m.freed_bytes(512)
    m.engine_states({"running": 3, "prepared": 1})
    types, samples = parse(m.render())
    assert types == {"ckpt_operations_total": "counter", "ckpt_transitions_total": "counter",
                     "ckpt_phase_duration_seconds": "histogram",
                     "ckpt_drained_requests_total": "counter", "ckpt_freed_bytes_total": "counter",
                     "ckpt_engines": "gauge"}
    assert values(samples, "ckpt_operations_total") == {
        (("kind", "prepare"), ("outcome", "ok")): 2, (("kind", "restore"), ("outcome", "failed")): 1}
    assert values(samples, "ckpt_transitions_total")[
        (("dest", "prepared"), ("engine", "engine-a"), ("source", "preparing"))] == 1
    assert values(samples, "ckpt_drained_requests_total") == {
        (("outcome", "completed"),): 6, (("outcome", "aborted"),): 2, (("outcome", "kept"),): 3}
    assert values(samples, "ckpt_freed_bytes_total") == {(): (1 << 30) + 512}
    assert values(samples, "ckpt_engines") == {(("state", "running"),): 3,
                                               (("state", "prepared"),): 1}

    buckets = [(float(labels["le"]), v) for n, labels, v in samples
               if n == "ckpt_phase_duration_seconds_bucket" and labels["phase"] == "drain"]
    assert [le for le, _ in buckets] == [*PHASE_BUCKETS, math.inf]
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))  # cumulative
    for le, count in buckets:
        assert count == sum(1 for s in observations if s <= le)
    count = values(samples, "ckpt_phase_duration_seconds_count")
    total = values(samples, "ckpt_phase_duration_seconds_sum")
    assert count[(("phase", "drain"),)] == len(observations) == buckets[-1][1]
    assert total[(("phase", "drain"),)] == pytest.approx(sum(observations))
    assert count[(("phase", "release"),)] == 1


def test_fresh_registry_renders_zeroes():
    types, samples = parse(Metrics().render())
    assert len(types) == 6
    assert {n for n, _, _ in samples} == {"ckpt_drained_requests_total", "ckpt_freed_bytes_total"}
    assert all(v == 0 for _, _, v in samples)


def test_engine_states_replace_the_gauge():
    m = Metrics()
    m.engine_states({"running": 2})
    m.engine_states({"prepared": 2})
    assert values(parse(m.render())[1], "ckpt_engines") == {(("state", "running"),): 0,
                                                            (("state", "prepared"),): 2}


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
                                  lambda m: m.engine_states({"running": -1}),
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
        assert 'ckpt_operations_total{kind="cycle",outcome="ok"} 1' in body
        m.freed_bytes(10)
        assert "ckpt_freed_bytes_total 10\n" in get(f"{base}/metrics?x=1")[2]
        status, _, body = get(f"{base}/other")
        assert status == 404 and "/metrics" in body
    server.close()  # a second close does nothing
    assert capsys.readouterr().err == ""  # requests are logged, not written to stderr
    logged = [r.getMessage() for r in caplog.records if r.name == "ckpt_controller.metrics"]
    assert any("GET /metrics" in line and "200" in line for line in logged)
    assert any("GET /other" in line and "404" in line for line in logged)
    with pytest.raises(urllib.error.URLError):
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{base}/metrics",
                                                                          timeout=2)


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
            m.phase("drain", 0.02)
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
    assert values(samples, "ckpt_operations_total") == {(("kind", "prepare"), ("outcome", "ok")): n}
    assert sum(values(samples, "ckpt_transitions_total").values()) == n
    assert values(samples, "ckpt_phase_duration_seconds_count") == {(("phase", "drain"),): n}
    assert values(samples, "ckpt_drained_requests_total") == {
        (("outcome", "completed"),): n, (("outcome", "aborted"),): 2 * n,
        (("outcome", "kept"),): 3 * n}
    assert values(samples, "ckpt_freed_bytes_total") == {(): 7 * n}
