"""A real vLLM CPU server (``make vllm``) and the dev-mode behaviours the vLLM adapter must
live with, pinned so a vLLM upgrade that changes them is noticed. Marked ``vllm``: run with
``make test PYTEST_ARGS="-m vllm"``; skips, saying why, without the vLLM venv."""

from __future__ import annotations

import json
import urllib.request

import pytest

from support.vllm import NO_VLLM, VLLM_PY

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=NO_VLLM),
]


@pytest.fixture
def vllm_url(vllm_server):
    return vllm_server.url


def call(url: str, path: str, method: str = "GET", body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"{}")


def complete(url: str) -> list[str]:
    out = call(url, "/v1/completions", "POST", {"prompt": "the engine drains", "max_tokens": 8,
                                                "temperature": 0})
    return [c["text"] for c in out["choices"]]


def test_paused_reads_as_sleeping_and_resume_undoes_it(vllm_url):
    assert call(vllm_url, "/is_paused") == {"is_paused": False}
    assert call(vllm_url, "/pause?mode=wait", "POST")["status"] == "paused"
    assert call(vllm_url, "/is_paused")["is_paused"] is True
    assert call(vllm_url, "/is_sleeping")["is_sleeping"] is True  # merely paused
    call(vllm_url, "/resume", "POST")
    assert call(vllm_url, "/is_paused")["is_paused"] is False
    assert call(vllm_url, "/is_sleeping")["is_sleeping"] is False


def test_sleep_and_a_full_wake_up_resume_and_complete_the_same(vllm_url):
    golden = complete(vllm_url)
    assert call(vllm_url, "/sleep?level=1", "POST")["status"] == "sleeping"
    assert call(vllm_url, "/is_paused")["is_paused"] is True
    call(vllm_url, "/collective_rpc", "POST", {"method": "checkpoint_prepare"})
    half = call(vllm_url, "/wake_up?tags=weights", "POST")
    assert half["status"] == "sleeping"  # the KV cache still sleeps
    assert call(vllm_url, "/wake_up?tags=kv_cache", "POST")["status"] == "awake"
    assert call(vllm_url, "/is_paused")["is_paused"] is False  # a full wake-up resumes
    assert complete(vllm_url) == golden


def _stream(url: str, prompt: str, tokens: int, out: dict) -> None:
    """A streaming completion: its data lines, in ``out[prompt]``."""
    model = call(url, "/v1/models")["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out[prompt] = [line.decode().strip() for line in resp if line.strip()]


def _finish(lines: list[str]) -> str | None:
    """The finish reason a stream's chunks gave, if any."""
    reasons = [json.loads(line[6:])["choices"][0].get("finish_reason")
               for line in lines if line.startswith("data: {")]
    return next((r for r in reversed(reasons) if r), None)


@pytest.mark.parametrize("escalation", ["abort", "keep"])
def test_a_request_queued_behind_a_pending_wait_and_the_escalation(vllm_url, escalation):
    """A streaming request sent while a ``/pause?mode=wait`` is pending is queued; an
    escalation to ``abort`` ends it with a bare ``data: [DONE]``: no chunk, no finish
    reason (the request had produced nothing), where a non-streaming one gets
    ``finish_reason: abort``. A streaming client must read a stream that ends without a
    finish reason as aborted. An escalation to ``keep`` holds it until ``/resume``, then it
    completes (docs/vllm.md: what to choose)."""
    import threading

    from support.timing import wait_until

    out: dict[str, list[str]] = {}
    running = threading.Thread(target=_stream, args=(vllm_url, "running", 3000, out))
    running.start()
    wait_until(lambda: call(vllm_url, "/v1/models") and _in_flight(vllm_url) >= 1,
               timeout_s=60, what="the long request running")
    waiting = threading.Thread(target=call, args=(vllm_url, "/pause?mode=wait", "POST"))
    waiting.start()
    wait_until(lambda: call(vllm_url, "/is_paused")["is_paused"], timeout_s=30,
               what="paused, the wait pending")
    queued = threading.Thread(target=_stream, args=(vllm_url, "queued", 20, out))
    queued.start()
    # sent and queued behind the pause (a fixed second once, which a busy server's API can
    # outlast: the request then came after the escalation and ran to its length)
    wait_until(lambda: _in_flight(vllm_url) >= 2, timeout_s=60, what="the second request queued")
    call(vllm_url, f"/pause?mode={escalation}", "POST")
    waiting.join(timeout=120)
    call(vllm_url, "/resume", "POST")
    for t in (running, queued):
        t.join(timeout=300)
    if escalation == "abort":
        assert out["queued"] == ["data: [DONE]"], out["queued"]
        assert _finish(out["running"]) == "abort"
    else:
        assert _finish(out["queued"]) == "length" and _finish(out["running"]) == "length"


def _in_flight(url: str) -> int:
    from ckpt_controller.adapters.vllm.http import parse_metrics

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return parse_metrics(resp.read().decode()).in_flight
