"""vLLM 0.34's own ``/checkpoint`` router over the reference engine: a test server, not vLLM.

vLLM 0.34 has no CPU build, and its checkpoint router is mounted only with sleep mode, which
vLLM allows only on GPUs. So the tests serve vLLM's own router modules from the wheel's
source (``make vllm-checkpoint``): ``vllm.entrypoints.serve.checkpoint.api_router`` and, for
``/health``, its instrumentator's (``/version`` answers vLLM's version as its own does). Under them, ``RuleFollowingClient``
is an engine client whose ``checkpoint_prepare``, ``checkpoint_restore`` and
``checkpoint_state`` follow ``EngineCoreProc``'s rules as read from the wheel
(``vllm/v1/engine/core.py``):

- prepare: a no-op when PREPARING or PREPARED; refused with nothing changed when RESTORING or
  FAILED, or without sleep mode; else PREPARING at once and the drain in the background with
  the mode (``pause_generation``: new requests rejected with a retryable error for ``wait``
  and ``abort``, queued for ``keep``); once drained, the KV cache is released and the state is
  PREPARED. Any failure on the way is FAILED with its message; only a restart leaves FAILED.
- restore: a no-op while RUNNING or RESTORING; ``RuntimeError`` unless PREPARED; else
  RESTORING, the KV cache woken, RUNNING (scheduling and admission resume); a failure is FAILED.
- ``--checkpoint-prepare-on-startup``: a prepare (``wait``) before it serves.

The engine behind it is a real reference engine process (``ckptctl engine serve``): its drain
(its agent's ``prepare`` with the mode and ``tags=["kv_cache"]``, what vLLM's prepare
releases) ends, aborts or keeps real requests. ``/v1/completions`` is an OpenAI-compatible
front over its request API (a prompt's UTF-8 bytes are its token ids; a completion's text is
its token ids, each after a space), ``/metrics`` counts the requests it forwarded under
vLLM's metric names.

Usage: checkpoint_server.py --engine-api EP --engine-control EP [--host H] [--port P]
       [--no-sleep-mode] [--checkpoint-prepare-on-startup] [--disable-fastapi-docs]
Prints one JSON ready line (``url``, ``pid``) once it serves, then serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from vllm.entrypoints.serve.checkpoint.api_router import attach_router
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.instrumentator.health import router as health_router
from vllm.exceptions import RetryableRequestError
from vllm.v1.engine import CheckpointState, PauseMode
from vllm.version import __version__ as VLLM_VERSION

from ckpt_controller.agent.client import AgentClient
from ckpt_controller.engine.client import EngineClient
from ckpt_controller.errors import CkptError, RejectedError

#: a wait drain in vLLM has no deadline of its own; the reference engine's agent needs one
WAIT_FOREVER_S = 86_000.0


class RuleFollowingClient:
    """The part of vLLM's ``EngineClient`` the checkpoint router and ``/health`` call, with
    ``EngineCoreProc``'s checkpoint rules, over a reference engine's agent."""

    def __init__(self, control: str, *, sleep_mode: bool) -> None:
        self.control = control
        self.sleep_mode = sleep_mode
        self.state = CheckpointState.RUNNING
        self.error: str | None = None
        #: pause_generation's policy: wait and abort reject new requests, keep queues them
        self.reject_new_requests = False
        self.lock = threading.Lock()
        self.prepares = 0  # how many drains began (a no-op prepare begins none)

    def _agent(self, *, watched: bool = False) -> AgentClient:
        """A client of the engine's agent; ``watched``: an operation's, whose wait ends once
        the engine's heartbeats stop (an engine that died is a failure, not a hang)."""
        agent = AgentClient(self.control, timeout_s=30.0)
        if watched:
            agent.subscribe()
        return agent

    async def checkpoint_state(self) -> tuple[CheckpointState, str | None]:
        return self.state, self.error

    async def checkpoint_prepare(self, mode: PauseMode = "wait") -> str | None:
        return self.prepare_now(mode)

    def prepare_now(self, mode: str) -> str | None:
        with self.lock:
            state = self.state
            if state in (CheckpointState.PREPARING, CheckpointState.PREPARED):
                return None
            if state != CheckpointState.RUNNING:
                return f"Cannot prepare while the checkpoint state is {state}"
            if not self.sleep_mode:
                return "Preparing for a checkpoint requires --enable-sleep-mode"
            if mode not in ("wait", "abort", "keep"):
                raise ValueError(f"Invalid pause mode: {mode}")
            self.state = CheckpointState.PREPARING
            self.reject_new_requests = mode != "keep"
            self.prepares += 1
        threading.Thread(target=self._drain, args=(mode,), daemon=True).start()
        return None

    def _drain(self, mode: str) -> None:
        try:
            with self._agent(watched=True) as agent:
                agent.prepare(drain=mode, drain_timeout_s=WAIT_FOREVER_S, on_deadline="fail",
                              level=None, tags=["kv_cache"])
            with self.lock:
                self.state = CheckpointState.PREPARED
        except Exception as exc:  # policy: as EngineCoreProc: any failure is FAILED
            with self.lock:
                self.state, self.error = CheckpointState.FAILED, str(exc)

    async def checkpoint_restore(self) -> None:
        await asyncio.to_thread(self._restore)

    def _restore(self) -> None:
        with self.lock:
            state = self.state
            if state in (CheckpointState.RUNNING, CheckpointState.RESTORING):
                return
            if state != CheckpointState.PREPARED:
                raise RuntimeError(f"Cannot restore while the checkpoint state is {state}")
            self.state = CheckpointState.RESTORING
        try:
            with self._agent(watched=True) as agent:
                agent.restore()
        except Exception as exc:  # policy: as EngineCoreProc: FAILED, and raised
            with self.lock:
                self.state, self.error = CheckpointState.FAILED, str(exc)
            raise
        with self.lock:
            self.state = CheckpointState.RUNNING
            self.reject_new_requests = False

    async def check_health(self) -> None:
        """vLLM's /health: the engine process answers."""
        def ask() -> None:
            with self._agent() as agent:
                agent.status()

        await asyncio.to_thread(ask)


class Counts:
    """The requests the front forwarded, as vLLM's /metrics names them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.finished: dict[str, int] = {}

    def metrics(self) -> str:
        with self.lock:
            lines = ["# TYPE vllm:num_requests_running gauge",
                     f'vllm:num_requests_running{{engine="0"}} {self.running}',
                     "# TYPE vllm:num_requests_waiting gauge",
                     'vllm:num_requests_waiting{engine="0"} 0',
                     "# TYPE vllm:request_success counter"]
            lines += [f'vllm:request_success_total{{engine="0",finished_reason="{r}"}} {n}'
                      for r, n in sorted(self.finished.items())]
        return "\n".join(lines) + "\n"


def build_app(client: RuleFollowingClient, engine_api: str, *, docs: bool) -> FastAPI:
    app = FastAPI(openapi_url="/openapi.json" if docs else None, docs_url=None,
                  redoc_url=None)
    app.state.engine_client = client
    app.state.server_load_metrics = 0
    attach_router(app)  # vLLM's own /checkpoint/prepare|restore|status
    app.include_router(health_router)
    counts = Counts()

    @app.get("/version")  # as vLLM's (its module imports the tokenizers' whole stack)
    async def version():
        return {"version": VLLM_VERSION}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "reference", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(counts.metrics())

    @app.post("/v1/completions")
    async def completions(raw: Request):
        body = await raw.json()
        prompt = list(str(body.get("prompt", "")).encode())[:512] or [0]
        max_tokens = int(body.get("max_tokens") or 16)
        answer = await asyncio.to_thread(_complete, client, counts, engine_api, prompt,
                                         max_tokens)
        if isinstance(answer, JSONResponse):
            return answer
        tokens, reason = answer
        return {"id": "cmpl-reference", "object": "text_completion", "model": "reference",
                "choices": [{"index": 0, "text": "".join(f" {t}" for t in tokens),
                             "finish_reason": reason, "logprobs": None}]}

    return app


def _complete(client: RuleFollowingClient, counts: Counts, engine_api: str,
              prompt: list[int], max_tokens: int):
    """One request through the reference engine, as vLLM treats it while prepared: rejected
    (503, retryable) after a wait or abort prepare, queued until the restore after a keep."""
    with EngineClient(engine_api) as engine:
        while True:
            if client.state != CheckpointState.RUNNING and client.reject_new_requests:
                return _paused()
            try:
                with counts.lock:
                    counts.running += 1
                try:
                    done = engine.generate(prompt, max_tokens, timeout_s=600)
                finally:
                    with counts.lock:
                        counts.running -= 1
            except RejectedError:  # policy: closed for a prepare: as vLLM's rules say
                if client.reject_new_requests or client.state == CheckpointState.RUNNING:
                    return _paused()
                time.sleep(0.05)  # a keep prepare: queued until the restore
                continue
            except CkptError as err:  # policy: the engine's own error, as vLLM's 500
                return JSONResponse({"error": {"message": str(err)}}, status_code=500)
            reason = str(done.finish_reason)
            with counts.lock:
                counts.finished[reason] = counts.finished.get(reason, 0) + 1
            return done.token_ids, reason


def _paused() -> JSONResponse:
    error = create_error_response(
        RetryableRequestError("Generation is paused. Please retry after it resumes."))
    return JSONResponse(error.model_dump(mode="json"), status_code=error.error.code)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-api", required=True)
    ap.add_argument("--engine-control", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--no-sleep-mode", action="store_true")
    ap.add_argument("--checkpoint-prepare-on-startup", action="store_true")
    ap.add_argument("--disable-fastapi-docs", action="store_true")
    args = ap.parse_args()
    client = RuleFollowingClient(args.engine_control, sleep_mode=not args.no_sleep_mode)
    if args.checkpoint_prepare_on_startup:
        refusal = client.prepare_now("wait")
        if refusal:
            raise SystemExit(refusal)
    app = build_app(client, args.engine_api, docs=not args.disable_fastapi_docs)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.02)
        print(json.dumps({"event": "ready", "url": url, "pid": os.getpid()}), flush=True)
        await task

    asyncio.run(run())


if __name__ == "__main__":
    main()
