"""The steps of prepare, restore, rollback and fail, run on the agent's operation thread.

Each operation moves the lifecycle, calls the engine's hooks and the memory manager in the
order product.md fixes, and returns a reply Struct or raises a ``CkptError`` whose details
say the step and the state the engine was left in. A failed prepare always rolls back (or,
if even that fails, marks the engine FAILED): no engine is left PREPARING or RESTORING.

The sub-steps are data: ``PREPARE_STEPS`` (drain, release, seal) and ``RESTORE_STEPS``
(rewake, resume) say which step may follow which, which lifecycle trigger each fires, which
failpoint it hits and where it checks the deadline; one loop (``Operations._run``) reads them,
for a whole chain (``step="all"``, a rollback) or one step a controller asks for. A failure
becomes an outcome (``Failed``: rolled back, or left in a state) that is turned into the
error's details in one place.
Neighbours: ``gate`` (admission, drain counts), ``drain`` (what a wait drain does at its
deadline), ``engine`` (hooks, memory), ``server`` (which threads and sockets run this),
``failpoints``, ``vocab`` (steps, triggers, modes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ckpt_controller.agent.drain import DrainPolicy
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
    described,
)
from ckpt_controller.lifecycle import Lifecycle
from ckpt_controller.protocol import (
    Ack,
    DrainProgress,
    DrainReport,
    EventBody,
    FailCommand,
    MemoryReport,
    MemoryReported,
    PrepareCommand,
    PrepareReply,
    RestoreCommand,
    RestoreReply,
    RollbackCommand,
)
from ckpt_controller.vocab import (
    CheckpointState,
    DrainMode,
    Escalation,
    MemoryAction,
    PrepareStep,
    RestoreStep,
    Trigger,
)

log = logging.getLogger("ckpt_controller.agent")

#: how long aborted requests may take to report their end before the drain fails
ABORT_GRACE_S = 10.0

R = TypeVar("R")
AgentStep = PrepareStep | RestoreStep


@dataclass(frozen=True)
class Step:
    """One sub-step of a prepare or a restore, as data. A command runs one step or, with
    ``step="all"``, its whole chain: for each step the deadline check, the failpoint, the work
    (``Operations._work``), the deadline check after it, then the trigger that ends the chain."""

    name: AgentStep
    #: the step that must have run just before it; ``None``: it begins the operation
    after: AgentStep | None
    #: the engine's state while the chain runs (a later step's command needs it)
    during: CheckpointState
    #: fired before the first step: the move that begins the operation (a rollback begins
    #: the restore chain with ``rollback`` instead)
    enters: Trigger | None = None
    #: fired after the last step: the move that ends the operation
    leaves: Trigger | None = None
    #: the failpoint hit before the work (``failpoints``)
    failpoint: AgentStep | None = None
    #: the operation's deadline is checked before the work (the drain enforces its own)
    check_before: bool = True
    #: ... and after it (a stepwise re-wake must not hand a late engine to the next step)
    check_after: bool = False


S = CheckpointState
#: drain (-> PREPARING, requests drained, scheduling paused), release, seal (-> PREPARED)
PREPARE_STEPS: tuple[Step, ...] = (
    Step(PrepareStep.DRAIN, after=None, during=S.PREPARING, enters=Trigger.PREPARE,
         failpoint=PrepareStep.DRAIN, check_before=False),
    Step(PrepareStep.RELEASE, after=PrepareStep.DRAIN, during=S.PREPARING,
         failpoint=PrepareStep.RELEASE),
    Step(PrepareStep.SEAL, after=PrepareStep.RELEASE, during=S.PREPARING, leaves=Trigger.SEAL),
)
#: rewake (-> RESTORING: memory back and verified, admission closed), resume (-> RUNNING)
RESTORE_STEPS: tuple[Step, ...] = (
    Step(RestoreStep.REWAKE, after=None, during=S.RESTORING, enters=Trigger.RESTORE,
         failpoint=RestoreStep.REWAKE, check_before=False, check_after=True),
    Step(RestoreStep.RESUME, after=RestoreStep.REWAKE, during=S.RESTORING,
         leaves=Trigger.RESUME, failpoint=RestoreStep.RESUME),
)


@dataclass(frozen=True)
class Failed:
    """The outcome of a prepare or restore that failed: the error, and how it left the
    engine (rolled back to RUNNING, or in ``state``, with the rollback's own error if that
    failed too). ``as_error`` is the one place it becomes the wire's error details."""

    error: CkptError
    state: CheckpointState
    rolled_back: bool = False
    rollback_error: str | None = None

    def as_error(self) -> CkptError:
        """The error the caller gets: details ``state``, and ``rolled_back`` when it was, or
        ``rollback_error`` when even the rollback failed."""
        if self.rolled_back:
            self.error.details["rolled_back"] = True
        if self.rollback_error is not None:
            self.error.details["rollback_error"] = self.rollback_error
        self.error.details["state"] = self.state.value
        return self.error


@dataclass
class _Pending:
    """What a stepwise operation carries from one command to the next."""

    done: AgentStep | None = None  # the last step run
    plan: object = None
    drain: DrainReport | None = None
    memory: MemoryReport | None = None
    #: requests kept when the restore began (its last step resumes them)
    kept: int = 0


@dataclass
class _Run:
    """One command's run through its steps."""

    op_id: str | None  # None: a rollback after a failed prepare (no events of its own)
    deadline: Deadline
    pending: _Pending
    cmd: PrepareCommand | None = None
    #: the step running now (or the last one run)
    step: AgentStep = PrepareStep.ALL


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
        #: between the commands of a stepwise prepare or restore
        self._pending: _Pending | None = None
        self._work: dict[AgentStep, Callable[[_Run], None]] = {
            PrepareStep.DRAIN: self._drain_step, PrepareStep.RELEASE: self._release_step,
            PrepareStep.SEAL: lambda run: None,
            RestoreStep.REWAKE: self._rewake_step, RestoreStep.RESUME: self._resume_step,
        }

    # ------------------------------------------------------------------ the steps

    def _chain(self, table: tuple[Step, ...], step: str) -> tuple[Step, ...]:
        """The steps a command runs: all of ``table``, or the one it names if it may follow
        the steps before it (else ``InvalidTransitionError`` naming the one that may)."""
        if step in (PrepareStep.ALL, RestoreStep.ALL):
            return table
        (spec,) = (s for s in table if s.name == step)
        pending = self._pending
        if spec.after is None or (pending is not None and pending.done == spec.after
                                  and self.lifecycle.state is spec.during):
            return (spec,)
        names = [s.name for s in table]
        allowed = table[0].name if pending is None or pending.done not in names \
            else table[names.index(pending.done) + 1].name
        raise InvalidTransitionError(
            f"prepare step {step} does not follow the steps before it" if table is PREPARE_STEPS
            else f"restore step {step} needs a {spec.after} before it",
            state=self.lifecycle.state.value, step=step, allowed=[allowed.value])

    def _run(self, steps: tuple[Step, ...], run: _Run, reason: str) -> None:
        """Run ``steps`` (the trigger that begins them was fired); raises what a step raised."""
        for spec in steps:
            run.step = spec.name
            if spec.check_before:
                self._check(run.deadline, run.op_id or "", self._label(spec))
            if spec.failpoint is not None:
                self.failpoints.hit(spec.failpoint)
            self._work[spec.name](run)
            if spec.check_after:
                self._check(run.deadline, run.op_id or "", self._label(spec))
            if spec.leaves is not None:
                self.lifecycle.fire(spec.leaves, reason=reason)
            run.pending.done = spec.name
        # between two commands the next step needs what this one did; after the last, nothing
        self._pending = None if steps[-1].leaves is not None else run.pending

    @staticmethod
    def _label(spec: Step) -> str:
        """The step an error names: a prepare's own steps, a restore's as a whole."""
        return spec.name.value if isinstance(spec.name, PrepareStep) else Trigger.RESTORE.value

    # ------------------------------------------------------------------ prepare

    def prepare(self, cmd: PrepareCommand) -> PrepareReply:
        """Drain, pause, release, seal (PREPARED); all at once, or the steps a controller asks
        for one at a time (``cmd.step``). Any failure rolls back to RUNNING."""
        start = self.clock.monotonic()
        steps = self._chain(PREPARE_STEPS, cmd.step)
        if steps[0].enters is not None:
            self._pending = _Pending(plan=self._enter_preparing(cmd))
        run = _Run(cmd.op_id, Deadline.after(cmd.deadline_s, self.clock), self._pending, cmd)
        try:
            self._run(steps, run, reason=f"op {cmd.op_id}")
        except Exception as exc:  # policy: every failure while PREPARING rolls back
            self._pending = None
            failed = self._roll_back_after(_typed(exc, self.name, run.step.value), cmd.op_id)
            raise failed.as_error() from (None if failed.error is exc else exc)
        return PrepareReply(
            op_id=cmd.op_id, state=self.lifecycle.state,
            drain=run.pending.drain or DrainReport(mode=cmd.drain),
            memory=run.pending.memory or MemoryReport(action=MemoryAction.RELEASE),
            duration_s=self.clock.monotonic() - start,
        )

    def _enter_preparing(self, cmd: PrepareCommand):
        """Check everything, then RUNNING -> PREPARING with admission closed; the plan."""
        enters = PREPARE_STEPS[0].enters
        self.lifecycle.check(enters)  # the state is the first thing a caller must fix
        if (cmd.level is None) == (not cmd.tags):
            raise UsageError("give a level or tags, not both and not neither",
                             level=cmd.level, tags=cmd.tags)
        if cmd.drain_timeout_s < 0:
            raise UsageError("drain timeout must not be negative", drain_timeout_s=cmd.drain_timeout_s)
        self._call_engine("check", self.hooks.check_prepare, cmd)  # what it cannot do
        plan = self.memory.plan(level=cmd.level, tags=cmd.tags)  # bad level/tags: nothing moved
        with self.gate.lock:  # admission closes at the same instant the state leaves RUNNING
            self.lifecycle.fire(enters, reason=f"op {cmd.op_id}")
        return plan

    def _drain_step(self, run: _Run) -> None:
        """Requests drained (by the engine itself or at the gate), then scheduling paused."""
        cmd = run.cmd
        if self.external_drain is not None:
            run.pending.drain = self._call_engine(PrepareStep.DRAIN, self.external_drain.drain,
                                                  cmd, run.deadline, self._progress)
        else:
            run.pending.drain = self._drain(cmd, run.deadline)
        if cmd.release_deadline_s is not None:  # the release's own limit
            run.deadline = run.deadline.earlier(Deadline.after(cmd.release_deadline_s, self.clock))
        self._check(run.deadline, run.op_id, "pause")
        self._call_engine("pause", self.hooks.pause_scheduling)

    def _release_step(self, run: _Run) -> None:
        run.pending.memory = self.memory.release(
            run.pending.plan, residual_budget_bytes=run.cmd.residual_budget_bytes)
        self.emit(MemoryReported(engine=self.name, op_id=run.op_id, report=run.pending.memory))

    def _drain(self, cmd: PrepareCommand, deadline: Deadline) -> DrainReport:
        start = self.clock.monotonic()
        self.gate.begin_drain()
        escalated: Escalation | None = None
        try:
            mode = DrainMode(cmd.drain)
            if mode is DrainMode.WAIT:
                policy = DrainPolicy(cmd, deadline, engine=self.name)
                if not self._wait_idle(policy.drain_deadline, cmd.op_id, start):
                    then = policy.escalate(lambda: len(self.gate.in_flight()))
                    mode, escalated = then.mode, then.escalated_to
            if mode is DrainMode.ABORT:
                ids = self.gate.in_flight()
                if ids:
                    self._call_engine(PrepareStep.DRAIN, self.hooks.abort_requests, ids)
                grace = Deadline.after(ABORT_GRACE_S, self.clock).earlier(deadline)
                if not self._wait_idle(grace, cmd.op_id, start):
                    self._check(deadline, cmd.op_id, PrepareStep.DRAIN)  # the op's: exit 3
                    raise DrainError("aborted requests did not end", engine=self.name,
                                     in_flight=len(self.gate.in_flight()))
            elif mode is DrainMode.KEEP:
                ids = self.gate.in_flight()
                if ids:
                    self._call_engine(PrepareStep.DRAIN, self.hooks.keep_requests, ids)
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

    def _roll_back_after(self, err: CkptError, op_id: str) -> Failed:
        """After a failed prepare: back to RUNNING, or FAILED if that fails too."""
        try:
            self.lifecycle.fire(Trigger.ROLLBACK, reason=f"op {op_id}: {err.message}")
            self._run(RESTORE_STEPS, _Run(None, Deadline.after(None, self.clock), _Pending()),
                      f"op {op_id} rollback")
            return Failed(err, self.lifecycle.state, rolled_back=True)
        except Exception as exc:  # policy: a failed rollback leaves FAILED, with both reasons
            again = _typed(exc, self.name, Trigger.ROLLBACK.value)
            self._fail(f"rollback after '{err.message}' failed: {again.message}")
            return Failed(err, self.lifecycle.state, rollback_error=str(again))

    # ------------------------------------------------------------------ restore, rollback, fail

    def restore(self, cmd: RestoreCommand) -> RestoreReply:
        """Re-wake and resume (RUNNING); all at once, or one step at a time (``cmd.step``).
        Whatever fails while RESTORING leaves the engine FAILED: it is unfit to serve."""
        steps = self._chain(RESTORE_STEPS, cmd.step)
        return self._bring_back(steps, RESTORE_STEPS[0].enters, cmd.op_id, cmd.deadline_s, "")

    def rollback(self, cmd: RollbackCommand) -> RestoreReply:
        return self._bring_back(RESTORE_STEPS, Trigger.ROLLBACK, cmd.op_id, cmd.deadline_s,
                                cmd.reason)

    def fail(self, cmd: FailCommand) -> Ack:
        self._pending = None
        self._fail(cmd.reason or f"op {cmd.op_id}")
        return Ack()

    def _bring_back(self, steps: tuple[Step, ...], trigger: Trigger, op_id: str,
                    deadline_s: float | None, reason: str) -> RestoreReply:
        start = self.clock.monotonic()
        deadline = Deadline.after(deadline_s, self.clock)
        if steps[0].enters is not None:  # a rollback enters the restore chain by its own move
            if trigger is Trigger.RESTORE:
                self.lifecycle.check(trigger)  # the state is the first thing a caller must fix
                self._call_engine("check", self.hooks.check_restore)
            pending = _Pending(kept=self.gate.kept_count)
            self.lifecycle.fire(trigger, reason=f"op {op_id}" + (f": {reason}" if reason else ""))
        else:
            pending = self._pending
        run = _Run(op_id, deadline, pending)
        try:
            self._run(steps, run, reason=f"op {op_id}")
        except Exception as exc:  # policy: whatever failed while RESTORING, the engine is unfit
            raise self._unfit(exc, op_id).as_error() from None
        return RestoreReply(
            op_id=op_id, state=self.lifecycle.state, generation=self.lifecycle.generation,
            # a resume alone re-wakes nothing: its rewake's report went with the rewake's reply
            memory=pending.memory if steps[0].enters is not None else None,
            duration_s=self.clock.monotonic() - start, resumed_kept=pending.kept,
        )

    def _unfit(self, exc: Exception, op_id: str) -> Failed:
        self._pending = None
        err = _typed(exc, self.name, Trigger.RESTORE.value)
        self._fail(f"op {op_id}: {err.message}")
        return Failed(err, self.lifecycle.state)

    def _rewake_step(self, run: _Run) -> None:
        """Memory back (weights first: the memory manager orders tags) and verified, then the
        engine's own check; admission still closed."""
        self._pending = None  # a rollback abandons any half-done stepwise prepare
        if self.memory.released_tags:
            run.pending.memory = self.memory.rewake()
            if run.op_id is not None:
                self.emit(MemoryReported(engine=self.name, op_id=run.op_id,
                                         report=run.pending.memory))
        self._call_engine("verify", self.hooks.verify)

    def _resume_step(self, run: _Run) -> None:
        """Scheduling, kept requests, then admission (the step's trigger, ``resume``). The
        deadline was checked before: the engine never serves late and unchecked."""
        self._call_engine(RestoreStep.RESUME, self.hooks.resume_scheduling)
        self.gate.resume_kept()

    def _fail(self, reason: str) -> None:
        if self.lifecycle.state is not CheckpointState.FAILED:
            self.lifecycle.fire(Trigger.FAIL, reason=reason)
        log.error("%s: FAILED: %s", self.name, reason)

    # ------------------------------------------------------------------ helpers

    def _call_engine(self, step: str, fn: Callable[..., R], *args) -> R:
        try:
            return fn(*args)
        except CkptError as exc:  # policy: ours already, typed; it names this engine too
            if exc.details.get("engine") is None:
                exc.details["engine"] = self.name
            raise
        except Exception as exc:  # policy: any engine bug becomes a typed EngineError
            log.exception("%s: engine hook %s raised", self.name, step)
            raise EngineError(f"engine {step} failed: {described(exc)}", engine=self.name,
                              step=step) from exc

    def _check(self, deadline: Deadline, op_id: str, step: str) -> None:
        if deadline.passed():
            raise DeadlineError("operation deadline passed", engine=self.name, op_id=op_id,
                                step=step)


def _typed(exc: Exception, engine: str, step: str) -> CkptError:
    """``exc`` itself when it is one of ours, else an ``OperationError`` naming the step."""
    if isinstance(exc, CkptError):
        exc.details.setdefault("step", step)
        return exc
    log.error("%s: unexpected error in %s: %s", engine, step, described(exc), exc_info=exc)
    return OperationError(f"{step} failed: {described(exc)}", engine=engine, step=step)
