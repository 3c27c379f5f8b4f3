"""Which of vLLM's lifecycle APIs the sidecar drives (``sidecar.choose_api``), found from a
server's OpenAPI paths or, without them, by asking each API; and what vLLM's /checkpoint API
cannot do (``native.cannot``), refused before anything moves. Against loopback HTTP stand-ins
(``support.net.LocalHttp``, not vLLM): the real router is ``test_vllm_checkpoint_api.py``'s."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler

import pytest

from ckpt_controller.adapters.vllm.http import VllmHttp
from ckpt_controller.adapters.vllm.native import CheckpointApiEngine, cannot
from ckpt_controller.adapters.vllm.run import choose_api
from ckpt_controller.errors import EngineError, UnsupportedError, UsageError
from ckpt_controller.protocol import PrepareCommand
from ckpt_controller.vocab import EngineApi
from support.net import LocalHttp


def serving(answers: dict[str, tuple[int, object]]) -> LocalHttp:
    """A stand-in answering GET ``path`` with (status, body: JSON, or bytes as they are);
    404 for any other path."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def do_GET(self) -> None:
            status, body = answers.get(self.path, (404, {"detail": "Not Found"}))
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return LocalHttp(Handler)


def openapi(*paths: str) -> tuple[int, dict]:
    return 200, {"openapi": "3.1.0", "paths": {p: {} for p in paths}}


CHECKPOINT = ("/checkpoint/prepare", "/checkpoint/restore", "/checkpoint/status")
DEV = ("/pause", "/resume", "/sleep", "/wake_up", "/is_paused", "/is_sleeping",
       "/collective_rpc")


@pytest.fixture
def server():
    made = []

    def make(answers):
        made.append(serving(answers))
        return VllmHttp(made[-1].url)

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("paths, wanted, expect", [
    (CHECKPOINT, "auto", (EngineApi.VLLM_CHECKPOINT, False)),
    (CHECKPOINT + DEV, "auto", (EngineApi.VLLM_CHECKPOINT, True)),
    (DEV, "auto", (EngineApi.VLLM_DEV, True)),
    (CHECKPOINT + DEV, "dev", (EngineApi.VLLM_DEV, True)),
    (CHECKPOINT + DEV, "checkpoint", (EngineApi.VLLM_CHECKPOINT, False)),
])
def test_the_api_comes_from_the_servers_openapi_paths(server, paths, wanted, expect):
    http = server({"/openapi.json": openapi(*paths, "/v1/completions"),
                   "/version": (200, {"version": "0.34.0"})})
    api, dev, detail, present = choose_api(http, wanted)
    assert (api, dev) == expect
    assert present == ("/pause" in paths)  # the dev-mode API is there, used or not
    assert detail.startswith("vLLM 0.34.0, ")


@pytest.mark.parametrize("paths, wanted, missing", [
    (("/v1/completions",), "auto", "neither /checkpoint/* nor the dev-mode API"),
    (DEV, "checkpoint", "no /checkpoint/*"),
    (CHECKPOINT, "dev", "no dev-mode API"),
    # one checkpoint path of three is not the API
    (("/checkpoint/status",), "auto", "neither"),
])
def test_a_server_without_the_api_asked_for_is_refused_saying_what_turns_it_on(
        server, paths, wanted, missing):
    http = server({"/openapi.json": openapi(*paths)})
    with pytest.raises(UsageError) as caught:
        choose_api(http, wanted)
    assert missing in caught.value.message
    assert "--enable-sleep-mode" in caught.value.details["change"]
    assert "VLLM_SERVER_DEV_MODE=1" in caught.value.details["change"]


@pytest.mark.parametrize("document", [
    (404, {"detail": "Not Found"}),  # --disable-fastapi-docs
    (200, b"not json"),
    (200, b"[" * 100_000 + b"]" * 100_000),  # nested past the parser's limit
    (200, {"paths": ["a", "list"]}),
])
def test_without_an_openapi_document_each_api_is_asked(server, document):
    http = server({"/openapi.json": document,
                   "/checkpoint/status": (503, {"state": "running"})})
    found = http.apis()
    assert (found.checkpoint, found.dev, found.version, found.found_by) == \
        (True, False, None, "probe")
    http = server({"/openapi.json": document, "/is_paused": (200, {"is_paused": False}),
                   "/checkpoint/status": (503, b"<html>not vLLM</html>")})
    found = http.apis()
    assert (found.checkpoint, found.dev) == (False, True)


def test_a_checkpoint_answer_without_a_state_is_an_engine_error(server):
    http = server({"/checkpoint/status": (500, {"state": "exploded"})})
    with pytest.raises(EngineError) as caught:
        http.checkpoint_status()
    assert caught.value.details["http_status"] == 500
    answer = server({"/checkpoint/status": (500, {"state": "failed", "error": "x" * 5000})}
                    ).checkpoint_status()
    assert (answer.http_status, answer.state, len(answer.error)) == (500, "failed", 2000)


def cmd(**fields) -> PrepareCommand:
    return PrepareCommand(call_id=0, op_id="op", **fields)


@pytest.mark.parametrize("fields, reason", [
    ({"level": 1}, "release at level 1"),
    ({"level": 0}, "release at level 0"),
    ({"level": None, "tags": ["weights", "kv_cache"], "on_deadline": "fail"},
     "release weights"),
    ({"level": None, "tags": ["kv_cache"]}, "escalate a wait drain to abort"),
    ({"level": None, "tags": ["kv_cache"], "on_deadline": "keep"}, "to keep"),
])
def test_what_the_checkpoint_api_cannot_do(fields, reason):
    why = cannot(cmd(**fields))
    assert why is not None and reason in why[0], why


@pytest.mark.parametrize("fields", [
    {"level": None, "tags": ["kv_cache"], "on_deadline": "fail"},
    {"level": None, "tags": ["kv_cache"], "drain": "abort"},
    {"level": None, "tags": ["kv_cache", "kv_cache"], "drain": "keep"},
])
def test_what_the_checkpoint_api_can_do(fields):
    assert cannot(cmd(**fields)) is None


def test_what_it_cannot_do_is_refused_or_goes_through_the_dev_mode_api():
    http = VllmHttp("http://127.0.0.1:9")  # never called: the check is local
    alone = CheckpointApiEngine(http, dev=False)
    with pytest.raises(UnsupportedError) as caught:
        alone.check_prepare(cmd(level=2))
    details = caught.value.details
    assert details["api"] == "vllm-checkpoint" and "--tags kv_cache" in details["can"]
    assert "VLLM_SERVER_DEV_MODE=1" in details["change"]
    assert caught.value.exit_code == 2
    both = CheckpointApiEngine(http, dev=True)
    both.check_prepare(cmd(level=2))
    assert both.via is EngineApi.VLLM_DEV
    both.check_prepare(cmd(level=None, tags=["kv_cache"], drain="abort"))
    assert both.via is EngineApi.VLLM_CHECKPOINT


class SlowDrain(BaseHTTPRequestHandler):
    """A stand-in of vLLM's /checkpoint API whose drain takes ``DRAIN_S`` (not vLLM)."""

    DRAIN_S = 1.5
    began: float | None = None

    def log_message(self, *a) -> None:
        pass

    def _send(self, status: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _state(self) -> str:
        if SlowDrain.began is None:
            return "running"
        return "preparing" if time.monotonic() - SlowDrain.began < self.DRAIN_S else "prepared"

    def do_GET(self) -> None:
        if self.path == "/checkpoint/status":
            state = self._state()
            self._send(200 if state == "prepared" else 503, {"state": state})
        elif self.path == "/v1/models":
            self._send(200, {"data": [{"id": "m"}]})
        elif self.path == "/metrics":
            raw = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/checkpoint/prepare"):
            SlowDrain.began = time.monotonic()
            self._send(200, {"state": "preparing"})
        elif self.path == "/v1/completions":
            self._send(200, {"choices": [{"text": " same", "finish_reason": "length"}]})
        else:
            self._send(404, {"detail": "Not Found"})


def test_a_wait_drain_runs_to_its_own_deadline_not_a_step_timeout():
    """The drain is bounded by the drain deadline the operator gave (here 30 s), never by the
    sidecar's per-call timeout (here 0.3 s): a vLLM draining for 1.5 s is waited for."""
    from ckpt_controller.clock import Clock, Deadline

    SlowDrain.began = None
    server = LocalHttp(SlowDrain)
    try:
        engine = CheckpointApiEngine(VllmHttp(server.url), step_timeout_s=0.3, tick_s=0.05)
        command = cmd(level=None, tags=["kv_cache"], on_deadline="fail", drain_timeout_s=30.0)
        engine.check_prepare(command)
        report = engine.drain(command, Deadline.after(None, Clock()), lambda progress: None)
        assert report.mode == "wait" and report.drain_s >= SlowDrain.DRAIN_S
    finally:
        server.close()
