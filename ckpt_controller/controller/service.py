"""The controller's operations: which engines, in which order, and what a failure undoes.

``Controller.start`` takes an ``OperationCommand``, has ``admission`` refuse it or hold its
engines (or answer a repeated id), and goes on on a thread. There it first asks every engine
and chooses a restore's image (``preflight``); a refusal there touches no engine, journals
nothing and reaches the caller as the error. Then the operation exists and runs: each
engine's ``steps`` run in an ``EngineSession``, ``fanout`` runs them across engines (rolling
for a ``cycle``), a failed all-or-nothing prepare rolls the prepared ones back. Everything is
journaled; an engine an operation lost contact with goes to the ``reconcile``r, and
``recover`` (``recovery``) settles the operations a crashed controller left running.
``adopt`` and ``give_away`` change which engines it drives (a migration between nodes):
journaled first (``roster``), then the config's roster is replaced whole, and what is kept
per engine (its link, its gauges, the server's monitor through ``on_roster``) follows.
Neighbours: ``admission``, ``preflight``, ``steps``, ``fanout``, ``reconcile``, ``recovery``,
``session``, ``journal``, ``config``, ``roster``, ``statedir`` (the state directory's lock, taken first);
``server`` is the socket in front of it; ``exit_codes`` maps a result to ``ckptctl``'s exit.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from ckpt_controller import hub
from ckpt_controller import protocol as p
from ckpt_controller.controller import openfiles, preflight, recovery, roster, steps
from ckpt_controller.controller.admission import Admission, Done
from ckpt_controller.controller.config import ControllerConfig, EngineConfig, Roster
from ckpt_controller.controller.fanout import fan_out, rolling, rolling_limit, summarize
from ckpt_controller.controller.images import ImageStore
from ckpt_controller.controller.journal import Journal
from ckpt_controller.controller.links import AgentLink, AgentLinks
from ckpt_controller.controller.outcome import Throttled, error_info, not_durable
from ckpt_controller.controller.reconcile import Reconciler
from ckpt_controller.controller.retention import JournalRetention
from ckpt_controller.controller.session import EngineSession
from ckpt_controller.controller.statedir import claim
from ckpt_controller.controller.workers import Workers
from ckpt_controller.errors import (BusyError, CkptError, OperationError, StateDirError,
                                    UsageError, described)
from ckpt_controller.vocab import OperationKind, OperationStatus, OutcomeStatus, RosterChange

log = logging.getLogger("ckpt_controller.controller")

#: the operations and records one ``history`` answer carries at most (their encoded size):
#: half of what one message may carry, leaving room for what a record's text does not count
HISTORY_BYTES = p.HARD_MAX_MESSAGE_BYTES // 2
#: the operations of each engine a starting controller looks through for its last good cycle
#: (the newest ``CARRY_OVER_FIRST`` first: reading a thousand per engine made the start of a
#: controller of 100 engines and a long journal take a third of a second)
CARRY_OVER_OPERATIONS = 1000
CARRY_OVER_FIRST = 8
#: how long a stopping controller waits for its running operations to end (plus the hook
#: grace: the time a hook it ended gets): each ends its step as at a hook failure
STOP_WAIT_S = 20.0

_summary_encoder = msgspec.msgpack.Encoder()


class Controller:
    def __init__(self, config: ControllerConfig, *, metrics=None,
                 publish: Callable[[p.EventBody], None] | None = None,
                 publish_records: Callable[[list[p.JournalRecord]], None] | None = None
                 ) -> None:
        self.config = config
        self._claim = claim(config)  # first: a second controller must not touch the journal
        try:
            self.journal = Journal(config.state_dir / "journal.sqlite3")
        except BaseException:  # policy: a controller that did not start holds nothing
            self._claim.release()
            raise
        try:
            rows = self.journal.roster()
            # the engines it adopted and gave away, before anything reads the engines
            config.set_roster(roster.replay(config, rows, str(self.journal.path)))
        except BaseException:  # policy: a malformed roster row refuses the start, cleanly
            self.journal.close()
            self._claim.release()
            raise
        #: engine -> (change, op id) of its newest roster row: a repeated adopt or
        #: give_away of the same operation is answered as done
        self._changes: dict[str, tuple[str, str]] = {r[1]: (r[2], r[3]) for r in rows}
        #: serialises adopt and give_away (the roster is replaced whole, one change at once)
        self._roster_lock = threading.Lock()
        #: told ``(engine, its config)`` after an adopt and ``(engine, None)`` after a
        #: give_away: the server's monitor and open-files limit follow the engines
        self.on_roster: list[Callable[[str, EngineConfig | None], None]] = []
        self.metrics = metrics
        self.publish = publish or (lambda body: None)
        #: journal records, in order, to subscribers (a server gathers a burst into one
        #: event); a fan-out's records go in one call per round of its hub
        self.publish_records = publish_records or (lambda recs: [
            self.publish(p.Journaled(record=rec)) for rec in recs])
        self.admission = Admission(config, self.journal)
        #: an outside holder of engines, asked before and told after each operation
        #: (``hold(op_id, kind, engines)`` raising ``BusyError``, ``free(..., result)``,
        #: ``before_resume(op_id, engine)``: None, or what a restore calls after re-wake and
        #: before re-admission): the fleet layer's locks in etcd on a node with [fleet]; None
        #: otherwise
        self.guard = None
        #: each engine's agent connection, kept open between operations
        self.links = AgentLinks(config)
        #: the threads operations run on, kept between operations
        self._operations = Workers("operation")
        self.reconciler = Reconciler(config, self.journal, self.admission, self.record,
                                     self._session)
        #: set when the controller stops (``close``): hooks end, operations are refused
        self.stopping = threading.Event()
        #: ``[journal]``'s bounds, applied while the controller serves
        self.retention = JournalRetention(config, self.journal)
        #: results the journal could not take, said at a bounded rate
        self._unwritten = Throttled(log)
        #: the capture images on disk and ``[images]``'s retention of them
        self.images = ImageStore(config.image_dir, config.images.keep, self.journal,
                                 running=self._running_on,
                                 on_bytes=metrics.images_bytes if metrics else None)
        if metrics is not None:
            self._carry_over_metrics()

    def _running_on(self, engine: str) -> list[str]:
        """The operations running on ``engine`` now (their image folders are in use)."""
        holder = self.admission.holders.get(engine)
        return [holder] if holder else []

    def _carry_over_metrics(self) -> None:
        """What the gauges said before a restart and the journal knows: each engine's last
        successful cycle (among its ``CARRY_OVER_OPERATIONS`` newest operations) and the size
        of its last capture's image; otherwise an alert on them would go blind."""
        for engine in self.config.engines:
            self._carry_over_engine(engine.name)

    def _carry_over_engine(self, engine: str) -> None:
        self.images.images_bytes(engine)  # counted from the disk, for the gauge
        ended = self._last_good_cycle(engine)
        if ended is not None:
            self.metrics.last_cycle(engine, ended)
        captures = self.journal.captures(engine, limit=1)
        if captures:
            image_dir = captures[0][1].get("image_dir")
            self.metrics.image_written(engine, Path(image_dir) if image_dir else None)

    def _last_good_cycle(self, engine: str) -> float | None:
        """When the newest cycle that succeeded on ``engine`` ended, among its newest
        ``CARRY_OVER_OPERATIONS`` operations (the newest ``CARRY_OVER_FIRST`` read first:
        most find it there); None: none did."""
        looked = 0
        for limit in (CARRY_OVER_FIRST, CARRY_OVER_OPERATIONS):
            ops = self.journal.operations(engine=engine, limit=limit)
            for op in ops[looked:]:
                if op.kind != OperationKind.CYCLE or op.duration_s is None:
                    continue
                try:
                    result = self.journal.result(op.op_id)
                except msgspec.MsgspecError as err:  # policy: costs this gauge, not the start
                    log.warning("journal: the result of %s cannot be read: %s", op.op_id, err)
                    continue
                if result is not None and any(o.engine == engine
                                              and o.status == OutcomeStatus.SUCCEEDED
                                              for o in result.engines):
                    return op.wall + op.duration_s
            if len(ops) < limit:  # the engine has no more
                return None
            looked = len(ops)
        return None

    def stop(self) -> None:
        """No operation starts from now on; running hooks are ended (SIGTERM, the hook
        grace, SIGKILL, their whole trees) and no further one starts, so each running
        operation ends its step as at a hook failure and answers its callers; they get
        ``STOP_WAIT_S`` plus the grace to end. One that has not ended by then is left
        ``running`` in the journal for the next start to recover. (The server calls this
        while it still serves, so the answers reach the callers; ``close`` after.)"""
        self.stopping.set()
        self.admission.stopping = True
        wait_s = STOP_WAIT_S + self.config.deadlines.hook_grace
        deadline = time.monotonic() + wait_s
        while self.admission.running and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.admission.running:
            log.warning("stopping with %d operations still running after %.0fs (%s): the "
                        "next start recovers them", len(self.admission.running), wait_s,
                        ", ".join(sorted(self.admission.running)))

    def close(self) -> None:
        self.stop()  # at once when the server stopped it already
        self._operations.close()
        self.reconciler.stop()
        self.retention.stop()
        self.links.close()
        self.journal.close()
        self._claim.release()

    def record(self, type_: str, data: dict, *, op_id: str | None = None,
               engine: str | None = None, wall: float | None = None,
               monotonic: float | None = None) -> p.JournalRecord:
        """Journal a record, count it, publish it. Under a hub (a fan-out's greenlets) the
        round's records are journaled together when every greenlet waits
        (``_record_round``): its ``seq`` is set then (0 until). A barrier inside the round
        (``sync``) flushes the round first."""
        rec = p.JournalRecord(seq=0, op_id=op_id, engine=engine, type=type_,
                              wall=time.time() if wall is None else wall,
                              monotonic=time.monotonic() if monotonic is None else monotonic,
                              data=data)
        hub.gather(self._record_round, rec, self._record_round)
        return rec

    def _record_round(self, recs: list[p.JournalRecord]) -> None:
        self.journal.record_all(recs)
        if self.metrics:
            counted = self.metrics.COUNTED_RECORDS
            for rec in recs:
                if rec.type in counted:  # hook failures, escalations, reconciles
                    self.metrics.journaled(rec)
        self.publish_records(recs)

    def sync(self) -> None:
        """Every record so far durable: this round's gathered ones first (``record``); the
        fsync waited for off the hub's loop, so a fan-out's other engines go on."""
        hub.flush()
        hub.blocking(self.journal.sync)

    # ---------------------------------------------------------------- accepting operations

    def select(self, names: list[str]) -> list[str]:
        return self.admission.select(names)

    def start(self, cmd: p.OperationCommand, done: Done) -> None:
        """Run ``cmd`` on a thread and call ``done(result)``; raise at once for a refusal
        known without asking the engines, and call ``done(error)`` for one found by asking
        them (``preflight.ask``). A refused request never becomes an operation: nothing is
        journaled, its id stays free, and it is counted as ``refused``."""
        try:
            engines = self.admission.accept(cmd, done)
        except CkptError:  # policy: a refusal is counted as refused and goes to the caller
            self._count(cmd.kind, "refused")
            raise
        if engines is not None:
            self._operations.submit(self._run, cmd, engines)

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

    def _refusal(self, cmd: p.OperationCommand, exc: Exception) -> CkptError:
        """What refuses ``cmd`` when ``exc`` stopped it before it began: its own typed error,
        a ``StateDirError`` naming the state dir when the journal could not be written (a full
        disk), else an ``OperationError`` saying the controller failed."""
        if isinstance(exc, CkptError):
            return exc
        if isinstance(exc, sqlite3.Error) \
                and getattr(exc, "sqlite_errorname", "") != "SQLITE_CONSTRAINT_UNIQUE":
            # (a repeated id is admission's to answer: one here is a controller error)
            return StateDirError(f"cannot begin {cmd.kind} {cmd.op_id}: the journal in "
                                 f"{self.config.state_dir} cannot be written ({exc}); nothing "
                                 "began: free space there (or fix the file system) and retry",
                                 state_dir=str(self.config.state_dir), problem=str(exc),
                                 op_id=cmd.op_id)
        return OperationError(f"controller error before the operation began: {described(exc)}",
                              op_id=cmd.op_id)

    def _refuse(self, cmd: p.OperationCommand, err: CkptError) -> None:
        """End a request that never became an operation: its engines are free again and
        every caller waiting on its id gets ``err``."""
        self._count(cmd.kind, "refused")
        waiters = self.admission.release(cmd.op_id)
        log.info("%s %s refused: %s", cmd.kind, cmd.op_id, err)
        for done in waiters:
            done(err)

    def _run(self, cmd: p.OperationCommand, engines: list[str]) -> None:
        # the engines are held: their links are this operation's, from the preflight on
        links: dict[str, AgentLink] = {}
        try:
            if self.guard is not None:  # held outside this node too (the fleet's locks)
                self.guard.hold(cmd.op_id, cmd.kind, engines)
            for e in engines:  # a link that cannot be made (its keys unreadable) refuses
                links[e] = self.links.take(e)
            statuses = preflight.ask(self.config, cmd, engines, links)
            images = (preflight.choose_images(self.config, self.journal, cmd, statuses)
                      if cmd.kind == OperationKind.RESTORE else {})
            preflight.check_images(self.config, cmd, images)  # before any CRIU runs
            params = {k: v for k, v in msgspec.to_builtins(cmd).items()
                      if k not in ("call_id", "version", "op_id", "kind", "engines")}
            self.journal.begin(cmd.op_id, cmd.kind, engines, params)
        except Exception as exc:  # policy: refused before it exists: nothing is journaled
            for e, link in links.items():
                self.links.give(e, link)
            if self.guard is not None:
                self.guard.free(cmd.op_id, cmd.kind, engines, None)
            self._refuse(cmd, self._refusal(cmd, exc))
            return
        wall, start = time.time(), time.monotonic()
        try:
            self.record("operation_start", {"kind": cmd.kind, "engines": engines},
                        op_id=cmd.op_id)
            unanswered = {e for e, status in statuses.items() if status is None}
            outcomes, peak = self._execute(cmd, engines, images, links, unanswered)
            result = summarize(cmd.op_id, cmd.kind, outcomes, wall, time.monotonic() - start)
            result.max_unavailable_seen = peak
        except Exception as exc:  # policy: a controller bug still ends the operation, journaled
            for e, link in links.items():  # those no session took
                self.links.give(e, link)
            log.exception("operation %s crashed", cmd.op_id)
            result = p.OperationResult(
                op_id=cmd.op_id, kind=cmd.kind, status=OperationStatus.FAILED, engines=[],
                wall=wall, duration_s=time.monotonic() - start,
                error=p.ErrorInfo(kind="OperationError",
                                  message=f"controller error: {described(exc)}"))
        if self.guard is not None:
            self.guard.free(cmd.op_id, cmd.kind, engines, result)
        self._finish(result)

    def _finish(self, result: p.OperationResult) -> None:
        self.record("operation_end", {"status": result.status, "duration_s": result.duration_s},
                    op_id=result.op_id)
        for outcome in result.engines:  # while the engines are still held
            self.reconciler.note_contact(result.op_id, outcome)
        # last: the result is on disk with every record before it (an engine the operation
        # lost contact with among them) before any caller hears of it
        answer: p.OperationResult | CkptError = result
        try:
            self.journal.finish(result)
        except sqlite3.Error as err:  # policy: no caller hears "succeeded" of a result
            # that is not durable (a full disk once turned such ones "interrupted" after a
            # restart): each gets the typed error; a restarted controller recovers the
            # operation as one left running (its engines are settled again)
            answer = not_durable(result, self.config.state_dir, err)
            self._unwritten.error("journal: the result of operation %s was not written: %s",
                                  result.op_id, err)
        if self.metrics:
            self.metrics.operation_finished(result.kind, result.status, result.engines)
        # what it dumped is the newest image of each engine: the older ones [images] keeps
        # no longer go (on a thread of their own)
        self.images.after_capture(o.engine for o in result.engines if o.dumped)
        for done in self.admission.release(result.op_id):
            done(answer)

    # ---------------------------------------------------------------- running them

    def _session(self, cmd: p.OperationCommand, engine: str,
                 link: AgentLink | None = None) -> EngineSession:
        overrides = {k: getattr(cmd, k) for k in
                     ("drain", "on_deadline", "level", "tags", "residual_budget_bytes")
                     if getattr(cmd, k) is not None}
        if "tags" in overrides:
            overrides["tags"] = tuple(overrides["tags"])
        params = self.config.prepare_defaults(engine).merged(overrides)
        session = EngineSession(self.config, engine, cmd.op_id, params,
                                cmd.deadline_s or self.config.deadlines.operation,
                                self.record, self.metrics, drain_timeout_s=cmd.drain_timeout_s,
                                links=self.links, link=link, sync=self.sync,
                                stop=self.stopping)
        session.hook_env = dict(cmd.hook_env)
        if self.guard is not None:  # e.g. a migration's target takes the engine over
            session.before_resume = self.guard.before_resume(cmd.op_id, engine)
        return session

    def _execute(self, cmd: p.OperationCommand, engines: list[str],
                 images: dict[str, str | None], links: dict[str, AgentLink],
                 unanswered: set[str]) -> tuple[list[p.EngineOutcome], int]:
        sessions = []
        try:
            for e in engines:
                sessions.append(self._session(cmd, e, links.pop(e)))
                sessions[-1].image = images.get(e)
                sessions[-1].unanswered = e in unanswered
            if cmd.kind == OperationKind.CYCLE:
                return rolling(sessions, rolling_limit(cmd, len(sessions)))
            if cmd.kind == OperationKind.RESTORE:
                # an engine whose process is gone (dumped with stop, or a migration) may be
                # brought back by a pre-restore hook (criu-restore): open only after it
                fan_out(sessions, steps.guarded(steps.revive_and_restore, open_first=False),
                        guard=False)
                return [s.outcome for s in sessions], len(sessions)
            reason = cmd.reason or "rollback requested"
            step = {OperationKind.PREPARE: steps.prepare, OperationKind.CAPTURE: steps.capture,
                    OperationKind.ROLLBACK: lambda s: steps.rollback(s, reason)}[cmd.kind]
            fan_out(sessions, step)
            if cmd.kind == OperationKind.PREPARE and cmd.all_or_nothing and len(sessions) > 1:
                self._all_or_nothing(sessions)
            return [s.outcome for s in sessions], len(sessions)
        finally:
            for s in sessions:
                s.close()

    @staticmethod
    def _all_or_nothing(sessions: list[EngineSession]) -> None:
        """A group prepare that failed on some engine rolls back those it prepared."""
        failed = [s.engine.name for s in sessions if s.outcome.status != OutcomeStatus.SUCCEEDED]
        if failed:
            undo = [s for s in sessions if s.outcome.status == OutcomeStatus.SUCCEEDED]
            fan_out(undo, lambda s: steps.undo_prepare(s, failed))

    # ---------------------------------------------------------------- engines left unsettled

    @property
    def unsettled(self) -> dict[str, str]:
        """Engine -> operation id, for each engine an operation lost contact with."""
        return self.reconciler.unsettled

    def start_reconciler(self) -> None:
        """Look at unsettled engines every ``reconcile_interval_s`` on a thread."""
        self.reconciler.start()

    def reconcile_unsettled(self) -> list[str]:
        return self.reconciler.reconcile_unsettled()

    # ---------------------------------------------------------------- adopted, given away

    def adopted_by(self, name: str) -> str | None:
        """The operation that adopted ``name`` here, when that is its newest roster change
        (None: a TOML engine, or one given away)."""
        change = self._changes.get(name)
        return change[1] if change is not None and change[0] == RosterChange.ADOPTED else None

    def adopt(self, engine: EngineConfig, *, op_id: str, origin: str) -> None:
        """Drive ``engine`` from now on (it came from node ``origin`` by operation
        ``op_id``), also after a restart: journaled (durable) first. Its process need not run
        yet (a restore may bring it). ``UsageError`` for a configuration the TOML would
        refuse, naming the value, and for a name this controller drives already; one it gave
        away before may come back. Repeated with the same ``op_id`` and configuration: done
        already, nothing changes."""
        data = roster.encode(engine, self.config)  # checked: UsageError naming the value
        # what a restart will read back (tags a tuple, the enums members): one form
        engine = roster.decode(data, self.config, {"file": str(self.journal.path), "seq": 0,
                                                   "engine": engine.name})
        name = engine.name
        with self._roster_lock:
            current = self.config.roster
            if name in current.by_name:
                if (self._changes.get(name) == (RosterChange.ADOPTED, op_id)
                        and current.by_name[name] == engine):
                    return  # the same adoption again: done
                raise UsageError(f"engine {name!r} is driven by this controller already; "
                                 "only an engine it does not drive (or gave away) can be "
                                 "adopted", engine=name, op_id=op_id, origin=origin)
            openfiles.ensure(len(current.by_name) + 1)  # ConfigError: no room for one more
            self.journal.roster_change(name, RosterChange.ADOPTED, op_id, origin, data)
            self._changes[name] = (RosterChange.ADOPTED, op_id)
            with self.admission.lock:
                self.config.set_roster(roster.adopted(self.config.roster, engine))
            self.links.drop(name)  # a link of an earlier stay here is not this engine's
            log.info("adopted engine %s from %s (operation %s)", name, origin, op_id)
            if self.metrics is not None:
                self.metrics.engines_known([name])
                self._carry_over_engine(name)
            for listener in self.on_roster:
                listener(name, engine)

    def give_away(self, name: str, *, op_id: str, to: str) -> None:
        """Stop driving engine ``name``: it lives on node ``to`` now (moved there by
        operation ``op_id``), also after a restart: journaled (durable) first. Its link and
        everything kept for it are dropped; a TOML entry for it is shown as moved, and
        operations on it are refused saying where it lives. ``BusyError`` while an
        operation holds it; ``UsageError`` for an engine this controller does not drive.
        Repeated with the same ``op_id``: done already, nothing changes."""
        adm = self.admission
        holder = f"give-away:{op_id}"
        with self._roster_lock:
            current = self.config.roster
            if name not in current.by_name:
                moved = current.moved.get(name)
                if moved is not None and (moved.op_id, moved.to) == (op_id, to):
                    return  # the same give-away again: done
                current.engine(name)  # UsageError: where it lives, or the known engines
            with adm.lock:  # held meanwhile: no operation may start on it
                busy = adm.holders.get(name)
                if busy is not None:
                    raise BusyError(f"engine {name} is held by operation {busy}; it can be "
                                    "given away once that ends", engine=name, holder=busy)
                adm.holders[name] = holder
            try:
                engine = current.by_name[name]
                self.journal.roster_change(name, RosterChange.GIVEN_AWAY, op_id, to,
                                           roster.encode(engine, self.config))
                self._changes[name] = (RosterChange.GIVEN_AWAY, op_id)
                with adm.lock:
                    self.config.set_roster(roster.given_away(
                        self.config.roster, name, to, op_id, time.time()))
                    self.reconciler.forget(name)
            finally:
                with adm.lock:
                    if adm.holders.get(name) == holder:
                        del adm.holders[name]
            self.links.drop(name)
            log.info("gave engine %s away to %s (operation %s)", name, to, op_id)
            if self.metrics is not None:
                self.metrics.engine_forgotten(name)
            for listener in self.on_roster:
                listener(name, None)

    # ---------------------------------------------------------------- status, history

    def status_names(self, names: list[str], current: Roster | None = None) -> list[str]:
        """The engines a status of ``names`` shows (none named: every one driven, then every
        one given away); ``UsageError`` for a name it neither drives nor gave away."""
        current = current or self.config.roster
        if not names:
            shown = [e.name for e in current.engines] + [
                n for n in current.moved if n not in current.by_name]
            if not shown:
                raise UsageError("no engines are configured")
            return shown
        for name in names:
            if name not in current.moved:
                current.engine(name)  # UsageError naming the known engines
        return list(dict.fromkeys(names))

    def status(self, names: list[str]) -> p.ControllerStatusReply:
        current = self.config.roster  # one snapshot: an adopt or give_away may run meanwhile
        engines = self.status_names(names, current)

        def view(name: str) -> p.EngineView:
            eng = current.by_name.get(name)
            if eng is None:
                moved = current.moved[name]
                return p.EngineView(engine=name, kind=moved.engine.kind,
                                    control=moved.engine.control, reachable=False,
                                    moved_to=moved.to, moved_by=moved.op_id)
            v = p.EngineView(engine=name, kind=eng.kind, control=eng.control, reachable=False,
                             holder=self.admission.holders.get(name),
                             unsettled_by=self.reconciler.unsettled_by(name),
                             images_bytes=self.images.images_bytes(name))
            try:
                v.status, v.reachable = preflight.probe(self.config, name), True
            except CkptError as err:  # policy: an unreachable engine is part of the answer
                v.error = error_info(err)
            return v

        views: dict[str, p.EngineView] = {}
        hub.each(lambda name: views.__setitem__(name, view(name)), engines, 64)
        try:
            last = self.journal.last_operations(engines)  # one query, not one per engine
        except sqlite3.Error as exc:  # policy: the agents' answers still are the reply
            log.warning("status without LAST-OP: the journal could not be read: %s", exc)
            last = {}
        for name, v in views.items():
            v.last_op = last.get(name)
        return p.ControllerStatusReply(controller_pid=os.getpid(), last_ops=True,
                                       engines=[views[e] for e in engines])

    def last_op(self, engine: str) -> str | None:
        """The id of the newest operation on ``engine`` in the journal, if any."""
        ops = self.journal.operations(engine=engine, limit=1)
        return ops[0].op_id if ops else None

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
        """Finish every operation a previous controller left running (``recovery``)."""
        return recovery.recover(self.config, self.journal, self.reconciler, self._session,
                                self._finish, stop=self.stopping)
