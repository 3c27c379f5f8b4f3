"""The steps of prepare, restore, rollback and fail, run on the agent's operation thread.

Each operation moves the lifecycle, calls the engine's hooks and the memory manager in the
order product.md fixes, and returns a reply Struct or raises a ``CkptError`` whose details
say the step and the state the engine was left in. A failed prepare always rolls back (or,
if even that fails, marks the engine FAILED): no engine is left PREPARING or RESTORING.
Neighbours: ``gate`` (admission, drain counts), ``engine`` (hooks, memory), ``server``
(which threads and sockets run this).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ckpt_controller.agent.engine import EngineHooks, ExternalDrain, MemoryManager
from ckpt_controller.agent.failpoints import Failpoints
from ckpt_controller.agent.gate import AdmissionGate
from ckpt_controller.clock import Clock, Deadline
from ckpt_controller.errors import (
    CkptError,
    DeadlineError,
    DrainError,
    EngineError,
    InvalidTransitionError,
    OperationError,
    UsageError,
)
from ckpt_controller.lifecycle import Lifecycle
from ckpt_controller.vocab import CheckpointState, Trigger
from ckpt_controller.protocol import (
    Ack,
    DrainProgress,
    DrainReport,
    MemoryReport,
    EventBody,
    FailCommand,
    MemoryReported,
    PrepareCommand,
    PrepareReply,
    RestoreCommand,
    RestoreReply,
    RollbackCommand,
)

log = logging.getLogger("ckpt_controller.agent")

#: how long aborted requests may take to report their end before the drain fails
ABORT_GRACE_S = 10.0

R = TypeVar("R")


class Operations:
    """The lifecycle operations of one engine. Not thread-safe: one operation at a time."""

    def __init__(
        self,
        *,
        engine_name: str,
        lifecycle: Lifecycle,
        gate: AdmissionGate,
        memory: MemoryManager,
        hooks: EngineHooks,
        emit: Callable[[EventBody], None],
        clock: Clock | None = None,
        progress_tick_s: float = 0.25,
        drain: ExternalDrain | None = None,
        failpoints: Failpoints | None = None,
    ) -> None:
        self.name = engine_name
        self.lifecycle = lifecycle
        self.gate = gate
        self.memory = memory
        self.hooks = hooks
        self.emit = emit
        self.clock = clock or Clock()
        self.progress_tick_s = progress_tick_s
        #: an engine that drains itself (requests outside the gate); None: drain at the gate
        self.external_drain = drain
        #: faults a drill armed (none in normal service)
        self.failpoints = failpoints or Failpoints()
        #: between the steps of a stepwise prepare / restore
        self._pending: _Pending | None = None
        self._restoring: int | None = None

    # ------------------------------------------------------------------ prepare

    def prepare(self, cmd: PrepareCommand) -> PrepareReply:
        """Drain, pause, release, seal (PREPARED); all at once, or the steps a controller asks
        for one at a time (``cmd.step``). Any failure rolls back to RUNNING."""
        start = self.clock.monotonic()
        deadline = Deadline.after(cmd.deadline_s, self.clock)
        if cmd.step in ("all", "drain"):
            plan = self._enter_preparing(cmd)
            self._pending = _Pending(plan=plan)
            steps = ("drain", "pause", "release", "seal") if cmd.step == "all" \
                else ("drain", "pause")
        else:
            if self.lifecycle.state is not CheckpointState.PREPARING or self._pending is None \
                    or (cmd.step == "seal") != (self._pending.memory is not None):
                raise InvalidTransitionError(
                    f"prepare step {cmd.step} does not follow the steps before it",
                    state=self.lifecycle.state.value, step=cmd.step,
                    allowed=["drain"] if self._pending is None else
                    ["seal" if self._pending.memory is not None else "release"])
            steps = (cmd.step,)
        pending = self._pending
        step = steps[0]
        try:
            for step in steps:
                if step != "drain":
                    self._check(deadline, cmd.op_id, step)
                if step in ("drain", "release"):
                    self.failpoints.hit(step)
                if step == "drain":
                    if self.external_drain is not None:
                        pending.drain = self._call_engine(
                            step, self.external_drain.drain, cmd, deadline, self._progress)
                    else:
                        pending.drain = self._drain(cmd, deadline)
                    if cmd.release_deadline_s is not None:  # the release's own limit
                        deadline = deadline.earlier(
                            Deadline.after(cmd.release_deadline_s, self.clock))
                elif step == "pause":
                    self._call_engine(step, self.hooks.pause_scheduling)
                elif step == "release":
                    pending.memory = self.memory.release(
                        pending.plan, residual_budget_bytes=cmd.residual_budget_bytes)
                    self.emit(MemoryReported(engine=self.name, op_id=cmd.op_id,
                                             report=pending.memory))
                else:
                    self.lifecycle.fire(Trigger.SEAL, reason=f"op {cmd.op_id}")
                    self._pending = None
        except Exception as exc:  # policy: every failure while PREPARING rolls back
            self._pending = None
            err = _typed(exc, self.name, step)
            self._roll_back_after(err, cmd.op_id)
            raise err from (None if err is exc else exc)
        return PrepareReply(
            op_id=cmd.op_id, state=self.lifecycle.state.value,
            drain=pending.drain or DrainReport(mode=cmd.drain),
            memory=pending.memory or MemoryReport(action="release"),
            duration_s=self.clock.monotonic() - start,
        )

    def _enter_preparing(self, cmd: PrepareCommand):
        """Check everything, then RUNNING -> PREPARING with admission closed; the plan."""
        self.lifecycle.check(Trigger.PREPARE)  # the state is the first thing a caller must fix
        if (cmd.level is None) == (not cmd.tags):
            raise UsageError("give a level or tags, not both and not neither",
                             level=cmd.level, tags=cmd.tags)
        if cmd.drain_timeout_s < 0:
            raise UsageError("drain timeout must not be negative", drain_timeout_s=cmd.drain_timeout_s)
        plan = self.memory.plan(level=cmd.level, tags=cmd.tags)  # bad level/tags: nothing moved
        with self.gate.lock:  # admission closes at the same instant the state leaves RUNNING
            self.lifecycle.fire(Trigger.PREPARE, reason=f"op {cmd.op_id}")
        return plan

    def _drain(self, cmd: PrepareCommand, deadline: Deadline) -> DrainReport:
        start = self.clock.monotonic()
        self.gate.begin_drain()
        escalated: str | None = None
        try:
            mode = cmd.drain
            if mode == "wait":
                drain_deadline = Deadline.after(cmd.drain_timeout_s, self.clock).earlier(deadline)
                if not self._wait_idle(drain_deadline, cmd.op_id, start):
                    # the operation's own deadline is a failure, not a reason to escalate
                    self._check(deadline, cmd.op_id, "drain")
                    if cmd.on_deadline == "fail":
                        raise DrainError(
                            "requests still in flight at the drain deadline",
                            engine=self.name, in_flight=len(self.gate.in_flight()),
                            drain_timeout_s=cmd.drain_timeout_s,
                        )
                    escalated = mode = cmd.on_deadline
                    log.info("%s: drain deadline passed, escalating to %s", self.name, mode)
            if mode == "abort":
                ids = self.gate.in_flight()
                if ids:
                    self._call_engine("drain", self.hooks.abort_requests, ids)
                grace = Deadline.after(ABORT_GRACE_S, self.clock).earlier(deadline)
                if not self._wait_idle(grace, cmd.op_id, start):
                    self._check(deadline, cmd.op_id, "drain")  # the op's deadline: exit 3
                    raise DrainError("aborted requests did not end", engine=self.name,
                                     in_flight=len(self.gate.in_flight()))
            elif mode == "keep":
                ids = self.gate.in_flight()
                if ids:
                    self._call_engine("drain", self.hooks.keep_requests, ids)
                    self.gate.mark_kept(ids)
                left = self.gate.in_flight()
                if left:  # admitted before the gate closed but unknown to the engine's keep
                    raise DrainError("requests neither ended nor kept", engine=self.name,
                                     in_flight=len(left))
            counts = self.gate.drain_counts()
        finally:
            self.gate.end_drain()
        return DrainReport(
            mode=cmd.drain, escalated_to=escalated, in_flight_at_start=counts.in_flight_at_start,
            completed=counts.completed, aborted=counts.aborted, kept=counts.kept,
            drain_s=self.clock.monotonic() - start,
        )

    def _progress(self, event: DrainProgress) -> None:
        """An external drain's progress, under this engine's name."""
        event.engine = self.name
        self.emit(event)

    def _wait_idle(self, deadline: Deadline, op_id: str, start: float) -> bool:
        def progress() -> None:
            c = self.gate.drain_counts()
            self.emit(DrainProgress(
                engine=self.name, op_id=op_id, in_flight=len(self.gate.in_flight()),
                completed=c.completed, aborted=c.aborted, kept=c.kept,
                elapsed_s=self.clock.monotonic() - start,
            ))
        return self.gate.wait_idle(deadline, tick_s=self.progress_tick_s, on_tick=progress)

    def _roll_back_after(self, err: CkptError, op_id: str) -> None:
        """After a failed prepare: back to RUNNING, or FAILED if that fails too."""
        try:
            self.lifecycle.fire(Trigger.ROLLBACK, reason=f"op {op_id}: {err.message}")
            self._rewake_and_resume(f"op {op_id} rollback")
            err.details["rolled_back"] = True
        except Exception as exc:  # policy: a failed rollback leaves FAILED, with both reasons
            again = _typed(exc, self.name, "rollback")
            err.details["rollback_error"] = str(again)
            self._fail(f"rollback after '{err.message}' failed: {again.message}")
        err.details["state"] = self.lifecycle.state.value

    # ------------------------------------------------------------------ restore, rollback, fail

    def restore(self, cmd: RestoreCommand) -> RestoreReply:
        if cmd.step == "all":
            return self._bring_back(Trigger.RESTORE, cmd.op_id, cmd.deadline_s, "")
        start = self.clock.monotonic()
        deadline = Deadline.after(cmd.deadline_s, self.clock)
        memory = None
        if cmd.step == "rewake":
            kept = self.gate.kept_count
            self.lifecycle.fire(Trigger.RESTORE, reason=f"op {cmd.op_id}")
            try:
                memory = self._rewake(cmd.op_id)
                self._check(deadline, cmd.op_id, "restore")
            except Exception as exc:  # policy: whatever failed while RESTORING, the engine is unfit
                raise self._unfit(exc, cmd.op_id) from None
            self._restoring = kept
        else:
            if self.lifecycle.state is not CheckpointState.RESTORING or self._restoring is None:
                raise InvalidTransitionError("restore step resume needs a rewake before it",
                                             state=self.lifecycle.state.value, step=cmd.step,
                                             allowed=["rewake"])
            kept, self._restoring = self._restoring, None
            try:
                self._resume(f"op {cmd.op_id}", cmd.op_id, deadline)
            except Exception as exc:  # policy: as above
                raise self._unfit(exc, cmd.op_id) from None
        return RestoreReply(
            op_id=cmd.op_id, state=self.lifecycle.state.value, generation=self.lifecycle.generation,
            memory=memory, duration_s=self.clock.monotonic() - start, resumed_kept=kept,
        )

    def _unfit(self, exc: Exception, op_id: str) -> CkptError:
        self._restoring = None
        err = _typed(exc, self.name, "restore")
        self._fail(f"op {op_id}: {err.message}")
        err.details["state"] = self.lifecycle.state.value
        return err

    def rollback(self, cmd: RollbackCommand) -> RestoreReply:
        return self._bring_back(Trigger.ROLLBACK, cmd.op_id, cmd.deadline_s, cmd.reason)

    def fail(self, cmd: FailCommand) -> Ack:
        self._pending = self._restoring = None
        self._fail(cmd.reason or f"op {cmd.op_id}")
        return Ack()

    def _bring_back(self, trigger: Trigger, op_id: str, deadline_s: float | None,
                    reason: str) -> RestoreReply:
        start = self.clock.monotonic()
        deadline = Deadline.after(deadline_s, self.clock)
        kept = self.gate.kept_count
        self.lifecycle.fire(trigger, reason=f"op {op_id}" + (f": {reason}" if reason else ""))
        try:
            memory = self._rewake_and_resume(f"op {op_id}", op_id, deadline)
        except Exception as exc:  # policy: whatever failed while RESTORING, the engine is unfit
            raise self._unfit(exc, op_id) from None
        return RestoreReply(
            op_id=op_id, state=self.lifecycle.state.value, generation=self.lifecycle.generation,
            memory=memory, duration_s=self.clock.monotonic() - start, resumed_kept=kept,
        )

    def _rewake_and_resume(self, reason: str, op_id: str | None = None,
                           deadline: Deadline | None = None):
        """RESTORING -> RUNNING: weights, then KV cache (the memory manager orders tags), then
        the engine's verification, then scheduling, then admission. A deadline that passed
        before admission reopens fails the step: the engine never serves late and unchecked."""
        memory = self._rewake(op_id)
        self._resume(reason, op_id, deadline)
        return memory

    def _rewake(self, op_id: str | None):
        """Memory back (weights first) and verified, the engine's own check; still closed."""
        self._pending = None  # a rollback abandons any half-done stepwise prepare
        self.failpoints.hit("rewake")
        memory = None
        if self.memory.released_tags:
            memory = self.memory.rewake()
            if op_id is not None:
                self.emit(MemoryReported(engine=self.name, op_id=op_id, report=memory))
        self._call_engine("verify", self.hooks.verify)
        return memory

    def _resume(self, reason: str, op_id: str | None, deadline: Deadline | None) -> None:
        """Scheduling, kept requests, then admission (RESTORED). A deadline that passed before
        admission reopens fails the step: the engine never serves late and unchecked."""
        if deadline is not None:
            self._check(deadline, op_id or "", "restore")
        self.failpoints.hit("resume")
        self._call_engine("resume", self.hooks.resume_scheduling)
        self.gate.resume_kept()
        self.lifecycle.fire(Trigger.RESUME, reason=reason)

    def _fail(self, reason: str) -> None:
        if self.lifecycle.state is not CheckpointState.FAILED:
            self.lifecycle.fire(Trigger.FAIL, reason=reason)
        log.error("%s: FAILED: %s", self.name, reason)

    # ------------------------------------------------------------------ helpers

    def _call_engine(self, step: str, fn: Callable[..., R], *args) -> R:
        try:
            return fn(*args)
        except CkptError:
            raise
        except Exception as exc:  # policy: any engine bug becomes a typed EngineError
            log.exception("%s: engine hook %s raised", self.name, step)
            raise EngineError(f"engine {step} failed: {exc!r}", engine=self.name, step=step) from exc

    def _check(self, deadline: Deadline, op_id: str, step: str) -> None:
        if deadline.passed():
            raise DeadlineError("operation deadline passed", engine=self.name, op_id=op_id,
                                step=step)


@dataclass
class _Pending:
    """What a stepwise prepare carries from one step to the next."""

    plan: object
    drain: DrainReport | None = None
    memory: MemoryReport | None = None


def _typed(exc: Exception, engine: str, step: str) -> CkptError:
    """``exc`` itself when it is one of ours, else an ``OperationError`` naming the step."""
    if isinstance(exc, CkptError):
        exc.details.setdefault("step", step)
        return exc
    log.error("%s: unexpected error in %s: %r", engine, step, exc, exc_info=exc)
    return OperationError(f"{step} failed: {exc!r}", engine=engine, step=step)
