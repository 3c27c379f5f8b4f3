"""The vLLM sidecar against a real vLLM server: cycles with each drain mode under concurrent
completions, through the controller, each of vLLM's known quirks handled, and one real
Prometheus scraping vLLM's /metrics beside the controller's (``make prometheus``). Marked
``vllm`` (``make test PYTEST_ARGS="-m vllm"``); skips without the vLLM venv (``make vllm``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import psutil
import pytest

from ckpt_controller.adapters.vllm import VllmEngine, VllmHttp
from ckpt_controller.agent import AgentClient
from ckpt_controller.agent.server import Agent
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.errors import CkptError, EngineError, VerificationError
from ckpt_controller.procutil import ReadyProcess
from support import ROOT
from support.cli import CKPTCTL, ckptctl
from support.config import engines_toml
from support.timing import deadline_in, scaled
from support.vllm import NO_VLLM, VLLM_PY

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=NO_VLLM),
]

#: long enough (about 10 s for six at once here) to be in flight when a prepare starts, even
#: across the multi-second stalls this 2-core VM shows while vLLM saturates it
LONG = 4000
PROMPTS = [f"request {i} says" for i in range(6)]
#: the sidecars' heartbeat: a controller declares silence after 6 of them (see above)
HEARTBEAT = "1.0"


class Recording(VllmHttp):
    """A VllmHttp that remembers the lifecycle calls it made, in order."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list[str] = []

    def request(self, method, path, *, params=None, body=None, timeout_s=None):
        if path not in ("/metrics", "/v1/completions", "/v1/models"):
            what = path + ("?" + "&".join(f"{k}={v}" for k, v in params) if params else "")
            if body and "method" in body:
                what += f" {body['method']}"
            elif body and "action" in body:
                what += f" {body['action']}"
            self.calls.append(what)
        return super().request(method, path, params=params, body=body, timeout_s=timeout_s)


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    ended_wall: float = 0.0
    #: vLLM's per-token logprobs (the token strings and each step's two best candidates)
    logprobs: dict | None = None


#: how close two candidates' logprobs must be to count as a tie that float32 rounding may
#: break either way (a different batch, a recompute) rather than as a wrong output
NEAR_TIE = 0.01


def same_or_split_at_a_near_tie(got: Outcome, want: Outcome) -> str | None:
    """``None`` when ``got`` equals ``want``, or first differs at a token where ``want``'s two
    best candidates were the two tokens chosen, within ``NEAR_TIE`` (greedy decoding under
    float32 may go either way there, and everything after may differ); else what is wrong."""
    if got.text == want.text:
        return None
    a, b = got.logprobs["tokens"], want.logprobs["tokens"]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if k >= min(len(a), len(b)):
        return f"one output is a prefix of the other ({len(a)} and {len(b)} tokens)"
    top = want.logprobs["top_logprobs"][k] or {}
    if a[k] not in top or b[k] not in top:
        mine = got.logprobs["top_logprobs"][k] or {}
        return (f"token {k}: {a[k]!r} was not among the two best ({top}; its own run's two "
                f"best: {mine})")
    gap = abs(top[a[k]] - top[b[k]])
    if gap > NEAR_TIE:
        return f"token {k}: {a[k]!r} instead of {b[k]!r}, {gap:.4f} apart in logprob"
    return None


@dataclass
class Batch:
    """Concurrent long greedy completions on threads (each retries a retryable refusal)."""

    url: str
    prompts: list[str]
    max_tokens: int = LONG
    outcomes: dict[int, Outcome] = field(default_factory=dict)

    def start(self) -> "Batch":
        http = VllmHttp(self.url, timeout_s=300)

        def one(i: int, prompt: str) -> None:
            out = Outcome()
            try:
                c = http.complete(prompt, self.max_tokens, retry_for_s=120, ignore_eos=True,
                                  logprobs=2)
                out.text, out.finish_reason, out.logprobs = c.text, c.finish_reason, c.logprobs
            except CkptError as err:
                out.error = str(err)
            out.ended_wall = time.time()
            self.outcomes[i] = out

        self._threads = [threading.Thread(target=one, args=(i, p), daemon=True)
                         for i, p in enumerate(self.prompts)]
        for t in self._threads:
            t.start()
        return self

    def all_in_flight(self, timeout_s: float = 20) -> bool:
        """Wait until vLLM has all of them in flight (running or queued); False if that was
        never seen (they ended first, or this process was not scheduled meanwhile)."""
        http = VllmHttp(self.url)
        end = deadline_in(timeout_s)
        while http.metrics().in_flight < len(self.prompts):
            if time.monotonic() > end or len(self.outcomes) == len(self.prompts):
                return False
            time.sleep(0.05)
        return True

    def join(self, timeout_s: float = 240) -> dict[int, Outcome]:
        for t in self._threads:
            t.join(timeout_s)
        assert len(self.outcomes) == len(self.prompts), "a request was left without an end"
        return self.outcomes


@pytest.fixture
def vllm(vllm_server):
    """The shared server, made whole again after each test: not paused, awake, weights as
    loaded (tests corrupt them on purpose)."""
    http = VllmHttp(vllm_server.url, timeout_s=120)
    yield http
    if http.is_paused():
        http.resume()
    if http.is_sleeping():
        http.wake_up(None)
    if http.is_paused():
        http.resume()
    http.collective_rpc("reload_weights")


@pytest.fixture
def sidecar(vllm_server, ipc_dir):
    started = []

    def spawn(name: str = "vl", *extra: str) -> ReadyProcess:
        proc = ReadyProcess([*CKPTCTL, "agent", "vllm",
                             "--url", vllm_server.url, "--control", f"ipc://{ipc_dir}/{name}",
                             "--name", name, "--heartbeat", HEARTBEAT, *extra],
                            ipc_dir / f"{name}.log", f"vLLM sidecar {name}", cwd=ROOT)
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        proc.stop()


@pytest.fixture
def in_process(vllm_server):
    """A sidecar's agent in this process, with a recording HTTP client."""
    made = []

    def make(**opts) -> tuple[Agent, VllmEngine, Recording]:
        http = Recording(vllm_server.url)
        engine = VllmEngine(http, pid=vllm_server.pid, step_timeout_s=120, **opts).start()
        agent = Agent(f"inproc{len(made)}", hooks=engine, memory=engine, drain=engine,
                      engine_pid=vllm_server.pid, engine_alive=engine.alive,
                      request_counts=engine.request_counts,
                      heartbeat_interval_s=float(HEARTBEAT)).start()
        made.append((agent, engine))
        return agent, engine, http

    yield make
    for agent, engine in made:
        agent.close()
        engine.close()


def under_load(vllm: VllmHttp, operation, undo=None, attempts: int = 5,
               happened=lambda drain: True):
    """Run ``operation()`` while ``PROMPTS`` are being generated; (result, outcomes).

    This 2-core VM sometimes stalls a process for seconds while vLLM saturates it; when the
    requests have ended before the operation reached its drain (``in_flight_at_start`` short
    of them all), the scenario did not happen: ``undo()`` and try again."""
    for attempt in range(attempts):
        batch = Batch(vllm.url, PROMPTS).start()
        if not batch.all_in_flight():
            batch.join()
            continue
        started = time.monotonic()
        result = operation(attempt)
        outcomes = batch.join()
        drain = result.engines[0].drain
        print(f"attempt {attempt}: operation took {time.monotonic() - started:.1f} s, "
              f"phases {[(p.name, round(p.duration_s, 2)) for p in result.engines[0].phases]}, "
              f"drain {drain}")
        if drain is not None and drain.in_flight_at_start == len(PROMPTS) and happened(drain):
            return result, outcomes
        if undo is not None:
            undo()
    pytest.fail(f"the scenario never happened in {attempts} tries: {drain}")


def _transition_walls(ctl, op_id: str) -> dict[str, float]:
    out = ctl.ckptctl("history", "--op-id", op_id, "--limit", "500", "--json")
    records = json.loads(out.stdout)["records"]
    return {r["data"]["dest"]: r["written_at_unix"] for r in records
            if r["record_type"] == "transition"}


# ---------------------------------------------------------------------------- through the controller


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_cycle_under_concurrent_completions(mode, vllm, sidecar, spawn_controller):
    side = sidecar()
    ctl = spawn_controller(engines_toml(("vl", side.info["control"]), kind="vllm"))
    golden = vllm.complete("the engine drains", 12, ignore_eos=True).text
    uninterrupted = Batch(vllm.url, PROMPTS).start().join() if mode == "keep" else None

    # in this process: a new process started while vLLM saturates both cores here can take
    # seconds to start, long enough for the requests to end before the drain begins
    with ControllerClient(ctl.endpoint) as client:
        counted = {"wait": "completed", "abort": "aborted", "keep": "kept"}[mode]
        # a wait drain has two minutes to finish 6 x 4,000 tokens: the default 30 s was not
        # always enough on a busy CI machine (every try escalated to abort)
        result, outcomes = under_load(vllm, lambda n: client.cycle(
            ["vl"], drain=mode, level=1, op_id=f"vl-{mode}-{n}", drain_timeout=120.0),
            # a stall can hold vLLM's API server back until the requests have ended
            happened=lambda drain: getattr(drain, counted) == len(PROMPTS))
    op_id = result.op_id
    assert result.status == "succeeded", result
    (eng,) = json.loads(msgspec.json.encode(result))["engines"]
    assert eng["status"] == "succeeded" and eng["state"] == "running"
    drain = eng["drain"]
    assert drain["mode"] == mode and drain["in_flight_at_start"] == len(PROMPTS)
    assert not [o.error for o in outcomes.values() if o.error], outcomes  # nothing lost
    walls = _transition_walls(ctl, op_id)
    if mode == "wait":  # in-flight requests finished before PREPARED
        assert {o.finish_reason for o in outcomes.values()} == {"length"}
        # vLLM counted them finished when /pause returned, before the seal (their HTTP answers
        # may reach the clients a few milliseconds later)
        assert drain["completed"] == len(PROMPTS)
    elif mode == "abort":  # ended at once, partial outputs, finish reason abort
        assert {o.finish_reason for o in outcomes.values()} == {"abort"}
        assert all(0 < len(o.text) for o in outcomes.values())
        assert drain["aborted"] == len(PROMPTS)
    else:  # kept: they finish after the restore, as if nothing had happened
        assert {o.finish_reason for o in outcomes.values()} == {"length"}
        assert min(o.ended_wall for o in outcomes.values()) >= walls["restoring"]
        # token for token, but for a float32 near-tie that a different batch can break
        # either way (the uninterrupted run decoded in other batches than the kept one)
        wrong = {i: same_or_split_at_a_near_tie(outcomes[i], uninterrupted[i])
                 for i in range(len(PROMPTS))}
        assert not {i: w for i, w in wrong.items() if w}, wrong
        split = [i for i in range(len(PROMPTS)) if outcomes[i].text != uninterrupted[i].text]
        print(f"kept outputs identical: {len(PROMPTS) - len(split)} of {len(PROMPTS)}; split "
              f"at a near-tie: {split}")
        assert drain["kept"] == len(PROMPTS)
    # the sidecar checked its golden completion; check one of ours too
    assert vllm.complete("the engine drains", 12, ignore_eos=True).text == golden
    # status and history show the vLLM engine like any other
    status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]
    assert status["engine"] == "vl" and status["engine_kind"] == "vllm" and status["reachable"]
    assert status["status"]["state"] == "running" and status["status"]["generation"] >= 1
    assert status["status"]["pid"] == vllm_pid(vllm)
    assert list(walls) == ["preparing", "prepared", "restoring", "running"]


def vllm_pid(http: VllmHttp) -> int:
    from ckpt_controller.adapters.vllm.process import find_server_pid

    return find_server_pid(http.port)


def test_wait_drain_deadline_escalates_to_abort(vllm, sidecar, spawn_controller):
    side = sidecar()
    ctl = spawn_controller(engines_toml(("vl", side.info["control"]), kind="vllm"))
    with ControllerClient(ctl.endpoint) as client:
        result, outcomes = under_load(vllm, lambda n: client.prepare(
            ["vl"], drain="wait", drain_timeout=0.5, on_deadline="abort", level=0),
            undo=lambda: client.restore(["vl"]),
            # a stall of this VM can hold the sidecar back past the requests' end (no
            # escalation) or vLLM's API server back past it (escalated, nothing left to abort)
            happened=lambda drain: drain.escalated_to == "abort")
    (eng,) = result.engines
    assert result.status == "succeeded", result
    drain = eng.drain
    assert drain.escalated_to == "abort" and drain.completed + drain.aborted == len(PROMPTS)
    reasons = [o.finish_reason for o in outcomes.values()]
    assert reasons.count("abort") == drain.aborted and reasons.count("length") == drain.completed
    assert ctl.ckptctl("restore", "vl").returncode == 0
    assert not vllm.is_paused()


def test_a_dead_vllm_stops_the_heartbeats(vllm_server, sidecar, ipc_dir):
    # the sidecar watches /health; a PID that no longer exists is the same as no answer
    side = sidecar("ghost", "--pid", "999999")
    with AgentClient(side.info["control"], timeout_s=3) as agent:
        with pytest.raises(EngineError, match="not answering"):
            agent.heartbeat()


def test_a_sidecar_started_beside_a_paused_vllm_says_failed_and_restore_recovers(vllm, sidecar):
    vllm.pause("keep")  # e.g. the sidecar restarted while its engine was PREPARED
    side = sidecar("late")
    with AgentClient(side.info["control"]) as c:
        st = c.status()
        assert st.state == "failed" and "found paused" in st.last_transition.reason
        c.restore()
        assert c.status().state == "running"
    assert not vllm.is_paused() and not vllm.is_sleeping()


# ---------------------------------------------------------------------------- the quirks


def test_paused_reads_as_sleeping_so_level_0_resumes_without_waking(vllm, in_process):
    agent, _, http = in_process()
    with AgentClient(agent.endpoint) as c:
        c.prepare(level=0)
        assert vllm.is_paused() and vllm.is_sleeping()  # merely paused
        http.calls.clear()
        c.restore()
    assert not vllm.is_paused() and not vllm.is_sleeping()
    assert not [x for x in http.calls if x.startswith("/wake_up")], http.calls
    assert "/resume" in http.calls


def test_a_full_wake_up_resumes_by_itself_so_weights_are_checked_before_it(vllm, in_process):
    agent, _, http = in_process()
    with AgentClient(agent.endpoint) as c:
        c.prepare(level=1, drain="keep")
        http.calls.clear()
        reply = c.restore()
    calls = http.calls
    assert calls.index("/weight_checker compare") < calls.index("/wake_up?tags=kv_cache")
    assert "/resume" not in calls  # vLLM resumed on the full wake-up
    assert reply.memory.verified_tensors > 0
    assert not vllm.is_paused()


def test_resume_after_sleep_leaves_memory_asleep_and_resume_wakes_it(vllm, in_process):
    # pinned: /resume after /sleep unpauses but memory sleeps on
    vllm.sleep(1, "abort")
    vllm.resume()
    assert not vllm.is_paused() and vllm.is_sleeping()
    # the sidecar's resume step notices and wakes it
    _, engine, http = in_process()
    vllm.pause("keep")
    engine.resume_scheduling()
    assert not vllm.is_sleeping() and not vllm.is_paused()
    assert "/wake_up" in http.calls


def test_failed_kv_cache_release_rolls_back_by_waking_kv_cache(vllm, in_process):
    agent, _, http = in_process()
    with AgentClient(agent.endpoint) as c:
        with pytest.raises(EngineError) as err:
            c.prepare(level=None, tags=["kv_cache"])  # vLLM's CPU worker cannot discard selectively
        assert err.value.details["rolled_back"] is True
        assert c.status().state == "running"
    assert "/wake_up?tags=kv_cache" in http.calls
    assert not vllm.is_paused() and not vllm.is_sleeping()
    assert vllm.complete("still serving", 4).finish_reason == "length"


def test_failed_kv_cache_release_still_marks_kv_cache_asleep(vllm):
    vllm.pause("wait")
    with pytest.raises(EngineError) as err:
        vllm.release_kv_cache_memory()
    assert err.value.details["http_status"] == 500
    vllm.resume()
    assert vllm.is_sleeping()  # kv_cache is marked asleep although nothing was released
    assert vllm.wake_up(["kv_cache"]) and not vllm.is_sleeping()


def test_on_cpu_sleep_frees_nothing_and_the_report_says_so(vllm, in_process):
    agent, _, _ = in_process()
    with AgentClient(agent.endpoint) as c:
        reply = c.prepare(level=1)
        c.restore()
    m = reply.memory
    assert m.tensor_bytes == m.offloaded_bytes == m.discarded_bytes == 0  # nothing claimed
    (cpu,) = m.devices
    assert cpu.device == "cpu" and "measured" in cpu.note and cpu.before_bytes > 100 * 2**20
    assert abs(m.freed_bytes) < 0.02 * cpu.before_bytes  # the CPU worker ignores sleep
    # the tree's three processes map the same libraries (torch): counted once (PSS), where a sum
    # of RSS counts them three times
    tree = [psutil.Process(vllm_pid(vllm))]
    tree += tree[0].children(recursive=True)
    rss = sum(proc.memory_info().rss for proc in tree)
    assert "PSS" in cpu.note and cpu.after_bytes < 0.95 * rss, (cpu, rss)


def test_requests_sent_while_paused_wait_and_complete_after_resume(vllm, in_process):
    # this vLLM queues them (newer ones refuse with a retryable status: http.complete retries)
    agent, _, _ = in_process()
    with AgentClient(agent.endpoint) as c:
        c.prepare(level=1)
        late = Batch(vllm.url, ["sent while prepared"], max_tokens=8).start()
        time.sleep(1.0)
        assert not late.outcomes  # held, not refused and not run
        c.restore()
    (outcome,) = late.join().values()
    assert outcome.finish_reason == "length" and outcome.error is None


# ---------------------------------------------------------------------------- verification


def test_corrupted_weights_fail_the_restore_before_readmission(vllm, in_process):
    agent, _, _ = in_process()
    with AgentClient(agent.endpoint) as c:
        c.prepare(level=1)
        vllm.request("POST", "/weight_checker", body={"action": "reset"})  # zeroes the weights
        with pytest.raises(VerificationError, match="weights differ"):
            c.restore()
        assert c.status().state == "failed"
        assert vllm.is_paused()  # never re-admitted
        vllm.collective_rpc("reload_weights")  # the operator's fix; then recovery
        c.restore()
        assert c.status().state == "running"


def test_a_golden_mismatch_fails_the_restore(vllm, in_process):
    agent, engine, _ = in_process(verify_weights=False)
    with AgentClient(agent.endpoint) as c:
        c.prepare(level=0)
        vllm.request("POST", "/weight_checker", body={"action": "reset"})
        with pytest.raises(VerificationError, match="golden completion differs"):
            c.restore()
        assert c.status().state == "failed"
    assert vllm.is_paused()  # paused again (abort) once the mismatch was seen


# ---------------------------------------------------------------------------- a sidecar's crash


RECONCILE_S = 2.0


@pytest.mark.parametrize("restart", ["after-the-prepare", "at-once"])
def test_a_sidecar_killed_mid_prepare_is_resumed_by_the_reconciler_keeping_its_generation(
        vllm, sidecar, spawn_controller, ipc_dir, restart):
    """kill -9 of the sidecar while a prepare drains, then a new sidecar: once the prepare
    ended, or at once (the shipped unit's RestartSec=2), when the prepare's step, sent again
    after no answer, reaches the new sidecar, which found vLLM paused (FAILED) and refuses
    it: that once ended the prepare with InvalidTransitionError (exit 2), and the engine
    stayed FAILED with vLLM paused until a person restored it. Either way the operation lost
    contact, and the reconciler restores the engine."""
    side = sidecar("vk")
    control = side.info["control"]
    (ipc_dir / "hooks").mkdir(exist_ok=True)  # the config names it; none are installed
    ctl = spawn_controller(engines_toml(("vk", control), kind="vllm"),
                           controller_keys=f"reconcile_interval_s = {RECONCILE_S}\n")
    assert ctl.ckptctl("cycle", "vk", "--level", "0", "--json").returncode == 0
    generation = json.loads(ctl.ckptctl("status", "vk", "--json").stdout)[
        "engines"][0]["status"]["generation"]
    assert generation == 1

    # a wait drain holds the prepare in PREPARING while long requests finish: kill -9 then
    batch = Batch(vllm.url, PROMPTS[:2]).start()
    end = deadline_in(60)
    while vllm.metrics().in_flight == 0:  # a stall of this VM can hold them back a while
        assert time.monotonic() < end and not batch.outcomes, batch.outcomes
        time.sleep(0.05)
    prepare = subprocess.Popen(
        [*CKPTCTL, "--controller", ctl.endpoint, "prepare", "vk",
         "--drain", "wait", "--drain-timeout", "120", "--level", "1", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    end = deadline_in(60)
    while not vllm.is_paused():
        assert time.monotonic() < end, "the prepare never paused vLLM"
        time.sleep(0.05)
    side.proc.kill()
    side.proc.wait()
    if restart == "at-once":
        back = sidecar("vk")  # the same name and control endpoint, while the prepare waits
        returned = time.monotonic()
    out, err = prepare.communicate(timeout=scaled(120))
    assert prepare.returncode == 4, out + err  # the operation lost contact with its engine
    assert "UnreachableError" in out + err and "InvalidTransitionError" not in out, out + err
    assert not [o.error for o in batch.join().values() if o.error]  # nothing lost meanwhile
    if restart == "after-the-prepare":
        assert vllm.is_paused()  # left paused by the dead sidecar
        back = sidecar("vk")  # the same name and control endpoint
        returned = time.monotonic()
    assert back.info["control"] == control
    with AgentClient(control) as agent:
        first = agent.status()
        end = deadline_in(RECONCILE_S + 30)  # a guard; the bound below is the journal's
        while agent.status().state != "running":
            assert time.monotonic() < end, agent.status()
            time.sleep(0.1)
        status = agent.status()
    assert first.state in ("failed", "restoring", "running")
    assert status.generation == generation  # kept across the sidecar's restart
    assert not vllm.is_paused() and not vllm.is_sleeping()
    assert vllm.complete("still serving", 4).finish_reason == "length"
    records = json.loads(ctl.ckptctl("history", "--engine", "vk", "--limit", "500",
                                     "--json").stdout)["records"]
    (done,) = [r for r in records if r["record_type"] == "reconciled"]
    assert done["data"]["found"] == "failed" and done["data"]["now"] == "running"
    # how long the engine took to run again is the reconciled record's moment (the journal's
    # clock is this host's monotonic one), not this test's: at once, the test first waits for
    # the prepare to end and for its two long requests to finish on a paused-then-resumed vLLM
    took = done["monotonic"] - returned
    print(f"found {first.state} ({first.last_transition.reason}); RUNNING {took:.1f} s after "
          f"the sidecar's return")
    # within a reconcile interval, plus the restore itself (a golden completion) on this VM;
    # at once, also the controller's wait for the dead sidecar's silence (6 heartbeats)
    silence = 6 * float(HEARTBEAT) if restart == "at-once" else 0.0
    assert 0 < took < scaled(RECONCILE_S + 10 + silence)


# ---------------------------------------------------------------------------- the docs' configs


def sample_configs() -> list[tuple[str, str]]:
    """Every TOML block in the README and docs/: (where, text)."""
    found = []
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
                ROOT / "hooks" / "README.md"):
        for i, block in enumerate(re.findall(r"^```toml\n(.*?)^```", doc.read_text(),
                                             re.S | re.M)):
            found.append((f"{doc.relative_to(ROOT)}[{i}]", block))
    return found


def _set(text: str, key: str, value: str) -> str:
    """``key = ...`` lines given ``value`` (comments kept)."""
    return re.sub(rf"^{key}(\s*)=\s*(\"[^\"]*\"|\S+)", rf"{key}\g<1>= {value}", text, flags=re.M)


@pytest.mark.parametrize("where,text", sample_configs(), ids=[w for w, _ in sample_configs()])
def test_each_sample_config_works_as_written_for_a_vllm_engine(where, text, vllm, vllm_server,
                                                               ipc_dir):
    """A person copies a sample config for their vLLM engine: the one it names (``kind =
    "vllm"``), else its first engine with ``kind`` changed as the sample's comment offers.
    prepare and restore succeed on this CPU host. Only where things live changes (endpoints,
    folders, a free metrics port; CURVE keys are made where the sample names them): every
    deadline and prepare default is as written. A ``[fleet]`` table stays as written too (its
    etcd is not there: the node serves on its own), with TLS files made where it names them
    and this host's address for its node's. A sample of other tables alone gets one vLLM
    engine."""
    if "engine" not in tomllib.loads(text):  # a sample of one table ([journal], say): with
        # the engine a person adds to it
        text += '\n[[engine]]\nname = "vl"\ncontrol = "ipc:///run/ckpt/vl.ctl"\nkind = "vllm"\n'
    conf = tomllib.loads(text)
    engines = conf["engine"]
    local = _set(text, "endpoint", f'"ipc://{ipc_dir}/ctl.sock"')
    # this node's own address, where a [fleet] sample names another host's
    local = _set(local, "address", '"127.0.0.1"')
    if "controller" not in conf:  # a sample of other tables: the controller's defaults but its
        # endpoint (the default one is shared by every controller of this user)
        local = f'[controller]\nendpoint = "ipc://{ipc_dir}/ctl.sock"\n' + local
    elif "endpoint" not in conf["controller"]:  # a [controller] sample of other keys: the same
        local = local.replace("[controller]\n",
                              f'[controller]\nendpoint = "ipc://{ipc_dir}/ctl.sock"\n', 1)
    for key in ("state_dir", "hooks_dir", "image_dir"):
        local = _set(local, key, f'"{ipc_dir / key}"')
    (ipc_dir / "hooks_dir").mkdir()
    local = _set(local, "metrics_port", "0")
    if "criu_action_scripts" in conf.get("controller", {}):  # one script where it can be
        script = ipc_dir / "criu-action"
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o755)
        local = _set(local, "criu_action_scripts", f'["{script}"]')
    if not any(e.get("kind") == "vllm" for e in engines):
        local = _set(local, "kind", '"vllm"')  # the first engine's kind (every one's)
        engines = [{**engines[0], "kind": "vllm"}]
    engines = [e for e in engines if e.get("kind") == "vllm"]
    for engine in conf["engine"]:
        local = local.replace(f'"{engine["control"]}"', f'"ipc://{ipc_dir}/{engine["name"]}.ctl"')

    def keys(name: str, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        out = ckptctl("keys", name, "--dir", str(folder))
        assert out.returncode == 0, out.stderr
        return folder / f"{name}.key"

    ctl_conf, client = conf.get("controller", {}), []
    if "curve_secret_key" in ctl_conf:
        secret = ipc_dir / ctl_conf["curve_secret_key"]
        keys(secret.name.removesuffix(".key_secret"), secret.parent)
        controller_key = secret.with_name(secret.name.removesuffix("_secret"))
        if "curve_clients" in ctl_conf:
            operator = keys("operator", ipc_dir / "operator")
            admitted = ipc_dir / ctl_conf["curve_clients"]
            admitted.mkdir(parents=True, mode=0o700)
            shutil.copy(operator, admitted)
            client = ["--curve-key", f"{operator}_secret", "--curve-server-key",
                      str(controller_key)]
    fleet = conf.get("fleet", {})
    if any(k in fleet for k in ("ca_cert", "cert", "key")):  # TLS for etcd: real certificates
        from support.etcd_cluster import Certs

        made = Certs(ipc_dir / "made-certs")
        for key, source in (("ca_cert", made.ca), ("cert", made.client),
                            ("key", made.client_key)):
            if key in fleet:
                target = ipc_dir / fleet[key]
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, target)
    for engine in conf["engine"]:  # the config names them all, running or not
        if "curve_server_key" in engine:
            public = ipc_dir / engine["curve_server_key"]
            keys(public.name.removesuffix(".key"), public.parent)
    sides = []
    try:
        for engine in engines:
            extra = []
            if "curve_server_key" in engine:
                public = ipc_dir / engine["curve_server_key"]
                admits = ipc_dir / f"{engine['name']}-admits"
                admits.mkdir(mode=0o700)
                shutil.copy(controller_key, admits)
                extra = ["--curve-secret-key", f"{public}_secret", "--curve-clients", str(admits)]
            sides.append(ReadyProcess(
                [*CKPTCTL, "agent", "vllm", "--url",
                 vllm_server.url, "--control", f"ipc://{ipc_dir}/{engine['name']}.ctl",
                 "--name", engine["name"], "--heartbeat", HEARTBEAT, *extra],
                ipc_dir / f"{engine['name']}.log", f"vLLM sidecar {engine['name']}", cwd=ROOT))
        (ipc_dir / "controller.toml").write_text(local)
        ctl = ReadyProcess([*CKPTCTL, "serve", "--config",
                            str(ipc_dir / "controller.toml")], ipc_dir / "controller.log",
                           "controller", cwd=ROOT)
        sides.append(ctl)

        def to_controller(*args: str):
            return ckptctl(*client, *args, endpoint=f"ipc://{ipc_dir}/ctl.sock", timeout=300)

        for name in [e["name"] for e in engines]:
            out = to_controller("prepare", name, "--json")
            assert out.returncode == 0, f"{where}: {out.stdout}{out.stderr}"
            (eng,) = json.loads(out.stdout)["engines"]
            print(f"{where}: {name} prepared; memory {eng['released']}")
            out = to_controller("restore", name, "--json")
            assert out.returncode == 0, f"{where}: {out.stdout}{out.stderr}"
        assert not vllm.is_paused()
    finally:
        for proc in reversed(sides):
            proc.stop()


# ---------------------------------------------------------------------------- Prometheus beside


def test_one_prometheus_scrapes_the_vllm_server_and_the_controller(vllm, vllm_server, sidecar,
                                                                   spawn_controller, ipc_dir):
    """A real Prometheus (``make prometheus``) scrapes vLLM's own /metrics beside the
    controller's after a cycle through the sidecar, and finds a metric of each."""
    from support.prometheus_server import prometheus_tool
    from support.prometheus_server import Prometheus

    prometheus_tool("prometheus")  # or skip, saying so
    side = sidecar()
    ctl = spawn_controller("metrics_port = 0\n"
                           + engines_toml(("vl", side.info["control"]), kind="vllm"))
    controller = f"127.0.0.1:{ctl.info['metrics_port']}"
    prom = Prometheus(ipc_dir / "prom", {"ckpt-controller": [controller],
                                         "vllm": [f"127.0.0.1:{vllm_server.port}"]})
    try:
        out = ctl.ckptctl("cycle", "vl", "--level", "1", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        vllm.complete("the engine drains", 4, ignore_eos=True)  # one request vLLM counts

        def found() -> bool:
            cycles = prom.query('ckpt_operations_total{job="ckpt-controller",kind="cycle",'
                                'outcome="succeeded"}')
            served = prom.query('sum(vllm:request_success_total{job="vllm"})')
            return (bool(cycles) and cycles[0]["value"][1] == "1" and bool(served)
                    and float(served[0]["value"][1]) >= 1)

        deadline = deadline_in(60)
        while not found():
            assert time.monotonic() < deadline, "Prometheus never saw both"
            time.sleep(0.5)
        ups = {r["metric"]["job"]: r["value"][1] for r in prom.query("up")}
        assert ups == {"ckpt-controller": "1", "vllm": "1"}
        assert prom.query('ckpt_engine_state{job="ckpt-controller",engine="vl",'
                          'state="running"} == 1')
        assert prom.query('vllm:num_requests_running{job="vllm"}')
    finally:
        prom.stop()
