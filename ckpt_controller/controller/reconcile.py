"""Engines an operation lost contact with: noted, looked at again, and settled.

An operation that ends without knowing where it left an engine (the agent stopped answering,
a link was cut, it was still PREPARING or RESTORING at a deadline) journals ``contact_lost``
and the ``Reconciler`` keeps the engine as unsettled. Every ``reconcile_interval_s`` it probes
each unsettled engine (holding nothing, so an operator's operation goes first) and, once one
answers and has settled, holds it briefly and rolls a PREPARED one back to RUNNING (and, with
``recover_uncaptured = "resume"``, restores a FAILED one the operation never began to
capture), journaling ``reconciled``. A later operation that finds the engine settled ends the
matter too. ``settle_state`` and ``resume_uncaptured`` are shared with crash recovery.
Neighbours: ``service`` (which owns one), ``admission`` (the engine holds), ``preflight``
(the probe), ``session``, ``journal``; ``recovery`` uses the same settling.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ckpt_controller import hub
from ckpt_controller import protocol as p
from ckpt_controller.controller import preflight
from ckpt_controller.controller.admission import Admission
from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.controller.journal import Journal
from ckpt_controller.controller.outcome import StepOutcome, error_info
from ckpt_controller.controller.session import EngineSession
from ckpt_controller.errors import CkptError
from ckpt_controller.vocab import (
    TRANSITIONAL,
    CheckpointState,
    OperationKind,
    OutcomeStatus,
    RecoverUncaptured,
    RestoreStep,
)

log = logging.getLogger("ckpt_controller.controller")

#: engine states in which an operation may leave an engine and know where it is
_SETTLED = (CheckpointState.RUNNING, CheckpointState.PREPARED, CheckpointState.FAILED)
#: makes a session for (command, engine)
SessionFactory = Callable[[p.OperationCommand, str], EngineSession]


class Reconciler:
    def __init__(self, config: ControllerConfig, journal: Journal, admission: Admission,
                 record: Callable[..., p.JournalRecord], session: SessionFactory) -> None:
        self.config = config
        self.journal = journal
        self.admission = admission
        self.record = record
        self.session = session
        #: engine -> the operation that lost contact with it (kept in the journal)
        self._unsettled: dict[str, str] = journal.unsettled()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def unsettled(self) -> dict[str, str]:
        """Engine -> operation id, for each engine an operation lost contact with."""
        return dict(self._unsettled)

    def unsettled_by(self, engine: str) -> str | None:
        return self._unsettled.get(engine)

    def forget(self, engine: str) -> None:
        """``engine`` was given away: no longer this controller's to settle (its journal
        keeps the records). Called under the admission lock."""
        self._unsettled.pop(engine, None)

    def note_contact(self, op_id: str, o: p.EngineOutcome) -> None:
        """After operation ``op_id``: note an engine it lost contact with, or settle one an
        earlier operation lost and this one found settled."""
        lost = (o.error is not None and o.error.kind == "UnreachableError") or \
            (o.status not in (OutcomeStatus.SUCCEEDED, OutcomeStatus.SKIPPED)
             and o.state in (None, *TRANSITIONAL))
        if lost:
            self._unsettled[o.engine] = op_id
            self.record("contact_lost", {"state": o.state,
                                         "error": o.error.message if o.error else None},
                        op_id=op_id, engine=o.engine)
        elif o.engine in self._unsettled and o.state in _SETTLED:
            was = self._unsettled.pop(o.engine)
            self.record("reconciled", {"found": o.state, "now": o.state, "by": op_id},
                        op_id=was, engine=o.engine)

    def start(self) -> None:
        """Look at unsettled engines every ``reconcile_interval_s`` on a thread."""
        def loop() -> None:
            while not self._stop.wait(self.config.reconcile_interval_s):
                try:
                    self.reconcile_unsettled()
                except Exception:  # policy: the reconciler logs and tries again next round
                    log.exception("reconciling unsettled engines failed")
        self._thread = threading.Thread(target=loop, name="reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def reconcile_unsettled(self) -> list[str]:
        """One round: every unsettled engine that answers, holds no operation and has
        settled is brought back (PREPARED -> rolled back to RUNNING). Returns those settled.

        The probe holds nothing, so an operator's operation that starts meanwhile is never
        refused because of it (an unreachable engine's probe lasts its whole timeout); the
        engine is held only once it answered, and only if no operation took it by then."""
        adm = self.admission
        with adm.lock:
            todo = {e: op for e, op in self._unsettled.items() if e not in adm.holders
                    and self.config.knows(e)}
        settled: list[str] = []

        def one(item: tuple[str, str]) -> None:
            engine, op_id = item
            if not self._answers(engine, op_id):
                return
            holder = f"reconcile:{op_id}"
            with adm.lock:
                if engine in adm.holders or self._unsettled.get(engine) != op_id:
                    return  # an operation took it meanwhile: that operation settles it
                adm.holders[engine] = holder
            try:
                if self._settle(engine, op_id):
                    settled.append(engine)
            finally:
                with adm.lock:
                    if adm.holders.get(engine) == holder:
                        del adm.holders[engine]

        if todo:
            hub.each(one, list(todo.items()), 64)
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
        cmd = p.OperationCommand(call_id=0, op_id=op_id, kind=OperationKind.ROLLBACK,
                                 engines=[engine])
        s = self.session(cmd, engine)
        try:
            status = s.client.status()
            if status.current_op:
                return False  # the agent is still finishing what it was doing
            found = status.state
            if found == CheckpointState.FAILED and self.resumes(engine, op_id):
                now = resume_uncaptured(s, op_id)
            else:
                now = settle_state(s, found, f"reconciled after operation {op_id} lost "
                                   "contact", step="reconcile")
        except CkptError as err:  # policy: not reachable (or refused) yet: next round
            log.info("%s: still unsettled (operation %s): %s", engine, op_id, err.message)
            return False
        finally:
            s.close()
        with self.admission.lock:
            if self._unsettled.get(engine) == op_id:
                del self._unsettled[engine]
        self.record("reconciled", {"found": found, "now": now}, op_id=op_id, engine=engine)
        log.warning("%s: reconciled after operation %s: found %s, now %s", engine, op_id,
                    found, now)
        return True

    def resumes(self, engine: str, op_id: str) -> bool:
        """Whether ``engine``, found FAILED after operation ``op_id``, is restored
        (``recover_uncaptured = "resume"`` and the operation never began to capture it)."""
        return self.config.recover_uncaptured == RecoverUncaptured.RESUME and not self.captured(engine, op_id)

    def captured(self, engine: str, op_id: str) -> bool:
        """Whether operation ``op_id`` may have begun capturing ``engine`` (its dump hooks may
        have run). Only a prepare or a cycle that never brought the engine to PREPARED surely
        did not: a capture runs in PREPARED, and its phase record is written at its end, so
        a controller killed in the middle of one leaves the transition and no phase."""
        known = self.journal.identity(op_id)
        if known is None or known[0] not in (OperationKind.PREPARE, OperationKind.CYCLE):
            return True
        return any((r.type == "phase" and r.data.get("name") == OperationKind.CAPTURE)
                   or (r.type == "transition"
                       and r.data.get("dest") == CheckpointState.PREPARED)
                   for r in self.journal.records(engine=engine, op_id=op_id, limit=100_000))


def resume_uncaptured(s: EngineSession, op_id: str) -> str:
    """``recover_uncaptured = "resume"``: an engine found FAILED after operation ``op_id``
    lost contact with it before any capture (e.g. its sidecar was killed in the middle of a
    prepare and came back) is restored, as ``restore`` would; returns the state now. A
    restore that fails leaves it FAILED, with its reason; one that cannot reach the agent is
    tried again next round."""
    try:
        s.open()  # subscribed: the restore's transitions are journaled; the PID for hooks
        out = s.restore(run_pre_restore=False)
    except CkptError as err:  # policy: FAILED with the restore's reason, unless unreachable
        out = StepOutcome.failed(err)
    if out.error is not None:
        log.warning("%s: restore after operation %s lost contact failed: %s", s.engine.name,
                    op_id, out.error.message)
        now = s.refresh_state()
        if now is None:
            raise out.error
        return now
    return s.refresh_state() or s.outcome.state or CheckpointState.FAILED


def settle_state(s: EngineSession, found: str, reason: str, step: str) -> str:
    """Bring an engine an operation left behind to a settled state; returns the state now.
    PREPARED (or PREPARING between two steps) is rolled back; RESTORING between re-wake and
    resume (re-woken and verified) is resumed; RUNNING and FAILED stay. Either way the engine
    would serve again: the session's ``before_resume`` (``Controller.guard``: an engine a
    migration brought here that etcd no longer names this node's) may refuse it, and then
    it is as the table's (post-restore, TAKING_OVER) row says: FAILED, with the reason."""
    if found in (CheckpointState.PREPARED, CheckpointState.PREPARING,
                 CheckpointState.RESTORING) and (refused := s.taken_over()) is not None:
        if refused.error is not None:  # why, in the outcome (and the recovery's log line)
            s.outcome.error = error_info(refused.error)
        return s.refresh_state() or CheckpointState.FAILED  # not to serve here
    if found in (CheckpointState.PREPARED, CheckpointState.PREPARING):
        s.rollback(reason, step=step)
    elif found == CheckpointState.RESTORING:
        s.client.restore(op_id=f"{s.op_id}/{s.engine.name}/{step}", step=RestoreStep.RESUME)
    return s.refresh_state() or found
