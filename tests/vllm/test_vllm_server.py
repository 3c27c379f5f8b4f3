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
