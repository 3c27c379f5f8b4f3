"""vLLM adapter tests: the sidecar against the vLLM stand-in (``standin_server.py``, always)
and, under ``-m vllm``, against a real vLLM CPU server on a tiny Llama
(``make_tiny_llama.py``); moving a vLLM between nodes is in ``tests/fleet``.

``vllm_server``: one real vLLM server for the session, shared by this folder's modules.
Neighbours: ``tests/conftest.py``, ``support.vllm``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One vLLM server for the whole session (it takes about 35 s to start)."""
    from support.vllm import NO_VLLM, VLLM_PY, VllmServer, make_tiny_llama

    if not VLLM_PY.exists():
        pytest.skip(NO_VLLM)
    server = VllmServer(make_tiny_llama(tmp_path_factory.mktemp("tinyllama")))
    yield server
    server.stop()
