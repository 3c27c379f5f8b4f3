"""vLLM's own checkpoint API (vLLM 0.34+, ``--enable-sleep-mode``, no dev mode), as the
sidecar drives it: ``POST /checkpoint/prepare?mode=``, ``POST /checkpoint/restore``,
``GET /checkpoint/status``.

``CheckpointApiEngine`` is the ``VllmEngine`` of a server that mounts that router. vLLM runs
its own lifecycle there (RUNNING, PREPARING, PREPARED, RESTORING, FAILED, as ours); we keep
what we add on top of it: the drain deadline, hooks between the steps, the journal, the golden
check, metrics. Each operation is checked before anything moves (``check_prepare``): what
the checkpoint API cannot do goes through the dev-mode API when the server has that too
(said in the log; the engine's status names the second API), and is refused with
``UnsupportedError`` when it has not. What the checkpoint API cannot do:

- release the weights (a level, or tags other than ``kv_cache``): vLLM's prepare releases
  its KV cache and keeps the weights on the GPU;
- escalate a ``wait`` drain (``on_deadline`` abort or keep): a prepare that began cannot be
  overtaken, so at our drain deadline the prepare fails and the rollback waits for vLLM's
  drain to end before it restores;
- leave FAILED: only a restart of vLLM does (a restore is refused, naming that).

==========  ===========================================================================
step        vLLM calls
==========  ===========================================================================
baseline    the golden completion (and weight checksums where dev mode's checker answers)
drain       ``POST /checkpoint/prepare?mode=M``, then ``/checkpoint/status`` until PREPARED:
            vLLM drains, releases its KV cache and runs ``checkpoint_prepare`` in one go;
            counts are ``/metrics`` deltas, as on the dev path
release     nothing more to call: the memory report measures from before the prepare
re-wake     ``POST /checkpoint/restore`` (once vLLM is PREPARED): vLLM wakes its KV cache
            and resumes serving
resume      the golden completion; a mismatch takes vLLM out of service again
            (``/checkpoint/prepare?mode=abort``) and fails the restore
==========  ===========================================================================

Neighbours: ``sidecar`` (``VllmEngine``, the dev path, which this extends), ``http`` (the
calls), ``state`` (what a successor sidecar takes over: ``Progress.api``), ``agent`` (calls
``check_prepare`` and ``check_restore`` before any move).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ckpt_controller.adapters.vllm.http import CheckpointAnswer, VllmHttp
from ckpt_controller.adapters.vllm.process import tree_usage
from ckpt_controller.adapters.vllm.sidecar import COMPLETED, VllmEngine
from ckpt_controller.agent.drain import DrainPolicy
from ckpt_controller.clock import Deadline
from ckpt_controller.errors import DeadlineError, EngineError, UnsupportedError
from ckpt_controller.protocol import DrainProgress, DrainReport, MemoryReport, PrepareCommand
from ckpt_controller.vocab import (
    CheckpointState,
    DrainMode,
    EngineApi,
    Escalation,
    FinishReason,
    MemoryAction,
)

log = logging.getLogger("ckpt_controller.vllm")

S = CheckpointState
#: what vLLM's checkpoint API does, as an operator's refusal says it
CAN = ("drain wait (no escalation: --on-deadline fail), abort or keep; release the KV cache "
       "only (--tags kv_cache): the weights stay on the GPU")
#: the tags the checkpoint API releases
RELEASES = ["kv_cache"]


class CheckpointApiEngine(VllmEngine):
    """The engine side of a sidecar for a vLLM that has ``/checkpoint/*``. ``dev``: the
    server has the dev-mode API too (used, and said so, for what ``/checkpoint`` cannot do).
    """

    def __init__(self, http: VllmHttp, *, dev: bool = False, dev_present: bool | None = None,
                 **kwargs) -> None:
        """``dev``: operations may go through the dev-mode API; ``dev_present``: the server
        has it (default ``dev``), so a vLLM left paused or asleep by it is found at start
        even where ``--api checkpoint`` keeps operations off it."""
        super().__init__(http, **kwargs)
        self.dev = dev
        self.dev_present = dev if dev_present is None else dev_present
        #: the API the current operation goes through (``check_prepare`` chooses)
        self.via = EngineApi.VLLM_CHECKPOINT
        self._before: dict[str, int] = {}

    @property
    def native(self) -> bool:
        return self.via is EngineApi.VLLM_CHECKPOINT

    # ------------------------------------------------------------------ before anything moves

    def check_prepare(self, cmd: PrepareCommand) -> None:
        why = cannot(cmd)
        if why is None:
            self.via = EngineApi.VLLM_CHECKPOINT
            return
        reason, change = why
        if self.dev:
            log.info("%s: through vLLM's dev-mode API: /checkpoint cannot %s", self.http.url,
                     reason)
            self.via = EngineApi.VLLM_DEV
            return
        raise UnsupportedError(f"vLLM's /checkpoint API cannot {reason}", url=self.http.url,
                               api=EngineApi.VLLM_CHECKPOINT, can=CAN,
                               change=change + ", or run vLLM with VLLM_SERVER_DEV_MODE=1 "
                                               "(its dev-mode API can)")

    def check_restore(self) -> None:
        if not self.native:
            return super().check_restore()
        answer = self.http.checkpoint_status(timeout_s=self.http.timeout_s)
        if answer.state is S.FAILED:
            raise _failed_in_vllm(answer, self.http.url)

    # ------------------------------------------------------------------ drain and release

    def drain(self, cmd: PrepareCommand, deadline: Deadline,
              progress: Callable[[DrainProgress], None]) -> DrainReport:
        if not self.native:
            return super().drain(cmd, deadline, progress)
        start = time.monotonic()
        self._baseline()
        before = self.http.metrics()
        self._before = tree_usage(self.pid)
        mode = DrainMode(cmd.drain)
        # recorded first: a successor restores whatever vLLM prepared
        self._released, self._level = list(RELEASES), None
        self._save()
        answer = self.http.checkpoint_prepare(mode, timeout_s=self.http.timeout_s)
        if answer.http_status != 200:
            self._released = []
            self._save()
            raise EngineError(f"vLLM refused /checkpoint/prepare: "
                              f"{answer.error or f'it is {answer.state}'}",
                              url=self.http.url, vllm_state=answer.state,
                              http_status=answer.http_status)
        policy = DrainPolicy(cmd, deadline, url=self.http.url)
        limit = policy.drain_deadline if mode is DrainMode.WAIT else deadline
        # abort and keep end at once in vLLM: without an operation deadline, at most this long
        unbounded = limit.remaining() is None
        while answer.state is S.PREPARING:
            if limit.passed() or (unbounded and time.monotonic() - start > self.step_timeout_s):
                # the op's deadline (exit 3), or a wait's with on_deadline fail: vLLM cannot
                # stop the drain it began, so the prepare fails and the rollback waits for it
                policy.escalate(lambda: self.http.metrics().in_flight)
                raise DeadlineError("vLLM's drain did not end in time", url=self.http.url)
            self._progress(progress, cmd, before, start)
            time.sleep(self.tick_s)
            answer = self.http.checkpoint_status(timeout_s=self.http.timeout_s)
        if answer.state is not S.PREPARED:
            raise _went(answer, "while preparing", self.http.url)
        after = self.http.metrics()
        self._metrics = after
        # what vLLM still holds now is kept, whatever the mode: after a wait, the requests
        # queued without KV blocks stay queued through the checkpoint (PAUSED_NEW)
        self._kept = after.in_flight
        self._save()
        return DrainReport(
            mode=cmd.drain, in_flight_at_start=before.in_flight,
            completed=after.ended_since(before, *COMPLETED),
            aborted=after.ended_since(before, FinishReason.ABORT), kept=self._kept,
            drain_s=time.monotonic() - start)

    def release(self, plan, residual_budget_bytes: int | None = None) -> MemoryReport:
        """vLLM released its KV cache at the end of the drain: measured from before it."""
        if not self.native:
            return super().release(plan, residual_budget_bytes)
        report = self._report(MemoryAction.RELEASE, None, RELEASES, self._before,
                              tree_usage(self.pid), time.monotonic(),
                              budget=residual_budget_bytes)
        self._check_budget(report, residual_budget_bytes)
        return report

    # ------------------------------------------------------------------ re-wake and resume

    def rewake(self, tags: list[str] | None = None) -> MemoryReport:
        if not self.native:
            return super().rewake(tags)
        start = time.monotonic()
        before = tree_usage(self.pid)
        released = self._released
        if released:
            self._restore()
        self._released = []
        self._save()
        report = self._report(MemoryAction.REWAKE, None, released, before,
                              tree_usage(self.pid), start)
        report.verified_tensors = self._check_weights()
        return report

    def resume_scheduling(self) -> None:
        """vLLM serves again since its restore; the golden completion says it serves right."""
        if not self.native:
            return super().resume_scheduling()
        answer = self.http.checkpoint_status(timeout_s=self.http.timeout_s)
        if answer.state is S.PREPARED:  # nothing was released by us, yet vLLM is prepared
            self._restore()
        elif answer.state is not S.RUNNING:
            raise _went(answer, "after its restore", self.http.url)
        self._kept = 0
        self._verify_golden(self._out_of_service)

    def _restore(self) -> None:
        """``/checkpoint/restore`` once vLLM is PREPARED (a drain it began ends first)."""
        answer = self._settled(self.http.checkpoint_status(timeout_s=self.http.timeout_s))
        if answer.state is S.PREPARED:
            answer = self._settled(self.http.checkpoint_restore(timeout_s=self.step_timeout_s))
        if answer.state is not S.RUNNING:
            raise _went(answer, "after /checkpoint/restore", self.http.url)

    def _settled(self, answer: CheckpointAnswer) -> CheckpointAnswer:
        """``answer``, or vLLM's state once it left PREPARING or RESTORING (at most
        ``step_timeout_s``: a drain vLLM began cannot be stopped, only waited for)."""
        end = time.monotonic() + self.step_timeout_s
        while answer.state in (S.PREPARING, S.RESTORING):
            if time.monotonic() > end:
                raise DeadlineError(f"vLLM stayed {answer.state} for {self.step_timeout_s:g} s",
                                    url=self.http.url)
            time.sleep(self.tick_s)
            answer = self.http.checkpoint_status(timeout_s=self.http.timeout_s)
        return answer

    def _out_of_service(self) -> None:
        """After a golden mismatch: vLLM stops serving (its requests end as aborted) and is
        PREPARED, so a restore brings it back through the same path."""
        self._released = list(RELEASES)
        self._save()
        self.http.checkpoint_prepare(DrainMode.ABORT, timeout_s=30)

    # ------------------------------------------------------------------ at start

    def found_out_of_service(self) -> tuple[CheckpointState, str] | None:
        """Where vLLM stands when the sidecar starts: None while it serves; PREPARED (taken
        over: a restore brings it back), e.g. started with ``--checkpoint-prepare-on-startup``
        or beside a sidecar that died; FAILED with vLLM's own error."""
        answer = self._settled(self.http.checkpoint_status(timeout_s=self.http.timeout_s))
        if answer.state is S.RUNNING:
            return super().found_out_of_service() if self.dev_present else self._serve_on()
        if answer.state is S.FAILED:
            return S.FAILED, str(_failed_in_vllm(answer, self.http.url))
        self._adopt()
        self.via = EngineApi.VLLM_CHECKPOINT
        self._released = list(RELEASES)
        self._save()
        return S.PREPARED, ("vLLM was found prepared (/checkpoint/status) when the sidecar "
                            "started; restore brings it back")

    def _serve_on(self) -> None:
        self._serving()
        return None


def cannot(cmd: PrepareCommand) -> tuple[str, str] | None:
    """What of ``cmd`` vLLM's checkpoint API cannot do, and what to ask instead; None when it
    can do all of it."""
    if cmd.tags and sorted(set(cmd.tags)) != RELEASES:
        return ("release " + ",".join(sorted(set(cmd.tags) - set(RELEASES)))
                + " (it releases the KV cache only)", "ask for --tags kv_cache")
    if not cmd.tags and cmd.level is not None:
        return (f"release at level {int(cmd.level)} (it releases the KV cache and keeps the "
                "weights)", "ask for --tags kv_cache instead of a level (or tags = "
                "[\"kv_cache\"] in the engine's [engine.defaults])")
    if cmd.drain == DrainMode.WAIT and cmd.on_deadline != Escalation.FAIL:
        return (f"escalate a wait drain to {cmd.on_deadline} at its deadline (a prepare that "
                "began cannot be overtaken)", "ask for --on-deadline fail, or --drain abort or "
                                              "keep")
    return None


def _went(answer: CheckpointAnswer, when: str, url: str) -> EngineError:
    """vLLM in a state it should not be in ``when`` (FAILED: with its own error)."""
    what = f"FAILED: {answer.error or 'no reason given'}" if answer.state is S.FAILED \
        else str(answer.state)
    return EngineError(f"vLLM is {what} {when}", url=url, vllm_state=answer.state,
                       vllm_error=answer.error, http_status=answer.http_status)


def _failed_in_vllm(answer: CheckpointAnswer, url: str) -> UnsupportedError:
    """A restore asked of a FAILED vLLM, refused before anything moves."""
    return UnsupportedError(
        f"vLLM is FAILED ({answer.error or 'no reason given'}): only a restart of vLLM "
        "leaves FAILED", url=url, api=EngineApi.VLLM_CHECKPOINT, vllm_error=answer.error,
        can="nothing until vLLM restarts",
        change="restart the vLLM server (then its sidecar), and restore from there")
