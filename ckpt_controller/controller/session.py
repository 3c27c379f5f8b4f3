"""One engine's part of one operation: its phases, hooks and journal records.

An ``EngineSession`` talks to the engine's agent (subscribed, so the agent's heartbeats bound
every wait: a dead engine fails the session within a few heartbeat intervals), runs the hook
points around each phase, journals the agent's transitions, drain and memory reports, and
fills an ``EngineOutcome``. Every hook point runs through one runner, ``at``: it runs the
point's hooks (or what stands in for them: the capture, the fleet's take-over check) and turns
any failure to run them into the step's outcome as the table says (``policy.HOOK_FAILURE``).
``prepare``, ``capture`` and ``restore`` return a ``StepOutcome``; other failures raise, for
the step to turn into an outcome. Agent operation ids are derived from the controller's
operation id (``<op>/<engine>/<step>``), so a step sent again (a retry, a restarted
controller) is not run twice. Neighbours: ``steps`` (what each operation does with a
session), ``service`` (which sessions run when), ``hooks``, ``policy``, ``outcome``,
``journal``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from ckpt_controller import hub
from ckpt_controller import protocol as p
from ckpt_controller.controller.config import ControllerConfig, PrepareDefaults
from ckpt_controller.controller.hooks import (CRIU_POINTS, HookContext, action_scripts,
                                               find_hooks, run_point)
from ckpt_controller.controller import manifest
from ckpt_controller.controller.images import folder_bytes, remove_if_empty
from ckpt_controller.controller.links import KNOWN_FRESH_S, AgentLink, AgentLinks
from ckpt_controller.controller.outcome import StepOutcome
from ckpt_controller.controller.policy import hook_failed
from ckpt_controller.errors import CkptError, DeadlineError, OperationError
from ckpt_controller.vocab import (
    CheckpointState,
    DrainMode,
    HookCondition,
    HookPoint,
    OperationKind,
    OutcomeStatus,
    PrepareStep,
    ReleaseLevel,
    RestoreStep,
)

log = logging.getLogger("ckpt_controller.controller")

#: records every step journals: (type, data, engine)
Recorder = Callable[..., p.JournalRecord]
#: what runs at a hook point: its hooks, or what stands in for them (raises when it fails)
Run = Callable[[], object]
#: engines whose capture without a dump hook was logged as a warning (later ones: debug)
_TOLD_NO_DUMP: set[str] = set()


class EngineSession:
    def __init__(self, config: ControllerConfig, engine: str, op_id: str,
                 params: PrepareDefaults, deadline_s: float, record: Recorder,
                 metrics=None, drain_timeout_s: float | None = None,
                 links: AgentLinks | None = None, link: AgentLink | None = None,
                 sync: Callable[[], None] | None = None,
                 stop: threading.Event | None = None) -> None:
        self.config = config
        #: set when the controller stops: hooks are ended and no further one starts
        self.stop = stop
        #: how long a wait drain may take before its escalation (the operation's own value,
        #: else the configured drain deadline)
        self.drain_timeout_s = drain_timeout_s or config.deadlines.drain
        self.engine = config.engine(engine)
        self.op_id = op_id
        self.params = params
        self.deadline_s = deadline_s
        self.start_clock()
        self._record = record
        #: makes what was journaled durable (the journal's barrier): before hooks run
        self._sync = sync or (lambda: None)
        self.metrics = metrics
        #: SKIPPED until a step ends (``steps.guarded`` writes how)
        self.outcome = p.EngineOutcome(engine=engine, status=OutcomeStatus.SKIPPED)
        self.pid: int | None = None
        self.generation = 0
        #: the image (the id of the operation that dumped it) a restore gives its pre-restore
        #: hooks; None: no image (the service chooses it, ``use_image`` hands it over)
        self.image: str | None = None
        #: a restore's engine the preflight asked and had no answer from (its process may be
        #: gone, and pre-restore hooks may bring it back): its hooks run without asking again
        self.unanswered = False
        self._image_dir: Path | None = None
        #: the engine's facts for the image's manifest (read before the dump hooks run)
        self._engine_facts: tuple[dict, dict] = ({}, {})
        #: the operation's own hook settings (``OperationCommand.hook_env``)
        self.hook_env: dict[str, str] = {}
        #: asked after re-wake, before the engine is admitted again; raising fails the
        #: restore (a migration's target takes the engine over here: ``Controller.guard``)
        self.before_resume: Callable[[], None] | None = None
        #: (trigger, monotonic) of each transition journaled, from events or replies
        self._journaled: set[tuple[str, float]] = set()
        self._latest = float("-inf")
        #: where the engine's link comes from and goes back to (none: a link of its own,
        #: closed with the session)
        self._parks = links is not None
        self.links = links or AgentLinks(config)
        if link is None:
            link = self.links.take(engine)
        link.on_event, link.on_reply = self._on_agent_event, self._on_agent_reply
        self.client: AgentLink = link

    @property
    def name(self) -> str:
        return self.engine.name

    def start_clock(self) -> None:
        """Start the engine's overall deadline now. A session starts it when it is made; a
        rolling cycle starts it again when the engine's turn comes, so time spent waiting for
        a place among ``max_unavailable`` is not taken from the engine's own deadline."""
        self.deadline = time.monotonic() + self.deadline_s
        self.deadline_wall = time.time() + self.deadline_s

    def reconnect(self) -> p.StatusReply:
        """A fresh connection and subscription: after a hook restored the engine's process
        from an image, the old connection belongs to a process that no longer exists."""
        self.client.close()
        self.client = self.links.fresh(self.engine.name, self._on_agent_event,
                                       self._on_agent_reply)
        return self.open()

    def close(self) -> None:
        """Give the link back (parked for the engine's next operation when it is sound);
        this operation's image folder goes when its hooks left nothing in it."""
        remove_if_empty(self._image_dir)
        if self._parks:
            self.links.give(self.engine.name, self.client)
        else:
            self.client.close()

    def record(self, type_: str, data: dict[str, Any], **kw) -> None:
        self._record(type_, data, op_id=self.op_id, engine=self.engine.name, **kw)

    # ---------------------------------------------------------------- agent events

    def _on_agent_event(self, ev: p.EventBody) -> None:
        if isinstance(ev, p.StateChanged):
            self._transition(ev.transition)
        elif isinstance(ev, p.DrainProgress):
            # with the wait's bound, so a person following it reads "12 s of at most 30 s"
            bound = self.drain_timeout_s if self.params.drain == DrainMode.WAIT else None
            self.record("drain_progress", {**msgspec.to_builtins(ev), "deadline_s": bound})

    def _on_agent_reply(self, reply: object) -> None:
        """The transitions an operation's reply lists: journal those no event brought (an
        event is lost when the connection is reopened while the agent publishes)."""
        for t in getattr(reply, "transitions", ()):
            self._transition(t)

    def _transition(self, t: p.TransitionRecord) -> None:
        key = (t.trigger, t.monotonic)
        if key in self._journaled:
            return
        self._journaled.add(key)
        if t.monotonic >= self._latest:  # a late one (from a reply) does not undo a newer one
            self._latest = t.monotonic
            self.outcome.state, self.generation = t.dest, t.generation
        self.record("transition", {"trigger": t.trigger, "source": t.source, "dest": t.dest,
                                   "generation": t.generation, "reason": t.reason},
                    wall=t.wall, monotonic=t.monotonic)
        if self.metrics:
            self.metrics.transition(self.engine.name, t.source, t.dest)

    # ---------------------------------------------------------------- steps

    def open(self) -> p.StatusReply:
        """Subscribe to the agent (a parked link still is) and read its status: what the
        link knows when it heard from the agent just now (the preflight's, or the last
        operation's), else asked; raises ``UnreachableError`` when it does not answer."""
        if not self.client.subscribed:
            self.client.subscribe()
        status = self.client.knows(KNOWN_FRESH_S) or self.client.status()
        self.pid, self.outcome.state, self.generation = status.pid, status.state, status.generation
        return status

    def remaining(self, phase_limit: float) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineError("operation deadline passed", engine=self.engine.name,
                                op_id=self.op_id, state=self.outcome.state)
        return min(left, phase_limit)

    @contextmanager
    def phase(self, name: str):
        wall, start = time.time(), time.monotonic()
        ok = False
        try:
            yield
            ok = True
        finally:
            rec = p.PhaseRecord(name=name, wall=wall, duration_s=time.monotonic() - start, ok=ok)
            self.outcome.phases.append(rec)
            self.record("phase", msgspec.to_builtins(rec))
            if self.metrics:
                self.metrics.phase(name, rec.duration_s, engine=self.engine.name)

    def hooks(self, point: str, until_wall: float | None = None,
              undo_capture: bool = False) -> int:
        """Run ``point``'s hooks, each within the ``hook`` deadline, all of them before
        ``until_wall`` when given, and within the operation's deadline. Returns how many ran;
        raises at the first failure (run a point through ``at``, which applies the table)."""
        found = find_hooks(self.config.hooks_dir, point)
        if not found:
            return 0  # nothing to run: no context to build, no image folder to make
        # write-ahead: a hook acts outside (a dump, a restore), so what led to it is on disk
        # first; recovery decides whether a capture may have begun from these records
        self._sync()  # (on a thread of its own under a hub: the others go on)
        # CRIU runs them as root: who may change them is looked at again now
        scripts = action_scripts(self.config.criu_action_scripts) if point in CRIU_POINTS \
            else ()
        ctx = HookContext(engine=self.engine.name, pid=self.pid, state=self.outcome.state or "",
                          generation=self.generation, op_id=self.op_id,
                          image_dir=self.image_dir(), deadline_wall=self.deadline_wall,
                          undo_capture=undo_capture,
                          extra_env=tuple(sorted(self.hook_env.items())), stop=self.stop,
                          criu_action_scripts=scripts)
        runs: list[p.HookRun] = []
        # said before they run (the journal's "hook" records come when they end): what a
        # person following the operation sees running
        self.record("hook_start", {"point": point, "hooks": [h.name for h in found],
                                   "timeout_s": self.config.deadlines.hook})
        try:
            # on a thread of its own under a hub: the other engines' steps go on meanwhile
            hub.blocking(lambda: run_point(self.config.hooks_dir, point, ctx,
                                           self.config.deadlines.hook, runs, until_wall,
                                           grace_s=self.config.deadlines.hook_grace))
        finally:
            for run in runs:
                self.outcome.hooks.append(run)
                self.record("hook", msgspec.to_builtins(run))
        return len(runs)

    def at(self, point: HookPoint, run: Run | None = None, *,
           condition: HookCondition = HookCondition.PLAIN, cause: CkptError | None = None,
           phase: str | None = None, then: tuple[tuple[HookPoint, Run], ...] = ()
           ) -> StepOutcome | None:
        """Run ``point``: its hooks as a phase (``hook_phase``), or ``run`` in their place,
        then each of ``then`` (further points, each with its run), all inside ``phase`` when
        one is named. On a failure the table's row for the point that failed, under
        ``condition`` (undoing ``cause``), is applied (``policy.hook_failed``): returns the
        step's outcome, or ``None`` when every point passed or the failure is only logged.

        The one place a failure to run a hook point is caught and decided on, with one catch
        set, ``CkptError``: every typed failure while a point runs is that point's failure (a
        hook's exit, ``HookError``, or timeout, ``HookTimeoutError``; a refused hook,
        ``ConfigError``; the capture deadline, ``DeadlineError``; a missing dump hook or the
        take-over check's no, ``OperationError``); anything untyped is a bug, which the step's
        guard (``steps.guarded``) reports."""
        points = ((point, run or (lambda: self.hook_phase(point))), *then)
        failed = point
        try:
            with self.phase(phase) if phase else nullcontext():
                for failed, step in points:
                    step()
        except CkptError as err:  # policy: a typed failure to run a point: the table decides
            return hook_failed(self, failed, err, condition, cause)
        return None

    def hook_phase(self, point: HookPoint) -> int:
        """``point``'s hooks as a phase of their own; a point with no hooks is no phase (no
        record, no timing): how many ran."""
        if not self.has_hooks(point):
            return 0
        with self.phase(point):
            return self.hooks(point)

    def image_dir(self) -> Path:
        """This operation's image folder for the engine, made on first use."""
        if self._image_dir is None:
            path = self.config.image_dir / self.engine.name / self.op_id.replace("/", "_")
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._image_dir = path
        return self._image_dir

    def prepare(self) -> StepOutcome:
        d = self.config.deadlines
        if (out := self.at(HookPoint.PRE_PREPARE)) is not None:
            return out
        prm = self.params
        args = dict(drain=prm.drain, on_deadline=prm.on_deadline, level=prm.level,
                    tags=list(prm.tags) if prm.tags else None,
                    residual_budget_bytes=prm.residual_budget_bytes)
        stepwise = self.has_hooks(HookPoint.POST_DRAIN) or self.has_hooks(HookPoint.POST_RELEASE)
        drain = self.drain_timeout_s
        # the escalation at the drain timeout (abort, keep) has the release allowance to finish
        if not stepwise:  # one round trip when no hook needs to run inside PREPARING
            with self.phase(OperationKind.PREPARE):
                reply = self.client.prepare(
                    op_id=f"{self.op_id}/{self.engine.name}/prepare",
                    drain_timeout_s=self.remaining(drain),
                    deadline_s=self.remaining(drain + 2 * d.release),
                    release_deadline_s=d.release, **args)
        else:
            with self.phase(PrepareStep.DRAIN):
                reply = self.client.prepare(
                    op_id=f"{self.op_id}/{self.engine.name}/drain", step=PrepareStep.DRAIN,
                    drain_timeout_s=self.remaining(drain),
                    deadline_s=self.remaining(drain + d.release), **args)
            if (out := self.at(HookPoint.POST_DRAIN)) is not None:
                return out
            with self.phase(PrepareStep.RELEASE):
                released = self.client.prepare(
                    op_id=f"{self.op_id}/{self.engine.name}/release", step=PrepareStep.RELEASE,
                    deadline_s=self.remaining(d.release), **args)
            if (out := self.at(HookPoint.POST_RELEASE)) is not None:
                return out
            with self.phase(PrepareStep.SEAL):
                sealed = self.client.prepare(
                    op_id=f"{self.op_id}/{self.engine.name}/seal", step=PrepareStep.SEAL,
                    deadline_s=self.remaining(d.release), **args)
            reply = msgspec.structs.replace(sealed, drain=reply.drain, memory=released.memory)
        self.outcome.state, self.outcome.drain = reply.state, reply.drain
        self.outcome.released = reply.memory
        self.record("drain", msgspec.to_builtins(reply.drain))
        self.record("memory", msgspec.to_builtins(reply.memory))
        if self.metrics:
            self.metrics.drained(reply.drain.completed, reply.drain.aborted, reply.drain.kept)
            self.metrics.freed_bytes(max(0, reply.memory.freed_bytes))
        return StepOutcome.succeeded()

    def has_hooks(self, point: str) -> bool:
        return bool(find_hooks(self.config.hooks_dir, point))

    def capture(self) -> StepOutcome:
        """The dump and post-dump hooks, as one phase, together within the ``capture``
        deadline (and each within ``hook``). A failure at either (a missing dump hook where
        ``require_dump`` asks for one, the capture deadline) is undone as the table says."""
        if (out := self.at(HookPoint.DUMP, self._dump_hook_required)) is not None:
            return out
        end, ran = [0.0], [0]  # the capture's deadline (wall clock), dump hooks that ran

        def dump() -> None:
            end[0] = time.time() + self.remaining(self.config.deadlines.capture)
            if self.has_hooks(HookPoint.DUMP):  # read while the process is there to read
                self._engine_facts = self._read_engine_facts()
            ran[0] = self.hooks(HookPoint.DUMP, until_wall=end[0])
            if time.time() >= end[0]:
                raise DeadlineError("capture deadline passed after the dump hooks",
                                    engine=self.engine.name, op_id=self.op_id,
                                    capture_s=self.config.deadlines.capture)

        post_dump = (HookPoint.POST_DUMP,
                     lambda: self.hooks(HookPoint.POST_DUMP, until_wall=end[0]))
        out = self.at(HookPoint.DUMP, dump, phase=OperationKind.CAPTURE, then=(post_dump,))
        if out is None:
            self._captured(ran[0] > 0)
        return out or StepOutcome.succeeded()

    def _dump_hook_required(self) -> None:
        if self.config.require_dump and not self.has_hooks(HookPoint.DUMP):
            raise OperationError(f"no dump hook to capture {self.engine.name} with, and "
                                 f"[controller] require_dump = true", engine=self.engine.name,
                                 hooks_dir=str(self.config.hooks_dir))

    def _read_engine_facts(self) -> tuple[dict, dict]:
        """What the image's manifest says of the engine (``manifest.engine_facts``): the
        model files only when a restore of it reads them (weights discarded, level 2; at
        levels 0 and 1 the weights are in the image)."""
        try:
            status = self.client.status()
            files = status.reload_files if status.released_level == ReleaseLevel.DISCARD \
                else {}
        except CkptError as err:  # policy: the dump says whether the engine is there
            log.warning("%s: no status before the dump: %s", self.engine.name, err)
            files = {}
        return manifest.engine_facts(self.pid, self.engine.kind, files)

    def _write_manifest(self) -> None:
        """What a restore of this image needs of its host, beside it (``manifest``)."""
        folder = self.image_dir()
        try:
            manifest.write(folder, self.engine.name, self.op_id, *self._engine_facts,
                           image_bytes=folder_bytes(folder))
        except OSError as err:  # policy: the image stands; a restore of it goes unchecked
            log.error("%s: the manifest of image %s could not be written (%s): a restore "
                      "of it is not checked", self.engine.name, self.op_id, err)

    def _captured(self, dumped: bool) -> None:
        """A good capture: in the outcome, the journal and the metrics."""
        if dumped:
            self._write_manifest()
        self.outcome.dumped, self.outcome.image = dumped, self.op_id if dumped else None
        # a good capture only: what a later restore chooses its image by (``service``)
        self.record("capture", {"dumped": dumped, "generation": self.generation,
                                "image_dir": str(self.image_dir()) if dumped else None})
        if not dumped:
            # said once per engine (the outcome says it every time): a fleet cycled without
            # dump hooks would otherwise log a line per engine per cycle
            level = logging.DEBUG if self.engine.name in _TOLD_NO_DUMP else logging.WARNING
            _TOLD_NO_DUMP.add(self.engine.name)
            log.log(level, "%s: capture %s ran no dump hook: nothing was captured",
                    self.engine.name, self.op_id)
        if self.metrics:  # the folder exists only if a hook ran (a dump, a post-dump)
            self.metrics.image_written(self.engine.name, self._image_dir)

    def restore(self, run_pre_restore: bool = True) -> StepOutcome:
        d = self.config.deadlines
        if run_pre_restore:
            runs = len(self.outcome.hooks)
            if (out := self.at(HookPoint.PRE_RESTORE, self.pre_restore)) is not None:
                return out
            if len(self.outcome.hooks) > runs:  # a hook ran: it may have restored the
                self.reconnect()  # process from an image
        base = f"{self.op_id}/{self.engine.name}"
        if not self.has_hooks(HookPoint.POST_RESTORE) and self.before_resume is None:
            with self.phase(OperationKind.RESTORE):
                reply = self.client.restore(op_id=f"{base}/restore",
                                            deadline_s=self.remaining(d.restore))
        else:  # post-restore hooks check the engine after re-wake, before re-admission
            with self.phase(RestoreStep.REWAKE):
                rewoken = self.client.restore(op_id=f"{base}/rewake", step=RestoreStep.REWAKE,
                                              deadline_s=self.remaining(d.restore))
            # a phase even when only the take-over check made the restore stepwise
            post_restore = partial(self.hooks, HookPoint.POST_RESTORE)
            out = self.at(HookPoint.POST_RESTORE, post_restore, phase=HookPoint.POST_RESTORE)
            if out is not None or (out := self.taken_over()) is not None:
                return out
            with self.phase(RestoreStep.RESUME):
                reply = self.client.restore(op_id=f"{base}/resume", step=RestoreStep.RESUME,
                                            deadline_s=self.remaining(d.restore))
            reply = msgspec.structs.replace(reply, memory=rewoken.memory)
        self.outcome.state, self.outcome.rewoken = reply.state, reply.memory
        self.outcome.generation = reply.generation
        if reply.memory is not None:
            self.record("memory", msgspec.to_builtins(reply.memory))
        post_resume = partial(self.hooks, HookPoint.POST_RESUME)
        return self.at(HookPoint.POST_RESUME, post_resume) or StepOutcome.succeeded()

    def taken_over(self) -> StepOutcome | None:
        """The fleet's check that this node may admit the engine (``before_resume``), if
        there is one: ``None`` when it may, else what the table says of its no."""
        if self.before_resume is None:
            return None
        return self.at(HookPoint.POST_RESTORE, self.before_resume,
                       condition=HookCondition.TAKING_OVER)

    def undo_capture(self, cause: CkptError) -> StepOutcome | None:
        """After the failed capture ``cause``: the pre-restore hooks with
        ``CKPT_UNDO_CAPTURE=1`` give back what the dump hooks took. ``None`` when they did,
        else what the table says of their failure."""
        undo = partial(self.hooks, HookPoint.PRE_RESTORE, undo_capture=True)
        return self.at(HookPoint.PRE_RESTORE, undo, condition=HookCondition.UNDOING_CAPTURE,
                       cause=cause)

    def pre_restore(self) -> None:
        """What runs at pre-restore: this restore's image named (``use_image``), then the
        pre-restore hooks as a phase (raises when they fail or are refused)."""
        self.use_image()
        self.hook_phase(HookPoint.PRE_RESTORE)

    def use_image(self) -> None:
        """Before the pre-restore hooks: name this restore's image in its outcome and point
        ``<image_dir>/<engine>/latest`` (where criu-restore looks by default) at it; with no
        image, remove that link, so no hook revives an image this restore did not name."""
        self.outcome.image = self.image
        if not self.has_hooks(HookPoint.PRE_RESTORE):
            return
        folder = self.config.image_dir / self.engine.name
        link = folder / "latest"
        if self.image is None:
            link.unlink(missing_ok=True)
            return
        tmp = folder / f".latest-{self.op_id.replace('/', '_')}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.image.replace("/", "_"))
        tmp.replace(link)  # atomically: a reader sees the old link or the new one

    def rollback(self, reason: str, step: str = "rollback") -> None:
        with self.phase(step):
            reply = self.client.rollback(op_id=f"{self.op_id}/{self.engine.name}/{step}",
                                         reason=reason,
                                         deadline_s=self.config.deadlines.restore)
        self.outcome.state, self.outcome.rewoken = reply.state, reply.memory

    def mark_failed(self, reason: str) -> None:
        """Tell the agent the engine is FAILED (e.g. a pre-restore hook failed); the table
        runs the on-fail hooks after it (``on_failed``)."""
        try:
            self.client.fail(reason=reason, op_id=f"{self.op_id}/{self.engine.name}/fail")
            self.outcome.state = CheckpointState.FAILED
        except CkptError as exc:  # policy: the original failure is what the caller reports
            log.warning("%s: could not mark FAILED: %s", self.engine.name, exc)

    def on_failed(self) -> StepOutcome | None:
        """The on-fail hooks, after the engine was marked FAILED: ``None`` when they passed
        or their failure is only logged (as the table has it)."""
        return self.at(HookPoint.ON_FAIL, partial(self.hooks, HookPoint.ON_FAIL))

    def refresh_state(self) -> str | None:
        """The agent's state now, or ``None`` if it does not answer."""
        try:
            status = self.client.status()
        except CkptError:  # policy: unknown is an answer too
            return None
        self.outcome.state, self.generation = status.state, status.generation
        return status.state
