"""The controller's operations: which engines, in which order, and what a failure undoes.

``Controller.start`` takes an ``OperationCommand``, refuses it if another operation holds one of
its engines (``BusyError`` naming the holder), returns the stored result for an operation id
it has seen before, and otherwise goes on on a thread. There it first asks every engine and
chooses a restore's image (``preflight``); a refusal there touches no engine, journals nothing
and reaches the caller as the error. Then the operation exists and runs: each engine's steps
run in an ``EngineSession``, engines fan out concurrently (a group prepare takes about as long as its
slowest engine), a failed all-or-nothing prepare rolls the prepared ones back, and a rolling
``cycle`` keeps at most ``max_unavailable`` engines out of service. Everything is journaled;
``recover`` brings every engine of an operation interrupted by a controller crash back to
RUNNING (or leaves it FAILED, with the reason). An operation that ends without knowing where
it left an engine (the agent stopped answering, a link was cut, it was still PREPARING at a
deadline) journals ``contact_lost``; the reconciler looks at such engines every
``reconcile_interval_s`` and, once one answers and has settled, rolls a PREPARED one back to
RUNNING (and, with ``recover_uncaptured = "resume"``, restores a FAILED one that the operation
never began to capture) and journals ``reconciled``; its probes hold no engine, so an
operator's operation goes first. Neighbours: ``preflight``, ``session``, ``journal``,
``config``, ``statedir`` (the state directory's lock, taken first); ``server`` is the socket
in front of it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ckpt_controller import protocol as p
from ckpt_controller.controller import preflight
from ckpt_controller.controller.config import MAX_SECONDS, ControllerConfig
from ckpt_controller.controller.hooks import find_hooks, stop_orphan_hooks
from ckpt_controller.controller.journal import Journal
from ckpt_controller.controller.session import EngineSession
from ckpt_controller.controller.statedir import claim
from ckpt_controller.errors import (
    BusyError,
    CkptError,
    HookError,
    HookTimeoutError,
    OperationError,
    OverloadedError,
    UnreachableError,
    UsageError,
)

log = logging.getLogger("ckpt_controller.controller")

#: called once with the operation's result, or with the error that refused it
Done = Callable[[p.OperationResult | CkptError], None]
TRANSITIONAL = ("preparing", "restoring")
#: callers one running operation answers at its end; one more is shed (``OverloadedError``)
MAX_WAITERS = 64
#: the operations and records one ``history`` answer carries at most (their encoded size):
#: half of what one message may carry, leaving room for what a record's text does not count
HISTORY_BYTES = p.HARD_MAX_MESSAGE_BYTES // 2
#: the operations of each engine a starting controller looks through for its last good cycle
CARRY_OVER_OPERATIONS = 1000


@dataclass
class _Running:
    kind: str
    engines: list[str]
    waiters: list[Done] = field(default_factory=list)


_summary_encoder = msgspec.msgpack.Encoder()


def error_info(err: CkptError) -> p.ErrorInfo:
    return p.ErrorInfo(kind=err.kind, message=err.message, details=p.to_plain(err.details))


def exit_code(result: p.OperationResult) -> int:
    """0 success; 3 if a deadline passed; 4 if an engine was unreachable; 2 if every error
    was a usage error (nothing was tried); else 1."""
    if result.status == "succeeded":
        return 0
    infos = [o.error for o in result.engines if o.error] + ([result.error] if result.error else [])
    codes = {info.to_exception().exit_code for info in infos}
    for code in (3, 4):
        if code in codes:
            return code
    return 2 if codes == {2} else 1


class Controller:
    def __init__(self, config: ControllerConfig, *, metrics=None,
                 publish: Callable[[p.EventBody], None] | None = None) -> None:
        self.config = config
        self._claim = claim(config)  # first: a second controller must not touch the journal
        try:
            self.journal = Journal(config.state_dir / "journal.sqlite3")
        except BaseException:  # policy: a controller that did not start holds nothing
            self._claim.release()
            raise
        self.metrics = metrics
        self.publish = publish or (lambda body: None)
        self._lock = threading.Lock()
        self._holders: dict[str, str] = {}
        self._running: dict[str, _Running] = {}
        #: engine -> the operation that lost contact with it (kept in the journal)
        self._unsettled: dict[str, str] = self.journal.unsettled()
        self._stop = threading.Event()
        self._reconciler: threading.Thread | None = None
        if metrics is not None:
            self._carry_over_metrics()

    def _carry_over_metrics(self) -> None:
        """What the gauges said before a restart and the journal knows: each engine's last
        successful cycle (among its ``CARRY_OVER_OPERATIONS`` newest operations) and the size
        of its last capture's image; otherwise an alert on them would go blind."""
        for engine in (e.name for e in self.config.engines):
            for op in self.journal.operations(engine=engine, limit=CARRY_OVER_OPERATIONS):
                if op.kind != "cycle" or op.duration_s is None:
                    continue
                try:
                    result = self.journal.result(op.op_id)
                except msgspec.MsgspecError as err:  # policy: costs this gauge, not the start
                    log.warning("journal: the result of %s cannot be read: %s", op.op_id, err)
                    continue
                if result is not None and any(o.engine == engine and o.status == "succeeded"
                                              for o in result.engines):
                    self.metrics.last_cycle(engine, op.wall + op.duration_s)
                    break
            captures = self.journal.captures(engine)
            if captures:
                image_dir = captures[0][1].get("image_dir")
                self.metrics.image_written(engine, Path(image_dir) if image_dir else None)

    def close(self) -> None:
        self._stop.set()
        if self._reconciler is not None:
            self._reconciler.join(timeout=10)
        self.journal.close()
        self._claim.release()

    def record(self, type_: str, data: dict, **kw) -> p.JournalRecord:
        rec = self.journal.record(type_, data, **kw)
        if self.metrics:
            self.metrics.journaled(rec)  # hook failures, escalations, reconciles
        self.publish(p.Journaled(record=rec))
        return rec

    # ---------------------------------------------------------------- accepting operations

    def select(self, names: list[str]) -> list[str]:
        if not self.config.engines:
            raise UsageError("no engines are configured")
        if not names:
            return [e.name for e in self.config.engines]
        for name in names:
            self.config.engine(name)  # UsageError naming the known engines
        return list(dict.fromkeys(names))

    def start(self, cmd: p.OperationCommand, done: Done) -> None:
        """Run ``cmd`` on a thread and call ``done(result)``; raise at once for a refusal
        known without asking the engines, and call ``done(error)`` for one found by asking
        them (``preflight.ask``). A refused request never becomes an operation: nothing is
        journaled, its id stays free, and it is counted as ``refused``."""
        try:
            engines = self._accept(cmd, done)
        except CkptError:  # policy: a refusal is counted as refused and goes to the caller
            self._count(cmd.kind, "refused")
            raise
        if engines is not None:
            threading.Thread(target=self._run, args=(cmd, engines), daemon=True,
                             name=f"op-{cmd.op_id}").start()

    def _accept(self, cmd: p.OperationCommand, done: Done) -> list[str] | None:
        """Hold ``cmd``'s engines for it and return them; ``None`` when ``done`` is already
        taken care of (the id's stored result, or a running operation with that id)."""
        engines = self.select(cmd.engines)
        _check(cmd)
        with self._lock:
            known = self.journal.identity(cmd.op_id)
            running = self._running.get(cmd.op_id)
            if known is None and running is not None:
                known = (running.kind, running.engines)
            if known is not None and known != (cmd.kind, engines):
                raise UsageError(f"operation id {cmd.op_id} was already used for a {known[0]} "
                                 f"of {', '.join(known[1])}; a repeated id must repeat the "
                                 f"same operation", op_id=cmd.op_id, kind=known[0],
                                 engines=known[1])
            if running is not None:
                if len(running.waiters) >= MAX_WAITERS:
                    raise OverloadedError(
                        f"{MAX_WAITERS} callers already wait for operation {cmd.op_id}",
                        op_id=cmd.op_id, retry_after_s=1.0)
                running.waiters.append(done)
                return None
            stored = self.journal.result(cmd.op_id)
            if stored is None:
                self._hold(cmd, engines, done)
        if stored is not None:
            # answered at once, outside the lock: a burst of repeats costs no thread each
            done(stored)
            return None
        return engines

    def _hold(self, cmd: p.OperationCommand, engines: list[str], done: Done) -> None:
        """Under ``_lock``: hold ``engines`` for the new operation ``cmd``, or refuse it."""
        if self.journal.exists(cmd.op_id):
            raise BusyError("operation id belongs to an interrupted operation being "
                            "recovered", op_id=cmd.op_id)
        busy = {e: self._holders[e] for e in engines if e in self._holders}
        if busy:
            engine, holder = next(iter(busy.items()))
            raise BusyError(f"engine {engine} is held by operation {holder}",
                            engine=engine, holder=holder, busy=busy)
        for e in engines:
            self._holders[e] = cmd.op_id
        self._running[cmd.op_id] = _Running(cmd.kind, engines, [done])

    def run(self, cmd: p.OperationCommand, timeout_s: float | None = None) -> p.OperationResult:
        """``start`` and wait: for in-process callers (tests, the demo). Raises a refusal."""
        box: list[p.OperationResult | CkptError] = []
        event = threading.Event()
        self.start(cmd, lambda r: (box.append(r), event.set()))
        if not event.wait(timeout_s):
            raise OperationError("operation did not end in time", op_id=cmd.op_id)
        if isinstance(box[0], CkptError):
            raise box[0]
        return box[0]

    def _count(self, kind: str, outcome: str) -> None:
        if self.metrics:
            self.metrics.operation_finished(kind, outcome)

    def _refuse(self, cmd: p.OperationCommand, err: CkptError) -> None:
        """End a request that never became an operation: its engines are free again and
        every caller waiting on its id gets ``err``."""
        self._count(cmd.kind, "refused")
        with self._lock:
            for e in [e for e, holder in self._holders.items() if holder == cmd.op_id]:
                del self._holders[e]
            running = self._running.pop(cmd.op_id, None)
        log.info("%s %s refused: %s", cmd.kind, cmd.op_id, err)
        for done in running.waiters if running else ():
            done(err)

    def _run(self, cmd: p.OperationCommand, engines: list[str]) -> None:
        try:
            statuses = preflight.ask(self.config, cmd, engines)
            images = (preflight.choose_images(self.config, self.journal, cmd, statuses)
                      if cmd.kind == "restore" else {})
            params = {k: v for k, v in msgspec.to_builtins(cmd).items()
                      if k not in ("call_id", "version", "op_id", "kind", "engines")}
            self.journal.begin(cmd.op_id, cmd.kind, engines, params)
        except Exception as exc:  # policy: refused before it exists: nothing is journaled
            self._refuse(cmd, exc if isinstance(exc, CkptError) else OperationError(
                f"controller error before the operation began: {exc!r}", op_id=cmd.op_id))
            return
        wall, start = time.time(), time.monotonic()
        try:
            self.record("operation_start", {"kind": cmd.kind, "engines": engines},
                        op_id=cmd.op_id)
            outcomes, peak = self._execute(cmd, engines, images)
            result = _summarize(cmd.op_id, cmd.kind, outcomes, wall, time.monotonic() - start)
            result.max_unavailable_seen = peak
        except Exception as exc:  # policy: a controller bug still ends the operation, journaled
            log.exception("operation %s crashed", cmd.op_id)
            result = p.OperationResult(
                op_id=cmd.op_id, kind=cmd.kind, status="failed", engines=[], wall=wall,
                duration_s=time.monotonic() - start,
                error=p.ErrorInfo(kind="OperationError", message=f"controller error: {exc!r}"))
        self._finish(result)

    def _finish(self, result: p.OperationResult) -> None:
        self.journal.finish(result)
        self.record("operation_end", {"status": result.status, "duration_s": result.duration_s},
                    op_id=result.op_id)
        if self.metrics:
            self.metrics.operation_finished(result.kind, result.status, result.engines)
        for outcome in result.engines:  # while the engines are still held
            self._note_contact(result.op_id, outcome)
        with self._lock:
            for e in [e for e, holder in self._holders.items() if holder == result.op_id]:
                del self._holders[e]
            running = self._running.pop(result.op_id, None)
        for done in running.waiters if running else ():
            done(result)

    # ---------------------------------------------------------------- running them

    def _session(self, cmd: p.OperationCommand, engine: str) -> EngineSession:
        overrides = {k: getattr(cmd, k) for k in
                     ("drain", "on_deadline", "level", "tags", "residual_budget_bytes")
                     if getattr(cmd, k) is not None}
        if "tags" in overrides:
            overrides["tags"] = tuple(overrides["tags"])
        params = self.config.prepare_defaults(engine).merged(overrides)
        return EngineSession(self.config, engine, cmd.op_id, params,
                             cmd.deadline_s or self.config.deadlines.operation,
                             self.record, self.metrics, drain_timeout_s=cmd.drain_timeout_s)

    def _execute(self, cmd: p.OperationCommand, engines: list[str],
                 images: dict[str, str | None]):
        sessions = [self._session(cmd, e) for e in engines]
        for s in sessions:
            s.image = images.get(s.engine.name)
        try:
            if cmd.kind == "cycle":
                return self._rolling(sessions, cmd.max_unavailable or len(sessions))
            if cmd.kind == "restore":
                # an engine whose process is gone (dumped with stop, or a migration) may be
                # brought back by a pre-restore hook (criu-restore): open only after it
                _fan_out(sessions, _guarded(_revive_and_restore, open_first=False), guard=False)
                return [s.outcome for s in sessions], len(sessions)
            step = {"prepare": _prepare, "capture": _capture,
                    "rollback": lambda s: _rollback(s, cmd.reason or "rollback requested")}[cmd.kind]
            _fan_out(sessions, step)
            if cmd.kind == "prepare" and cmd.all_or_nothing and len(sessions) > 1:
                failed = [s.engine.name for s in sessions if s.outcome.status != "succeeded"]
                if failed:
                    undo = [s for s in sessions if s.outcome.status == "succeeded"]
                    _fan_out(undo, lambda s: _undo_prepare(s, failed))
            return [s.outcome for s in sessions], len(sessions)
        finally:
            for s in sessions:
                s.close()

    def _rolling(self, sessions: list[EngineSession], max_unavailable: int):
        lock = threading.Lock()
        state = {"out": 0, "peak": 0, "halt": False}

        def one(s: EngineSession) -> None:
            with lock:
                if state["halt"]:
                    s.outcome.status = "skipped"
                    return
                state["out"] += 1
                state["peak"] = max(state["peak"], state["out"])
            s.start_clock()  # the deadline counts from this engine's turn
            try:
                _cycle(s)
            finally:
                with lock:
                    state["out"] -= 1
                    if s.outcome.status != "succeeded":
                        state["halt"] = True  # a rolling cycle stops at its first failure

        _fan_out(sessions, one, workers=max_unavailable, guard=False)
        return [s.outcome for s in sessions], state["peak"]

    # ---------------------------------------------------------------- engines left unsettled

    def _note_contact(self, op_id: str, o: p.EngineOutcome) -> None:
        lost = (o.error is not None and o.error.kind == "UnreachableError") or \
            (o.status not in ("succeeded", "skipped") and o.state in (None, *TRANSITIONAL))
        if lost:
            self._unsettled[o.engine] = op_id
            self.record("contact_lost", {"state": o.state,
                                         "error": o.error.message if o.error else None},
                        op_id=op_id, engine=o.engine)
        elif o.engine in self._unsettled and o.state in ("running", "prepared", "failed"):
            was = self._unsettled.pop(o.engine)
            self.record("reconciled", {"found": o.state, "now": o.state, "by": op_id},
                        op_id=was, engine=o.engine)

    @property
    def unsettled(self) -> dict[str, str]:
        """Engine -> operation id, for each engine an operation lost contact with."""
        return dict(self._unsettled)

    def start_reconciler(self) -> None:
        """Look at unsettled engines every ``reconcile_interval_s`` on a thread."""
        def loop() -> None:
            while not self._stop.wait(self.config.reconcile_interval_s):
                try:
                    self.reconcile_unsettled()
                except Exception:  # policy: the reconciler logs and tries again next round
                    log.exception("reconciling unsettled engines failed")
        self._reconciler = threading.Thread(target=loop, name="reconciler", daemon=True)
        self._reconciler.start()

    def reconcile_unsettled(self) -> list[str]:
        """One round: every unsettled engine that answers, holds no operation and has
        settled is brought back (PREPARED -> rolled back to RUNNING). Returns those settled.

        The probe holds nothing, so an operator's operation that starts meanwhile is never
        refused because of it (an unreachable engine's probe lasts its whole timeout); the
        engine is held only once it answered, and only if no operation took it by then."""
        with self._lock:
            todo = {e: op for e, op in self._unsettled.items() if e not in self._holders
                    and any(c.name == e for c in self.config.engines)}
        settled: list[str] = []

        def one(item: tuple[str, str]) -> None:
            engine, op_id = item
            if not self._answers(engine, op_id):
                return
            holder = f"reconcile:{op_id}"
            with self._lock:
                if engine in self._holders or self._unsettled.get(engine) != op_id:
                    return  # an operation took it meanwhile: that operation settles it
                self._holders[engine] = holder
            try:
                if self._settle(engine, op_id):
                    settled.append(engine)
            finally:
                with self._lock:
                    if self._holders.get(engine) == holder:
                        del self._holders[engine]

        if todo:
            with ThreadPoolExecutor(max_workers=min(len(todo), 64)) as pool:
                list(pool.map(one, todo.items()))
        return settled

    def _answers(self, engine: str, op_id: str) -> bool:
        """Whether ``engine``'s agent answers a status request (one try, holding nothing)."""
        try:
            preflight.probe(self.config, engine)
        except CkptError as err:  # policy: not reachable yet: next round
            log.info("%s: still unsettled (operation %s): %s", engine, op_id, err.message)
            return False
        return True

    def _settle(self, engine: str, op_id: str) -> bool:
        cmd = p.OperationCommand(call_id=0, op_id=op_id, kind="rollback", engines=[engine])
        s = self._session(cmd, engine)
        try:
            status = s.client.status()
            if status.current_op:
                return False  # the agent is still finishing what it was doing
            found = status.state
            if found == "failed" and self.config.recover_uncaptured == "resume" \
                    and not self._captured(engine, op_id):
                now = _resume_uncaptured(s, op_id)
            else:
                now = _settle_state(s, found, f"reconciled after operation {op_id} lost "
                                    "contact", step="reconcile")
        except CkptError as err:  # policy: not reachable (or refused) yet: next round
            log.info("%s: still unsettled (operation %s): %s", engine, op_id, err.message)
            return False
        finally:
            s.close()
        with self._lock:
            if self._unsettled.get(engine) == op_id:
                del self._unsettled[engine]
        self.record("reconciled", {"found": found, "now": now}, op_id=op_id, engine=engine)
        log.warning("%s: reconciled after operation %s: found %s, now %s", engine, op_id,
                    found, now)
        return True

    def _captured(self, engine: str, op_id: str) -> bool:
        """Whether operation ``op_id`` may have begun capturing ``engine`` (its dump hooks may
        have run). Only a prepare or a cycle that never brought the engine to PREPARED surely
        did not: a capture runs in PREPARED, and its phase record is written at its end, so
        a controller killed in the middle of one leaves the transition and no phase."""
        known = self.journal.identity(op_id)
        if known is None or known[0] not in ("prepare", "cycle"):
            return True
        return any((r.type == "phase" and r.data.get("name") == "capture")
                   or (r.type == "transition" and r.data.get("dest") == "prepared")
                   for r in self.journal.records(engine=engine, op_id=op_id, limit=100_000))

    # ---------------------------------------------------------------- status, history

    def status(self, names: list[str]) -> p.ControllerStatusReply:
        engines = self.select(names)

        def view(name: str) -> p.EngineView:
            eng = self.config.engine(name)
            v = p.EngineView(engine=name, kind=eng.kind, control=eng.control, reachable=False,
                             holder=self._holders.get(name),
                             unsettled_by=self._unsettled.get(name))
            try:
                v.status, v.reachable = preflight.probe(self.config, name), True
            except CkptError as err:  # policy: an unreachable engine is part of the answer
                v.error = error_info(err)
            return v

        with ThreadPoolExecutor(max_workers=min(len(engines), 64)) as pool:
            views = list(pool.map(view, engines))
        return p.ControllerStatusReply(controller_pid=os.getpid(), engines=views)

    def history(self, cmd: p.HistoryCommand) -> p.HistoryReply:
        """The newest ``limit`` operations (of ``engine``, or ``op_id``) and the newest
        records of those operations only (``engine``'s own, when given); as many of each as
        fit in ``HISTORY_BYTES`` (operations first), since the answer must fit in one
        message."""
        operations, used = [], 0
        for op in self.journal.operations(engine=cmd.engine, op_id=cmd.op_id,
                                          limit=cmd.limit):  # newest first
            used += len(_summary_encoder.encode(op))
            if used > HISTORY_BYTES:
                break
            operations.append(op)
        return p.HistoryReply(operations=operations, records=self.journal.records(
            engine=cmd.engine, op_ids=[o.op_id for o in operations], limit=cmd.limit * 20,
            max_bytes=HISTORY_BYTES - used))

    # ---------------------------------------------------------------- after a crash

    def recover(self) -> list[p.OperationResult]:
        """Finish every operation a previous controller left running: each of its engines is
        brought back to RUNNING (rolled back if PREPARED) or left FAILED, with the reason."""
        results = []
        for op_id, kind, engines, _params in self.journal.unfinished():
            wall, start = time.time(), time.monotonic()
            cmd = p.OperationCommand(call_id=0, op_id=op_id, kind=kind, engines=engines)
            known = [e for e in engines if any(c.name == e for c in self.config.engines)]
            for engine in known:
                stop_orphan_hooks(self.config.image_dir / engine, op_id,
                                  grace_s=self.config.deadlines.hook_grace)
            sessions = [self._session(cmd, e) for e in known]
            # the same policy as the reconciler's: FAILED after an operation that never began
            # to capture the engine is resumed (``recover_uncaptured``)
            resume = {e for e in known if self.config.recover_uncaptured == "resume"
                      and not self._captured(e, op_id)}
            try:
                _fan_out(sessions, lambda s: _reconcile(s, self.config.deadlines.operation,
                                                        s.engine.name in resume))
            finally:
                for s in sessions:
                    s.close()
            result = p.OperationResult(op_id=op_id, kind=kind, status="interrupted",
                                       engines=[s.outcome for s in sessions], wall=wall,
                                       duration_s=time.monotonic() - start)
            self._finish(result)
            results.append(result)
        return results


# -------------------------------------------------------------------- one engine's steps


def _check(cmd: p.OperationCommand) -> None:
    if cmd.level is not None and cmd.level not in (0, 1, 2):
        raise UsageError("level must be 0, 1 or 2", level=cmd.level)
    if cmd.level is not None and cmd.tags:
        raise UsageError("give a level or tags, not both", level=cmd.level, tags=cmd.tags)
    if cmd.max_unavailable is not None and cmd.max_unavailable < 1:
        raise UsageError("max_unavailable must be at least 1", max_unavailable=cmd.max_unavailable)
    for name in ("deadline_s", "drain_timeout_s"):
        value = getattr(cmd, name)
        if value is not None and value <= 0:
            raise UsageError(f"{name} must be positive", **{name: value})
        if value is not None and value > MAX_SECONDS:
            raise UsageError(f"{name} must be at most {MAX_SECONDS:.0f} s (a day)",
                             **{name: value})
    if not cmd.op_id:
        raise UsageError("an operation needs an id")


def _guarded(step: Callable[[EngineSession], None],
             open_first: bool = True) -> Callable[[EngineSession], None]:
    def run(s: EngineSession) -> None:
        try:
            if open_first:
                s.open()
            step(s)
            if s.outcome.status == "running":
                s.outcome.status = "succeeded"
        except Exception as exc:
            # policy: a step's failure is its engine's outcome (a bug becomes a typed
            # OperationError); the other engines go on
            err = exc if isinstance(exc, CkptError) else OperationError(
                f"controller step failed: {exc!r}", engine=s.engine.name)
            if not isinstance(exc, CkptError):
                log.error("%s: step failed", s.engine.name, exc_info=exc)
            s.outcome.error = error_info(err)
            s.outcome.status = "rolled_back" if err.details.get("rolled_back") else "failed"
            state = err.details.get("state")
            if isinstance(state, str):
                s.outcome.state = state
            elif not isinstance(err, UnreachableError):  # an unreachable engine has no state
                s.outcome.state = s.refresh_state()
            s.record("error", {"kind": err.kind, "message": err.message,
                               "details": p.to_plain(err.details)})
    return run


def _fan_out(sessions: list[EngineSession], step, workers: int | None = None,
             guard: bool = True) -> None:
    """Run ``step`` for every session concurrently (``workers`` at a time)."""
    if not sessions:
        return
    with ThreadPoolExecutor(max_workers=min(workers or len(sessions), 512)) as pool:
        list(pool.map(_guarded(step) if guard else step, sessions))


def _prepare(s: EngineSession) -> None:
    s.prepare()


def _capture(s: EngineSession) -> None:
    if s.outcome.state != "prepared":
        raise UsageError(f"capture needs a PREPARED engine; {s.engine.name} is {s.outcome.state}",
                         engine=s.engine.name, state=s.outcome.state)
    try:
        s.capture()
    except CkptError as err:
        # policy: a failed (or refused) dump or post-dump rolls back when the engine lives,
        # after the pre-restore hooks gave back what the dump hooks took (CKPT_UNDO_CAPTURE:
        # e.g. the GPU that cuda-checkpoint locked); if they cannot, the engine is FAILED
        if s.refresh_state() == "prepared":
            try:
                s.hooks("pre-restore", undo_capture=True)
            except CkptError as undo:
                s.mark_failed(f"capture failed ({err.message}) and the pre-restore hooks "
                              f"could not undo it: {undo.message}")
                err.details["state"] = "failed"
                err.details["undo_error"] = undo.message
                raise err from undo
            s.rollback(f"capture failed: {err.message}", step="rollback")
            err.details["rolled_back"] = True
        raise


def _restore(s: EngineSession) -> None:
    if s.outcome.state not in ("prepared", "failed"):
        raise UsageError(f"restore needs a PREPARED or FAILED engine; {s.engine.name} is "
                         f"{s.outcome.state}", engine=s.engine.name, state=s.outcome.state)
    try:
        s.restore()
    except (HookError, HookTimeoutError) as err:
        if err.details.get("point") == "pre-restore":  # policy: pre-restore failure is FAILED
            s.mark_failed(err.message)
            err.details["state"] = "failed"
        raise


def _revive_and_restore(s: EngineSession) -> None:
    try:
        s.open()
    except UnreachableError:
        if not find_hooks(s.config.hooks_dir, "pre-restore"):
            raise
        # policy: the process is gone and pre-restore hooks may bring it back from an image
        s.use_image()
        with s.phase("pre-restore"):
            s.hooks("pre-restore")
        s.reconnect()
        s.restore(run_pre_restore=False)
        return
    _restore(s)


def _rollback(s: EngineSession, reason: str) -> None:
    s.rollback(reason)


def _cycle(s: EngineSession) -> None:
    def steps(sess: EngineSession) -> None:
        _prepare(sess)
        _capture(sess)
        sess.image = sess.outcome.image  # what this cycle dumped, if anything
        try:
            _restore(sess)
        except CkptError as err:
            # policy: a restore that never reached the agent (deadline, refused) leaves the
            # engine PREPARED: a cycle must not strand it, so roll it back
            if sess.refresh_state() == "prepared":
                sess.rollback(f"restore did not run: {err.message}")
                err.details["rolled_back"] = True
            raise
    _guarded(steps)(s)


def _undo_prepare(s: EngineSession, failed: list[str]) -> None:
    s.outcome.status = "running"  # from "succeeded": a failing rollback must not read as one
    s.rollback(f"group prepare failed on {', '.join(failed)}")
    s.outcome.status = "rolled_back"
    s.outcome.error = p.ErrorInfo(kind="OperationError",
                                  message=f"rolled back: prepare failed on {', '.join(failed)}",
                                  details={"failed": failed})


def _reconcile(s: EngineSession, wait_s: float, resume_failed: bool) -> None:
    """Wait for the agent to settle, then bring a PREPARED engine back to RUNNING (and a
    FAILED one too with ``resume_failed``: the operation never began to capture it)."""
    deadline = time.monotonic() + wait_s
    status = s.client.status()
    # an agent still running a step finishes it; one left PREPARING or RESTORING between two
    # steps (no current operation) is handled below at once
    while status.current_op and time.monotonic() < deadline:
        time.sleep(0.1)
        status = s.client.status()
    before = status.state
    if before == "failed" and resume_failed:
        s.outcome.state = _resume_uncaptured(s, s.op_id)
    else:
        s.outcome.state = _settle_state(s, before, "controller restarted: interrupted "
                                        "operation rolled back", step="recover")
    s.outcome.status = {"running": "recovered", "failed": "failed"}.get(s.outcome.state, "failed")
    s.record("reconciled", {"found": before, "now": s.outcome.state})


def _resume_uncaptured(s: EngineSession, op_id: str) -> str:
    """``recover_uncaptured = "resume"``: an engine found FAILED after operation ``op_id``
    lost contact with it before any capture (e.g. its sidecar was killed in the middle of a
    prepare and came back) is restored, as ``restore`` would; returns the state now. A
    restore that fails leaves it FAILED, with its reason; one that cannot reach the agent is
    tried again next round."""
    try:
        s.open()  # subscribed: the restore's transitions are journaled; the PID for hooks
        s.restore(run_pre_restore=False)
    except CkptError as err:  # policy: FAILED with the restore's reason, unless unreachable
        log.warning("%s: restore after operation %s lost contact failed: %s", s.engine.name,
                    op_id, err.message)
        now = s.refresh_state()
        if now is None:
            raise
        return now
    return s.refresh_state() or s.outcome.state or "failed"


def _settle_state(s: EngineSession, found: str, reason: str, step: str) -> str:
    """Bring an engine an operation left behind to a settled state; returns the state now.
    PREPARED (or PREPARING between two steps) is rolled back; RESTORING between re-wake and
    resume (re-woken and verified) is resumed; RUNNING and FAILED stay."""
    if found in ("prepared", "preparing"):
        s.rollback(reason, step=step)
    elif found == "restoring":
        s.client.restore(op_id=f"{s.op_id}/{s.engine.name}/{step}", step="resume")
    return s.refresh_state() or found


def _summarize(op_id: str, kind: str, outcomes: list[p.EngineOutcome], wall: float,
               duration: float) -> p.OperationResult:
    statuses = {o.status for o in outcomes}
    if statuses <= {"succeeded"}:
        status = "succeeded"
    elif statuses <= {"succeeded", "rolled_back", "skipped"}:
        status = "rolled_back"
    else:
        status = "failed"
    first = next((o.error for o in outcomes if o.error is not None), None)
    return p.OperationResult(op_id=op_id, kind=kind, status=status, engines=outcomes,
                             wall=wall, duration_s=duration, error=first)
