"""The sidecar on vLLM 0.34's own checkpoint API (``/checkpoint/prepare|restore|status``),
served by vLLM's own router module over the reference engine (``checkpoint_server.py``,
``make vllm-checkpoint``): real requests drained in every mode, what the API cannot do refused
before anything moves, a vLLM that started prepared taken over as PREPARED, a FAILED vLLM's
restore refused naming the restart. The test server has no dev-mode endpoints at all, so
every step here went through ``/checkpoint``. Marked ``vllm``."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from ckpt_controller.adapters.vllm import VllmHttp
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.errors import CkptError, UnsupportedError
from ckpt_controller.procutil import ReadyProcess
from support import ROOT
from support.cli import CKPTCTL
from support.config import engines_toml
from support.timing import deadline_in, scaled
from support.vllm import CHECKPOINT_PY, NO_CHECKPOINT, CheckpointServer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not CHECKPOINT_PY.exists(), reason=NO_CHECKPOINT),
]

PROMPTS = [f"request {i} says" for i in range(4)]
#: tokens of each request: long enough to be in flight when the prepare begins
LONG = 700


@pytest.fixture
def checkpoint_vllm(spawn_reference, ipc_dir):
    """``start(*server_flags, env=None)``: a reference engine and vLLM's checkpoint router
    over it (``CheckpointServer``), stopped after."""
    started: list[ReadyProcess] = []

    def start(*flags: str, env: dict | None = None, name: str = "ref") -> CheckpointServer:
        import os

        engine = spawn_reference(name, env=None if env is None else {**os.environ, **env})
        server = CheckpointServer(engine, ipc_dir, *flags)
        started.append(server)
        return server

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def sidecar(ipc_dir):
    started: list[ReadyProcess] = []

    def spawn(url: str, name: str = "vc", *extra: str) -> ReadyProcess:
        proc = ReadyProcess([*CKPTCTL, "agent", "vllm", "--url", url, "--control",
                             f"ipc://{ipc_dir}/{name}", "--name", name, "--heartbeat", "0.5",
                             *extra], ipc_dir / f"{name}.log", f"vLLM sidecar {name}", cwd=ROOT)
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        proc.stop()


class Requests:
    """Completions on threads; each retries vLLM's retryable 503 (a prepared vLLM's answer)
    until it is taken. ``outcomes[i]``: (finish reason, token count, text) or the error."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int = LONG) -> None:
        self.http, self.outcomes = VllmHttp(url, timeout_s=300), {}
        self.threads = [threading.Thread(target=self._one, args=(i, p, max_tokens))
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _one(self, i: int, prompt: str, max_tokens: int) -> None:
        try:
            c = self.http.complete(prompt, max_tokens, retry_for_s=120)
            self.outcomes[i] = (c.finish_reason, len(c.text.split()), c.text)
        except CkptError as err:
            self.outcomes[i] = ("error", 0, str(err))

    def in_flight(self, n: int) -> None:
        """Wait until the server has ``n`` requests running."""
        deadline = deadline_in(scaled(30))
        while self.http.metrics().running < n:
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.02)

    def join(self) -> dict:
        for t in self.threads:
            t.join(scaled(240))
        return self.outcomes


def status_of(client: ControllerClient, name: str = "vc"):
    return client.status([name]).engines[0].status


def state_of(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/checkpoint/status", timeout=10) as resp:
            return resp.status, json.loads(resp.read())["state"]
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["state"]


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_a_cycle_drains_real_requests_through_vllms_checkpoint_api(
        mode, checkpoint_vllm, sidecar, spawn_controller):
    server = checkpoint_vllm()
    side = sidecar(server.url)
    assert side.info["api"] == "vllm-checkpoint" and side.info["state"] == "running"
    ctl = spawn_controller(engines_toml(("vc", side.info["control"]), kind="vllm"))
    uninterrupted = Requests(server.url, PROMPTS).join()
    load = Requests(server.url, PROMPTS)
    load.in_flight(len(PROMPTS))
    with ControllerClient(ctl.endpoint) as client:
        result = client.cycle(["vc"], drain=mode, tags=["kv_cache"], on_deadline="fail",
                              drain_timeout=120.0, op_id=f"ck-{mode}")
        # sent while the engine is out of service: refused as retryable (wait, abort) or
        # queued (keep), and answered once it serves again
        late = Requests(server.url, ["sent while prepared"], 8)
        outcomes, late_outcomes = load.join(), late.join()
        assert result.status == "succeeded", result
        (eng,) = result.engines
        drain = eng.drain
        assert drain.mode == mode and drain.in_flight_at_start == len(PROMPTS), drain
        assert eng.released.tags == ["kv_cache"] and eng.rewoken.tags == ["kv_cache"]
        status = status_of(client)
        assert status.state == "running" and status.generation == 1
        assert status.api == "vllm-checkpoint" and "vLLM 0.34.0" in status.api_detail
    page = ctl.ckptctl("describe", "vc").stdout
    assert "API:           vllm-checkpoint (vLLM 0.34.0, /checkpoint/*)" in page, page
    wide = ctl.ckptctl("status", "-o", "wide").stdout
    assert "vllm-checkpoint" in wide, wide
    # nothing lost: every request ended with a finish reason
    assert all(o[0] in ("length", "abort") for o in outcomes.values()), outcomes
    assert late_outcomes[0][0] == "length", late_outcomes
    if mode == "wait":
        assert {o[0] for o in outcomes.values()} == {"length"}
        assert drain.completed == len(PROMPTS)
    elif mode == "abort":
        assert {o[0] for o in outcomes.values()} == {"abort"}
        assert all(0 < o[1] < LONG for o in outcomes.values()), outcomes  # partial outputs
        assert drain.aborted == len(PROMPTS)
    else:  # kept, then finished after the restore exactly as an uninterrupted run
        assert outcomes == uninterrupted
        assert drain.kept == len(PROMPTS)
    assert state_of(server.url) == (503, "running")


def test_what_the_checkpoint_api_cannot_do_is_refused_before_anything_moves(
        checkpoint_vllm, sidecar, spawn_controller):
    server = checkpoint_vllm()
    side = sidecar(server.url)
    ctl = spawn_controller(engines_toml(("vc", side.info["control"]), kind="vllm"))
    cases = {
        "a level": ("prepare", "vc", "--level", "1"),
        "the weights": ("prepare", "vc", "--tags", "weights,kv_cache", "--on-deadline", "fail"),
        "an escalation": ("prepare", "vc", "--tags", "kv_cache"),  # on_deadline abort
    }
    for what, args in cases.items():
        out = ctl.ckptctl(*args, "--json")
        assert out.returncode == 2, (what, out.stdout, out.stderr)
        err = json.loads(out.stdout)["engines"][0]["error"]
        assert err["kind"] == UnsupportedError.__name__, (what, err)
        assert err["details"]["api"] == "vllm-checkpoint" and "--tags kv_cache" in \
            err["details"]["can"] and err["details"]["change"], (what, err)
    assert state_of(server.url) == (503, "running")  # vLLM was never asked to prepare
    status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
    assert status["state"] == "running" and status["generation"] == 0
    # the per-engine defaults make the plain command work
    ctl.stop()
    ctl = spawn_controller(engines_toml(
        ("vc", side.info["control"]), kind="vllm",
        extra='[engine.defaults]\ntags = ["kv_cache"]\non_deadline = "fail"\n'))
    out = ctl.ckptctl("cycle", "vc")
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_wait_past_its_deadline_fails_and_the_rollback_waits_for_vllms_drain(
        checkpoint_vllm, sidecar, spawn_controller):
    server = checkpoint_vllm()
    side = sidecar(server.url)
    ctl = spawn_controller(engines_toml(("vc", side.info["control"]), kind="vllm"))
    load = Requests(server.url, PROMPTS, 1500)
    load.in_flight(len(PROMPTS))
    out = ctl.ckptctl("prepare", "vc", "--tags", "kv_cache", "--on-deadline", "fail",
                      "--drain-timeout", "0.3", "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    eng = json.loads(out.stdout)["engines"][0]
    assert eng["status"] == "rolled_back" and eng["error"]["kind"] == "DrainError", eng
    # vLLM's drain could not be stopped: the requests finished, then vLLM was restored
    assert {o[0] for o in load.join().values()} == {"length"}
    assert state_of(server.url) == (503, "running")
    status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
    assert status["state"] == "running"


def test_a_vllm_started_prepared_is_taken_over_as_prepared_and_restored(
        checkpoint_vllm, sidecar, spawn_controller):
    server = checkpoint_vllm("--checkpoint-prepare-on-startup")
    deadline = deadline_in(scaled(20))
    while state_of(server.url) != (200, "prepared"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    side = sidecar(server.url)
    assert side.info["state"] == "prepared"
    ctl = spawn_controller(engines_toml(("vc", side.info["control"]), kind="vllm"))
    status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
    assert status["state"] == "prepared" and status["released_tags"] == ["kv_cache"]
    out = ctl.ckptctl("restore", "vc", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert state_of(server.url) == (503, "running")
    assert Requests(server.url, ["after the restore"], 8).join()[0][0] == "length"


def test_a_sidecar_restarted_while_prepared_takes_it_over_and_restores_it(
        checkpoint_vllm, sidecar, spawn_controller):
    server = checkpoint_vllm()
    side = sidecar(server.url)
    ctl = spawn_controller(engines_toml(("vc", side.info["control"]), kind="vllm"))
    out = ctl.ckptctl("prepare", "vc", "--tags", "kv_cache", "--drain", "abort")
    assert out.returncode == 0, out.stdout + out.stderr
    side.proc.kill()
    side.proc.wait()
    side = sidecar(server.url)
    assert side.info["state"] == "prepared"
    out = ctl.ckptctl("restore", "vc", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
    assert status["state"] == "running" and status["generation"] == 1


def test_a_failed_vllm_is_refused_a_restore_naming_the_restart(
        checkpoint_vllm, sidecar, spawn_controller):
    # the engine dies in its restore: vLLM's own rules leave it FAILED, which only a restart
    # leaves
    server = checkpoint_vllm(env={"CKPT_FAILPOINTS": "rewake:kill"})
    side = sidecar(server.url)
    ctl = spawn_controller(engines_toml(("vc", side.info["control"]), kind="vllm"))
    out = ctl.ckptctl("cycle", "vc", "--tags", "kv_cache", "--drain", "abort", "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    assert state_of(server.url) == (500, "failed")
    out = ctl.ckptctl("restore", "vc", "--json")
    assert out.returncode == 2, out.stdout + out.stderr
    err = json.loads(out.stdout)["engines"][0]["error"]
    assert err["kind"] == "UnsupportedError" and "restart" in err["details"]["change"], err
    assert "only a restart of vLLM leaves FAILED" in err["message"]


def test_the_api_is_found_without_an_openapi_document(checkpoint_vllm, sidecar):
    server = checkpoint_vllm("--disable-fastapi-docs")
    apis = VllmHttp(server.url).apis()
    assert (apis.checkpoint, apis.dev, apis.version, apis.found_by) == \
        (True, False, "0.34.0", "probe")
    side = sidecar(server.url)
    assert side.info["api"] == "vllm-checkpoint"
    # --api dev on a server without the dev-mode API: refused at start, saying what to do
    with pytest.raises(CkptError) as caught:
        sidecar(server.url, "vd", "--api", "dev")
    assert "no dev-mode API" in caught.value.details["log_tail"]
