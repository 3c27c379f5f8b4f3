"""The vLLM HTTP client and the sidecar's liveness against a small stand-in HTTP server (no
vLLM needed): metrics parsing, typed errors, the retry of a retryable refusal (what newer
vLLM sends while paused), and heartbeats stopping when the engine stops answering."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from ckpt_controller.adapters.vllm import VllmEngine, VllmHttp
from ckpt_controller.adapters.vllm.http import parse_metrics
from ckpt_controller.adapters.vllm.sidecar import DEAD_AFTER_S
from ckpt_controller.errors import EngineError, UsageError
from support.cli import ckptctl
from support.net import LocalHttp
from support.timing import deadline_in, scaled, wait_until

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 4.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="m"} 1.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e+09
"""


class Stand:
    """A stand-in vLLM: /health, /metrics, /v1/models, and /v1/completions that refuses the
    first ``refuse`` requests with 503 and Retry-After."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse, self.seen, self.healthy = refuse, 0, True
        #: cleared: completions wait for it (a server stopped mid-request, as a dumped one)
        self.answering = threading.Event()
        self.answering.set()
        stand = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: bytes, ctype="application/json", extra=()):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if not stand.healthy:
                    time.sleep(3)  # hangs past the client's timeout
                    return
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/metrics":
                    self._send(200, METRICS.encode(), "text/plain")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": "m"}]}).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/completions":
                    stand.seen += 1
                    stand.answering.wait(60)
                    if stand.seen <= stand.refuse:
                        self._send(503, b'{"error": "paused"}', extra=[("Retry-After", "0.1")])
                        return
                    self._send(200, json.dumps({"choices": [
                        {"text": " hello", "finish_reason": "length"}]}).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')

        self.http = LocalHttp(Handler)
        self.url = self.http.url

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def stand():
    made = []

    def make(**opts) -> Stand:
        made.append(Stand(**opts))
        return made[-1]

    yield make
    for s in made:
        s.close()


class MovingResolver:
    """A resolver that watches: ``move(url)`` names another URL and wakes the watcher."""

    def __init__(self, url: str) -> None:
        self.url, self.wakes = url, []

    def __call__(self, engine: str, kind: str) -> str:
        return self.url

    def watch(self, engine: str, wake) -> None:
        self.wakes.append(wake)

    def move(self, url: str) -> None:
        self.url = url
        for wake in self.wakes:
            wake()

    def close(self) -> None:
        pass


def test_a_watched_vllm_request_is_sent_again_at_once_where_the_registry_names(stand):
    """A request stuck on a stopped server (the source, dumped) is sent again at the new URL
    as soon as the resolver's watch says the engine moved, not when the old connection
    breaks (here: never, until the test lets the old server go)."""
    from ckpt_controller.adapters.vllm.follow import FollowingVllm

    source, target = stand(), stand()
    source.answering.clear()
    resolver = MovingResolver(source.url)
    client = FollowingVllm("v0", resolver, timeout_s=60)
    box: list = []
    t = threading.Thread(target=lambda: box.append(client.complete("hi", 4)), daemon=True)
    try:
        t.start()
        wait_until(lambda: source.seen == 1, what="the request at the stopped source")
        resolver.move(target.url)
        t.join(scaled(10))
        assert box and box[0].text == " hello", box
        assert client.moves == [target.url] and target.seen == 1
    finally:
        source.answering.set()
        t.join(scaled(10))
        client.close()


def test_metrics_are_summed_over_engines_and_reasons():
    m = parse_metrics(METRICS)
    assert (m.running, m.waiting, m.in_flight) == (4, 2, 6)
    assert m.finished == {"stop": 8, "abort": 4}
    later = parse_metrics(METRICS.replace("} 4.0", "} 9.0"))
    assert later.ended_since(m, "abort") == 5 and later.ended_since(m, "stop") == 0


# what a real vLLM writes: TYPE lines (a counter's family drops _total), a sample without
# labels, labels in another order, an escaped quote, a timestamp, histograms around them
TYPED_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a \\"quoted\\" {model}",engine="0"} 5.0 1700000000000
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="length",engine="0"} 3.0
vllm:request_success_total{engine="1",finished_reason="length"} 2.0
vllm:request_success_created{engine="1",finished_reason="length"} 1.7e+09
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf"} 5.0
vllm:e2e_request_latency_seconds_count{engine="0"} 5.0
vllm:e2e_request_latency_seconds_sum{engine="0"} 2.5
"""


def test_metrics_in_every_form_prometheus_writes_them():
    m = parse_metrics(TYPED_METRICS)
    assert (m.running, m.waiting) == (2, 5)
    assert m.finished == {"length": 5}
    with pytest.raises(EngineError, match="not Prometheus text") as info:
        parse_metrics("vllm:num_requests_running{engine=0 3\n")
    assert info.value.details["start"].startswith("vllm:num_requests_running")


def test_a_retryable_refusal_is_retried_then_counted(stand):
    s = stand(refuse=2)
    out = VllmHttp(s.url).complete("p", 4, retry_for_s=10)
    assert out.text == " hello" and out.rejected == 2 and s.seen == 3


def test_a_refusal_past_the_retry_window_is_raised_typed(stand):
    s = stand(refuse=100)
    with pytest.raises(EngineError) as err:
        VllmHttp(s.url).complete("p", 4, retry_for_s=0.3)
    assert err.value.details["http_status"] == 503 and err.value.details["retry_after"] == "0.1"


def test_errors_are_typed(stand):
    s = stand()
    http = VllmHttp(s.url)
    with pytest.raises(EngineError) as err:
        http.request("POST", "/pause", params=[("mode", "wait")])
    assert err.value.details["http_status"] == 404
    assert http.weight_checksums() is None  # no weight checker: None, not an error
    with pytest.raises(EngineError) as err:
        VllmHttp("http://127.0.0.1:9", timeout_s=2).is_paused()
    assert err.value.details["unreachable"] is True


@pytest.mark.parametrize("url", ["ftp://h:1", "127.0.0.1:8000", "http://h:1/v1", "http://:1",
                                 "http://h:1/?x=1"])
def test_bad_urls_are_usage_errors(url):
    with pytest.raises(UsageError):
        VllmHttp(url)


def test_the_engine_counts_as_gone_when_it_stops_answering(stand):
    s = stand()
    engine = VllmEngine(VllmHttp(s.url, timeout_s=1), poll_s=0.05, dead_after_s=0.5).start()
    try:
        time.sleep(0.3)
        assert engine.alive()
        assert engine.request_counts() == (6, 0)
        s.healthy = False
        end = deadline_in(10)
        while engine.alive():
            assert time.monotonic() < end, "a silent engine still counts as alive"
            time.sleep(0.05)
    finally:
        engine.close()
        s.healthy = True


def test_the_engine_counts_as_gone_soon_when_its_port_refuses(stand):
    """vLLM killed, its PID not known (a server on another host, say): the port refuses at
    once, so the engine counts as gone after about a second of refusals, not after the 30 s
    a slow server is given (a status called the sidecar's engine reachable that long)."""
    s = stand()
    engine = VllmEngine(VllmHttp(s.url, timeout_s=1), poll_s=0.05).start()
    try:
        time.sleep(0.3)
        assert engine.alive()
        s.close()  # nothing listens on its port any more
        gone = time.monotonic()
        wait_until(lambda: not engine.alive(), timeout_s=10, every_s=0.05,
                   what="a refusing engine counted as gone")
        assert time.monotonic() - gone < scaled(DEAD_AFTER_S / 3)
    finally:
        engine.close()


def test_the_engine_counts_as_gone_when_its_process_is_gone(stand):
    s = stand()
    engine = VllmEngine(VllmHttp(s.url), pid=2**22 + 12345)
    assert not engine.alive()


def test_cli_refuses_bad_input_with_exit_2_and_no_server_with_exit_4():
    out = ckptctl("agent", "vllm", "--url", "ftp://127.0.0.1:1")
    assert out.returncode == 2 and "http://HOST:PORT" in out.stderr
    out = ckptctl("agent", "vllm", "--url", "http://127.0.0.1:9", "--name", "bad name")
    assert out.returncode == 2
    out = ckptctl("agent", "vllm", "--url", "http://127.0.0.1:9", "--golden-tokens", "0")
    assert out.returncode == 2
    out = ckptctl("agent", "vllm", "--url", "http://127.0.0.1:9")
    assert out.returncode == 4 and "no vLLM server answers" in out.stderr
    assert "--golden-prompt" in ckptctl("agent", "vllm", "--help").stdout
