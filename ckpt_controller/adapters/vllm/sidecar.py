"""The vLLM sidecar's engine side on vLLM's dev-mode API: an agent for a vLLM server we do not
own, driven over HTTP.

``ckptctl agent vllm --url http://HOST:PORT --control ENDPOINT`` (``run``) runs an ``Agent``
whose engine side is ``VllmEngine`` (here: the dev-mode API, older servers) or
``native.CheckpointApiEngine`` (vLLM 0.34's ``/checkpoint``, which extends it). The agent keeps
the lifecycle, the control protocol and the heartbeats exactly as for an embedded engine;
``VllmEngine`` maps each step onto vLLM's dev-mode API:

==========  ================================================================================
step        vLLM calls (``http``)
==========  ================================================================================
baseline    golden completion (temperature 0) and weight checksums, before pausing
drain       ``/pause?mode=wait|abort|keep``; the drain deadline and its escalation are ours
            (``agent.drain``, as for any agent: a pending ``wait`` is overtaken by
            ``/pause?mode=abort|keep``); counts come from ``/metrics`` deltas
release     level 1/2: ``/sleep?level=N&mode=keep`` (already drained: nothing queued is
            lost); tags ``kv_cache``: ``/release_kv_cache_memory``; then ``collective_rpc
            checkpoint_prepare``
re-wake     ``collective_rpc checkpoint_restore``, ``/wake_up?tags=weights``,
            ``reload_weights`` after level 2, weights compared with the baseline checksums
            (still paused: before re-admission), then ``/wake_up?tags=kv_cache``
resume      ``/resume`` if still paused, ``/wake_up`` if memory still sleeps, then the golden
            completion; a mismatch pauses (abort) and fails the restore
==========  ================================================================================

vLLM's quirks it lives with (each pinned by a test in ``tests/vllm/test_vllm_adapter.py``):
``is_sleeping`` is true while merely paused, so state reads ``is_paused`` too; a full
``wake_up`` resumes a pause by itself (so weights are verified before the last wake-up);
``/resume`` after ``/sleep`` leaves memory asleep (so resume checks and wakes); a failed
``release_kv_cache_memory`` still marks ``kv_cache`` asleep (so the tags are recorded as
released before the call, and a rollback wakes them); on CPU sleep and wake are accepted but
free nothing (the memory report gives measured numbers only); newer vLLM refuses requests
while paused with a retryable status where this one queues them (``http.complete`` retries).

What a prepare did to vLLM (tags asleep, ``checkpoint_prepare``, the baseline) and the
engine's ``generation`` are kept on disk (``state``): a sidecar restarted beside a paused or
sleeping vLLM (after a kill -9, say) comes up FAILED, and a restore (which the controller's
reconciler sends by itself, ``recover_uncaptured``) undoes, verifies and resumes exactly what
its predecessor did.
Started by ``launcher`` (``--engine-is-parent``), the sidecar is part of the engine: its status
names the launcher's host PID (the tree a dump takes, vLLM and the sidecar in one image), read
again after a restore moved it (``process.parent_host_pid``), and a migration moves both.
Neighbours: ``http`` (vLLM's HTTP API), ``state`` (the state file) and ``process`` (vLLM's PID,
its fingerprint, its process tree's memory) below; ``native`` extends it; ``agent`` runs it
(``Agent`` with ``VllmEngine`` as its hooks and memory); ``run`` starts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from ckpt_controller.adapters.vllm.http import RequestMetrics, VllmHttp
from ckpt_controller.adapters.vllm.process import tree_usage
from ckpt_controller.adapters.vllm.state import Progress, StateFile
from ckpt_controller.agent.drain import DrainPolicy
from ckpt_controller.agent.engine import EngineHooks
from ckpt_controller.clock import Deadline
from ckpt_controller.errors import (
    EngineError,
    ResidualOverBudgetError,
    UsageError,
    VerificationError,
)
from ckpt_controller.protocol import (
    DeviceMemory,
    DrainProgress,
    DrainReport,
    MemoryReport,
    PrepareCommand,
)
from ckpt_controller.vocab import (
    CheckpointState,
    DrainMode,
    EngineApi,
    FinishReason,
    MemoryAction,
    ReleaseLevel,
)

log = logging.getLogger("ckpt_controller.vllm")

GOLDEN_PROMPT = "The checkpoint controller drains the engine, then"
GOLDEN_TOKENS = 12
#: a golden completion is tried this many times before a mismatch counts (batching can move
#: a near-tie in greedy decoding; a broken model never matches)
GOLDEN_ATTEMPTS = 3
#: seconds without an answer from vLLM before the engine counts as gone (its API server can be
#: slow to answer while its engine core is busy; a vanished process counts at once)
DEAD_AFTER_S = 30.0
#: seconds of refused connections (nothing listens on vLLM's port: a live server, however
#: busy, never refuses) before the engine counts as gone, when its PID is not known
REFUSED_DEAD_S = 1.0
_TAGS = ("weights", "kv_cache")
#: vLLM's finish reasons (its ``/metrics`` labels) that count as a completion in a drain: ours,
#: less ``abort``, and vLLM's own ``repetition`` (a repetition detector ended the request)
COMPLETED = (FinishReason.STOP, FinishReason.LENGTH, "repetition", FinishReason.ERROR)


@dataclass
class _Plan:
    level: ReleaseLevel | None
    tags: list[str]


class VllmEngine(EngineHooks):
    """The engine side of a vLLM sidecar: ``ExternalDrain``, ``MemoryManager`` and
    ``EngineHooks`` in one, over ``VllmHttp``, through the dev-mode API (``native`` has the
    checkpoint API's). One operation at a time (the agent's)."""

    #: the API the current operation goes through
    via: EngineApi = EngineApi.VLLM_DEV

    def __init__(self, http: VllmHttp, *, pid: "int | None | Callable[[], int | None]" = None,
                 golden_prompt: str = GOLDEN_PROMPT, golden_tokens: int = GOLDEN_TOKENS,
                 verify_weights: bool = True, step_timeout_s: float = 600.0,
                 poll_s: float = 0.5, dead_after_s: float = DEAD_AFTER_S,
                 tick_s: float = 0.25, state: StateFile | None = None) -> None:
        """``state``: where what a prepare did to vLLM is kept, for a successor sidecar
        (``state`` module); nothing is kept without it. ``pid``: the engine's host PID, or
        a function that reads it each time (``parent_host_pid``: launched, it changes with
        a restore)."""
        self.http = http
        self.state = state
        self._pid_of = pid if callable(pid) else (lambda: pid)
        self.golden_prompt, self.golden_tokens = golden_prompt, golden_tokens
        self.verify_weights = verify_weights
        self.step_timeout_s = step_timeout_s
        self.tick_s = tick_s
        self.golden: str | None = None
        self.checksums: dict[str, str] | None = None
        self._weights_checked = False
        self._released: list[str] = []
        self._level: ReleaseLevel | None = None
        self._checkpoint_prepared = False
        self._kept = 0
        self._metrics = RequestMetrics()
        self._last_ok = time.monotonic()
        self._refused_since: float | None = None  # refused on every poll since then
        self._poll_s, self._dead_after_s = poll_s, dead_after_s
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="vllm-poll", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._pid_of()

    # ------------------------------------------------------------------ liveness

    def start(self) -> "VllmEngine":
        self._poller.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join(timeout=5)

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self._metrics = self.http.metrics(timeout_s=2.0)
                self._last_ok = time.monotonic()
                self._refused_since = None
            except EngineError as err:  # policy: not answering: alive() says so once it
                # lasts; refused, nothing listens there any more: soon
                if not err.details.get("refused"):
                    self._refused_since = None
                elif self._refused_since is None:
                    self._refused_since = time.monotonic()

    def alive(self) -> bool:
        pid = self.pid
        if pid is not None:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:  # policy: the process is gone: not alive
                return False
        refused = self._refused_since
        if refused is not None and time.monotonic() - refused >= REFUSED_DEAD_S:
            return False  # its port refuses: the server is gone (killed, its PID unknown)
        return time.monotonic() - self._last_ok < self._dead_after_s

    def request_counts(self) -> tuple[int, int]:
        """(in flight, kept) as last seen in vLLM's metrics."""
        m = self._metrics
        return (0, m.in_flight) if self._kept else (m.in_flight, 0)

    # ------------------------------------------------------------------ drain

    def drain(self, cmd: PrepareCommand, deadline: Deadline,
              progress: Callable[[DrainProgress], None]) -> DrainReport:
        start = time.monotonic()
        self._baseline()
        before = self.http.metrics()
        mode, escalated = DrainMode(cmd.drain), None
        if mode is DrainMode.WAIT:
            policy = DrainPolicy(cmd, deadline, url=self.http.url)
            waiting = _Call(lambda: self.http.pause(DrainMode.WAIT, timeout_s=self._left(deadline)))
            while not waiting.done.wait(self.tick_s):
                if policy.drain_deadline.passed():
                    break
                self._progress(progress, cmd, before, start)
            if waiting.done.is_set():
                waiting.result()  # a failed pause raises here
            else:  # a pending wait is overtaken by the pause it escalates to
                then = policy.escalate(lambda: self.http.metrics().in_flight)
                mode, escalated = then.mode, then.escalated_to
        if mode in (DrainMode.ABORT, DrainMode.KEEP):
            self.http.pause(mode, timeout_s=self._left(deadline))
        after = self.http.metrics()
        self._metrics = after
        kept = after.in_flight if mode is DrainMode.KEEP else 0
        self._kept = kept
        self._save()
        return DrainReport(
            mode=cmd.drain, escalated_to=escalated, in_flight_at_start=before.in_flight,
            completed=after.ended_since(before, *COMPLETED),
            aborted=after.ended_since(before, FinishReason.ABORT), kept=kept,
            drain_s=time.monotonic() - start)

    def _baseline(self) -> None:
        """Golden completion and weight checksums, taken while the engine still serves."""
        self.golden = self._complete_golden()
        self._weights_checked = False
        self.checksums = self.http.weight_checksums(self.step_timeout_s) \
            if self.verify_weights else None
        self._save()
        if self.verify_weights and self.checksums is None:
            log.warning("this vLLM has no /weight_checker: weights are checked by the golden "
                        "completion only")

    def _progress(self, progress, cmd: PrepareCommand, before: RequestMetrics,
                  start: float) -> None:
        try:
            now = self.http.metrics(timeout_s=min(1.0, self.tick_s * 4))
        except EngineError:  # policy: progress is best effort: the drain goes on
            return
        progress(DrainProgress(engine="", op_id=cmd.op_id, in_flight=now.in_flight,
                               completed=now.ended_since(before, *COMPLETED),
                               aborted=now.ended_since(before, FinishReason.ABORT), kept=0,
                               elapsed_s=time.monotonic() - start))

    # ------------------------------------------------------------------ memory

    @property
    def released_tags(self) -> list[str]:
        return list(self._released)

    @property
    def released_level(self) -> ReleaseLevel | None:
        return self._level

    def registered_bytes(self) -> dict[str, int]:
        return {}  # vLLM does not tell; the memory reports measure the process tree

    def reload_files(self) -> dict[str, str]:
        return {}  # vLLM reloads from its own model folder, which it does not list

    def check_prepare(self, cmd: PrepareCommand) -> None:
        """The dev-mode API does every drain mode, escalation and level (``plan`` checks the
        tags)."""

    def plan(self, level: int | None = None, tags: list[str] | None = None) -> _Plan:
        if tags:
            unknown = sorted(set(tags) - set(_TAGS))
            if unknown:
                raise UsageError("vLLM releases only these tags", tags=tags, known=list(_TAGS))
            if set(tags) == {"weights"}:
                raise UsageError("vLLM cannot release its weights alone: use level 1 or 2, or "
                                 "tags weights,kv_cache", tags=tags)
            return _Plan(level=ReleaseLevel.OFFLOAD if "weights" in tags else None,
                         tags=sorted(set(tags)))
        try:
            level = ReleaseLevel(level)
        except ValueError:  # policy: the caller's value, named
            raise UsageError("level must be 0, 1 or 2", level=level) from None
        return _Plan(level=level, tags=[] if level is ReleaseLevel.NOTHING else list(_TAGS))

    def release(self, plan: _Plan, residual_budget_bytes: int | None = None) -> MemoryReport:
        start = time.monotonic()
        before = tree_usage(self.pid)
        # recorded first: a failed release_kv_cache_memory still marks kv_cache asleep in vLLM
        self._released, self._level = list(plan.tags), plan.level
        self._save()
        if plan.level in (ReleaseLevel.OFFLOAD, ReleaseLevel.DISCARD):
            # already drained: keep leaves anything queued meanwhile queued, abort would end it
            self.http.sleep(plan.level, DrainMode.KEEP, timeout_s=self.step_timeout_s)
        elif plan.tags == ["kv_cache"]:
            self.http.release_kv_cache_memory(timeout_s=self.step_timeout_s)
        self._checkpoint_prepared = True  # recorded first too: a successor undoes it
        self._save()
        self.http.collective_rpc("checkpoint_prepare", timeout_s=self.step_timeout_s)
        report = self._report(MemoryAction.RELEASE, plan.level, plan.tags, before,
                              tree_usage(self.pid), start, budget=residual_budget_bytes)
        self._check_budget(report, residual_budget_bytes)
        return report

    @staticmethod
    def _check_budget(report: MemoryReport, budget: int | None) -> None:
        if budget is not None and report.residual_bytes > budget:
            raise ResidualOverBudgetError(
                "more memory remains after release than the budget allows",
                residual_bytes=report.residual_bytes, budget_bytes=budget)

    def rewake(self, tags: list[str] | None = None) -> MemoryReport:
        """Weights back (and reloaded after level 2) and checked while still paused, then
        the KV cache: vLLM resumes by itself once fully awake."""
        start = time.monotonic()
        before = tree_usage(self.pid)
        released, level = self._released, self._level
        self._undo_checkpoint_prepare()
        verified = 0
        if "weights" in released:
            self.http.wake_up(["weights"], timeout_s=self.step_timeout_s)
            if level == ReleaseLevel.DISCARD:
                self.http.collective_rpc("reload_weights", timeout_s=self.step_timeout_s)
            verified = self._check_weights()
        if "kv_cache" in released:
            self.http.wake_up(["kv_cache"], timeout_s=self.step_timeout_s)
        self._released, self._level = [], None
        self._save()
        report = self._report(MemoryAction.REWAKE, level, released, before,
                              tree_usage(self.pid), start)
        report.verified_tensors = verified
        return report

    def found_out_of_service(self) -> tuple[CheckpointState, str] | None:
        """Where vLLM stands when the sidecar starts, when it cannot count as RUNNING: FAILED
        and why (paused or asleep: e.g. a sidecar restarted while its engine was PREPARED);
        None while it serves. Takes over what a predecessor recorded it did to vLLM
        (``state``), so a restore undoes exactly that; forgets it when vLLM serves."""
        paused = self.http.is_paused()
        if paused or self.http.is_sleeping():
            self._adopt()
            return CheckpointState.FAILED, (
                "vLLM was found " + ("paused" if paused else "asleep") + " when the sidecar "
                "started; restore brings it back")
        self._serving()
        return None

    # ------------------------------------------------------------------ kept on disk

    def _adopt(self) -> None:
        if self.state is None:
            return
        done = self.state.state.progress
        self._released, self._level = list(done.released), done.level
        self._checkpoint_prepared, self._kept = done.checkpoint_prepared, done.kept
        self.golden, self.checksums = done.golden, done.checksums
        try:
            self.via = EngineApi(done.api) if done.api else EngineApi.VLLM_DEV
        except ValueError:  # policy: a file from elsewhere: the dev path, as before the field
            log.warning("the sidecar state names an unknown API %r: taken as vllm-dev",
                        done.api)
            self.via = EngineApi.VLLM_DEV
        self._weights_checked = False
        if done != Progress():
            log.warning("taking over from the previous sidecar: released %s (level %s), "
                        "checkpoint_prepare %s, baseline %s", done.released or "nothing",
                        done.level, "ran" if done.checkpoint_prepared else "did not run",
                        "kept" if done.golden is not None else "none")

    def _save(self) -> None:
        if self.state is None:
            return
        self.state.state.progress = Progress(
            released=list(self._released), level=self._level,
            checkpoint_prepared=self._checkpoint_prepared, kept=self._kept,
            golden=self.golden, checksums=self.checksums, api=self.via)
        self.state.save()

    def _serving(self) -> None:
        """vLLM serves again: nothing is left for a successor to undo."""
        if self.state is not None and self.state.state.progress != Progress():
            self.state.state.progress = Progress()
            self.state.save()

    def _undo_checkpoint_prepare(self) -> None:
        if self._checkpoint_prepared:
            self.http.collective_rpc("checkpoint_restore", timeout_s=self.step_timeout_s)
            self._checkpoint_prepared = False
            self._save()

    def _check_weights(self) -> int:
        if not self.checksums:
            return 0
        bad = self.http.weight_mismatches(self.checksums, timeout_s=self.step_timeout_s)
        if bad:
            raise VerificationError("weights differ from before the prepare",
                                    mismatched=len(bad), tensors=bad[:10])
        self._weights_checked = True
        return len(self.checksums)

    # ------------------------------------------------------------------ hooks

    def pause_scheduling(self) -> None:
        """Nothing to do: the drain's ``/pause`` already stopped scheduling."""

    def verify(self) -> None:
        """Weights were compared in ``rewake`` (before the last wake-up re-admits); when
        nothing was released, compare them here, still paused."""
        if not self._weights_checked:
            self._check_weights()

    def resume_scheduling(self) -> None:
        self._undo_checkpoint_prepare()  # level 0: nothing was re-woken
        if self.http.is_paused():
            self.http.resume()
        # only now does is_sleeping speak of memory alone: /resume after /sleep leaves it asleep
        if self.http.is_sleeping():
            log.warning("vLLM memory still asleep after resume: waking all of it")
            self.http.wake_up(None, timeout_s=self.step_timeout_s)
            if self.http.is_paused():
                self.http.resume()
            if self.http.is_sleeping():
                raise EngineError("vLLM still reports sleeping after a full wake-up",
                                  url=self.http.url)
        self._kept = 0
        self._verify_golden(lambda: self.http.pause(DrainMode.ABORT, timeout_s=30))

    def _verify_golden(self, out_of_service: Callable[[], object]) -> None:
        """The golden completion, as before the prepare, or ``out_of_service()`` (vLLM stops
        serving) and ``VerificationError``."""
        if self.golden is not None:
            got = None
            for _ in range(GOLDEN_ATTEMPTS):
                got = self._complete_golden()
                if got == self.golden:
                    self._serving()
                    return
            try:
                out_of_service()
            except EngineError as err:  # policy: logged; the mismatch is the error raised
                log.error("could not take vLLM out of service after a golden mismatch: %s", err)
            raise VerificationError("the golden completion differs after restore",
                                    expected=self.golden, got=got, prompt=self.golden_prompt)
        self._serving()

    def _complete_golden(self) -> str:
        return self.http.complete(self.golden_prompt, self.golden_tokens, retry_for_s=30.0,
                                  timeout_s=self.step_timeout_s, ignore_eos=True).text

    # ------------------------------------------------------------------ measuring

    def _report(self, action: MemoryAction, level: int | None, tags: list[str],
                before: dict[str, int], after: dict[str, int], start: float, *,
                budget: int | None = None) -> MemoryReport:
        devices = []
        for dev in sorted(set(before) | set(after)):
            b, a = before.get(dev, 0), after.get(dev, 0)
            devices.append(DeviceMemory(
                device=dev, before_bytes=b, after_bytes=a, freed_bytes=b - a, residual_bytes=a,
                note=("PSS of the vLLM process tree, measured" if dev == "cpu"
                      else "GPU memory of the vLLM process tree (nvidia-smi), measured")))
        gpu = [d for d in devices if d.device != "cpu"]
        counted = gpu or devices  # on a GPU the release is about GPU memory
        if not devices:
            log.warning("no PID for the vLLM server: the memory report has no measurements")
        return MemoryReport(
            action=action, level=level, tags=list(tags), budget_bytes=budget, devices=devices,
            freed_bytes=sum(d.freed_bytes for d in counted),
            residual_bytes=sum(d.residual_bytes for d in counted),
            duration_s=time.monotonic() - start)

    def _left(self, deadline: Deadline) -> float:
        left = deadline.remaining()
        return self.step_timeout_s if left is None else max(0.5, left + 5.0)


class _Call:
    """Run ``fn`` on a thread; ``done`` is set when it returned or raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.done = threading.Event()
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # policy: handed to whoever asks for the result
                self._error = exc
            finally:
                self.done.set()

        threading.Thread(target=run, name="vllm-call", daemon=True).start()

    def result(self) -> None:
        if self._error is not None:
            raise self._error
