"""The sidecar process (``ckptctl agent vllm``): which of vLLM's APIs it drives
(``choose_api``), the engine side for it (``VllmEngine`` for the dev-mode API,
``native.CheckpointApiEngine`` for ``/checkpoint``), and the agent that serves it (``serve``).

Neighbours: ``http`` (finds the server's APIs), ``sidecar`` and ``native`` (the engine sides),
``state`` (what a predecessor left), ``process`` (vLLM's PID), ``agent`` (the ``Agent``);
``cli.agent_cmds`` calls ``serve``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

from ckpt_controller.adapters.vllm.http import VllmHttp
from ckpt_controller.adapters.vllm.native import CheckpointApiEngine
from ckpt_controller.adapters.vllm.process import (
    EngineFingerprint,
    find_server_pid,
    parent_host_pid,
    process_started,
)
from ckpt_controller.adapters.vllm.sidecar import VllmEngine
from ckpt_controller.adapters.vllm.state import StateFile, state_path
from ckpt_controller.agent.incarnation import IncarnationTracker
from ckpt_controller.errors import UnreachableError, UsageError
from ckpt_controller.vocab import CheckpointState, EngineApi, Trigger

log = logging.getLogger("ckpt_controller.vllm")


#: ``--api``: which of vLLM's lifecycle APIs the sidecar drives (auto: /checkpoint where the
#: server has it, the dev-mode API where not, or for what /checkpoint cannot do)
API_CHOICES = ("auto", "checkpoint", "dev")


def choose_api(http: VllmHttp, wanted: str = "auto") -> tuple[EngineApi, bool, str, bool]:
    """The API a sidecar drives ``http``'s server through, whether the dev-mode API is there
    to do what /checkpoint cannot, a line saying so, and whether the server has the dev-mode
    API at all; ``UsageError`` when the server has neither (or not the one ``wanted``)."""
    found = http.apis()
    version = f"vLLM {found.version}" if found.version else "vLLM (version not given)"
    if wanted not in API_CHOICES:
        raise UsageError("--api must be auto, checkpoint or dev", value=wanted)
    checkpoint = found.checkpoint and wanted in ("auto", "checkpoint")
    dev = found.dev and wanted in ("auto", "dev")
    if checkpoint:
        return EngineApi.VLLM_CHECKPOINT, dev, version + ", /checkpoint/*" + (
            "; its dev-mode API for what /checkpoint cannot do" if dev else ""), found.dev
    if dev:
        return EngineApi.VLLM_DEV, True, version + ", dev-mode API" + (
            " (its /checkpoint/* left aside: --api dev)" if found.checkpoint else ""), True
    raise UsageError(
        f"{version} at {http.url} serves " + (
            "neither /checkpoint/* nor the dev-mode API" if wanted == "auto" else
            "no /checkpoint/*" if wanted == "checkpoint" else "no dev-mode API"),
        url=http.url, found_by=found.found_by, checkpoint_api=found.checkpoint,
        dev_api=found.dev,
        change="start vLLM 0.34+ with --enable-sleep-mode (its /checkpoint API), or any vLLM "
               "with VLLM_SERVER_DEV_MODE=1 (its dev-mode API)")


def serve(url: str, *, name: str, control: str | None, pid: int | None,
          golden_prompt: str, golden_tokens: int, verify_weights: bool, timeout_s: float,
          heartbeat_interval_s: float = 0.5, ready: Callable[[dict], None] | None = None,
          curve=None, engine_is_parent: bool = False, notifier=None,
          api: str = "auto") -> None:
    """Run the sidecar until SIGTERM/SIGINT; prints one JSON ready line once bound (and tells
    ``notifier``, an ``sdnotify.Notifier``, READY=1 then, and STOPPING=1 at the end).
    ``engine_is_parent``: started by the launcher (``launcher``), whose host PID is the
    engine's (the tree CRIU dumps), read again when a restore changed it. ``api``: one of
    ``API_CHOICES`` (``choose_api``)."""
    from ckpt_controller.agent.server import Agent
    from ckpt_controller.procutil import StopSignals

    http = VllmHttp(url, timeout_s=timeout_s)
    if not http.healthy(timeout_s=5.0):
        raise UnreachableError(f"no vLLM server answers at {http.url}/health", url=http.url)
    driven, dev, detail, dev_present = choose_api(http, api)
    pid_of: "int | None | Callable[[], int | None]" = pid
    if engine_is_parent:
        pid_of = parent_host_pid
        pid = parent_host_pid()
    elif pid is None and http.host in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        pid = pid_of = find_server_pid(http.port)
    state = StateFile(state_path(control, name))
    state.belongs_to(process_started(pid))  # another vLLM process: afresh
    options = dict(pid=pid_of, golden_prompt=golden_prompt, golden_tokens=golden_tokens,
                   verify_weights=verify_weights, step_timeout_s=max(timeout_s, 60.0),
                   state=state)
    engine = (CheckpointApiEngine(http, dev=dev, dev_present=dev_present, **options)
              if driven is EngineApi.VLLM_CHECKPOINT else VllmEngine(http, **options)).start()
    # never claim RUNNING for an engine that is not serving: FAILED says why (a restore
    # resumes and wakes it); a vLLM found prepared (started so, or its sidecar restarted)
    # is PREPARED, and a restore brings it back
    found = engine.found_out_of_service()
    fingerprint = EngineFingerprint(pid_of)
    agent = Agent(name, hooks=engine, memory=engine, drain=engine, control=control,
                  engine_pid=pid, engine_alive=engine.alive,
                  request_counts=engine.request_counts,
                  heartbeat_interval_s=heartbeat_interval_s, curve=curve,
                  incarnation=IncarnationTracker(fingerprint),
                  generation=state.state.generation, endpoints={"http": http.url},
                  api=driven, api_detail=detail,
                  initial=CheckpointState.PREPARED if found and found[0] is
                  CheckpointState.PREPARED else CheckpointState.RUNNING)
    # restored elsewhere, the engine (the launcher) has another host PID: status says it
    def new_pid(new: int) -> None:  # restored (by CRIU): the same engine, a new process
        agent.engine_pid = new
        state.state.engine_started = process_started(new)
        state.save()
    fingerprint.on_new_pid = new_pid
    agent.lifecycle.subscribe(lambda t: _keep_generation(state, t.generation))
    if found is not None:
        log.warning("%s", found[1])
        if found[0] is CheckpointState.FAILED:
            agent.lifecycle.fire(Trigger.FAIL, reason=found[1])
    agent.start()
    stop = StopSignals()
    info = {"event": "ready", "name": name, "pid": os.getpid(), "engine_pid": pid,
            "url": http.url, "control": agent.endpoint, "model": http.model_name,
            "api": driven.value, "state": agent.lifecycle.state.value}
    (ready or (lambda i: print(json.dumps(i), flush=True)))(info)
    if notifier is not None:
        notifier.ready(f"serving {agent.endpoint} for vLLM at {http.url} "
                       f"({agent.lifecycle.state.value})", last_round=lambda: agent.last_round,
                       rounds_within=agent.rounds_within)
    try:
        stop.wait()
    finally:
        if notifier is not None:
            notifier.stopping()
        agent.close()
        engine.close()


def _keep_generation(state: StateFile, generation: int) -> None:
    if state.state.generation != generation:
        state.state.generation = generation
        state.save()
