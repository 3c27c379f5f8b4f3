"""Following a fleet operation from ``ckptctl``: its parts or its migration steps as they
change, until it ends; reads that etcd leaves unanswered are tried again for a while.

``follow`` waits for a per-engine operation (``Drive.PARTS``), ``follow_migration`` for a
migration (``Drive.STEPS``); both print progress on stderr on a terminal, or JSON lines with
``lines``. ``Patient`` is their read: etcd silent for up to ``FOLLOW_PATIENCE_S`` costs a
pause, not the command. ``exit_code`` is what an ended operation means for the exit status.
Neighbours: ``cli.fleet_cmd`` (the commands), ``fleet.ops`` and ``fleet.migration.record``
(the reads), ``cli.output`` (JSON lines).
"""

from __future__ import annotations

import sys
import threading
import time

from ckpt_controller.cli.output import emit
from ckpt_controller.errors import (DamagedRecordError, DeadlineError, UnreachableError,
                                    UsageError)
from ckpt_controller.vocab import MigrationOutcome, OperationStatus, PartStatus

#: while following an operation that goes on without the command, how long etcd may leave
#: every read unanswered before the command gives up (a busy member can miss the command's
#: request timeout now and then; a first read, before anything is submitted, still fails fast)
FOLLOW_PATIENCE_S = 10.0
#: the pause between two tries of a read etcd did not answer
FOLLOW_RETRY_S = 0.5
#: with no part changed for this long, a followed operation says what it waits on (which
#: parts, on which nodes, whether those are up, whether any node coordinates), and again
#: every ``WAIT_SAY_AGAIN_S`` while nothing changes
WAIT_SAY_S = 5.0
WAIT_SAY_AGAIN_S = 30.0


class Patient:
    """Reads of an operation being followed: one that etcd leaves unanswered is tried again,
    for up to ``FOLLOW_PATIENCE_S`` of silence, said once on stderr (and that etcd answers
    again); past that the last ``UnreachableError`` goes to the caller (exit 4: the operation
    goes on, ``fleet watch`` follows it again)."""

    def __init__(self, op_id: str, patience_s: float | None = None) -> None:
        self.op_id = op_id
        self.patience_s = FOLLOW_PATIENCE_S if patience_s is None else patience_s
        self._silent_since: float | None = None

    def read(self, fn):
        while True:
            try:
                value = fn()
            except UnreachableError as err:  # policy: wait for etcd, then give up typed
                now = time.monotonic()
                if self._silent_since is None:
                    self._silent_since = now
                    print(f"etcd did not answer ({err.message}); still following {self.op_id}, "
                          f"for up to {self.patience_s:.0f}s", file=sys.stderr, flush=True)
                elif now - self._silent_since >= self.patience_s:
                    raise
                time.sleep(FOLLOW_RETRY_S)
                continue
            if self._silent_since is not None:
                print(f"etcd answers again after {time.monotonic() - self._silent_since:.1f}s",
                      file=sys.stderr, flush=True)
                self._silent_since = None
            return value


def gave_up(op_id: str, timeout_s: float, waits: str) -> DeadlineError:
    """``--timeout`` passed: the command stops following, the operation goes on."""
    return DeadlineError(f"fleet operation {op_id} did not end within --timeout {timeout_s:g}s; "
                         f"it goes on (ckptctl fleet watch {op_id}): {waits}",
                         op_id=op_id, timeout_s=timeout_s)


def follow(c, keys, op_id: str, progress: bool, every_s: float = 0.2, lines: bool = False,
           timeout_s: float | None = None):
    """Wait for the fleet operation ``op_id`` to end: (its record, its parts); prints each
    part's changes on stderr with ``progress``, or as JSON lines on stdout with ``lines``.
    ``timeout_s``: give up following after that long (``DeadlineError``, exit 3)."""
    from ckpt_controller.fleet import ops

    seen: dict[str, str] = {}
    start = time.monotonic()
    say_at = start + WAIT_SAY_S  # when to say what it waits on, unless a part changes first
    patient = Patient(op_id)
    while True:
        op = patient.read(lambda: ops.read_op(c, keys, op_id))
        if op is None:
            raise UsageError(f"no fleet operation {op_id}", op_id=op_id)
        if timeout_s is not None and time.monotonic() - start > timeout_s \
                and op.status is OperationStatus.RUNNING:
            parts = patient.read(lambda: ops.read_parts(c, keys, op_id))
            raise gave_up(op_id, timeout_s, patient.read(lambda: waiting_on(c, keys, op, parts)))
        if not (lines or progress) and op.status is OperationStatus.RUNNING:
            time.sleep(every_s)  # nothing to print: the parts are read once, at the end
            continue
        parts = patient.read(lambda: ops.read_parts(c, keys, op_id))
        for name in op.engines:
            if name not in parts:  # deleted under a running operation: said, then followed on
                if seen.get(name) != "missing" and progress:
                    print(f"[{time.monotonic() - start:6.1f}s] {name}: its part record "
                          f"{keys.part(op_id, name)} is missing", file=sys.stderr, flush=True)
                seen[name] = "missing"
                continue
            part = parts[name][0]
            if seen.get(name) == part.status:
                continue
            seen[name] = part.status
            say_at = time.monotonic() + WAIT_SAY_S
            if lines:
                emit("fleet-part", op_id=op_id, elapsed_s=round(time.monotonic() - start, 3),
                     part=part, stream=True)
            if progress:
                more = f" ({part.state})" if part.state else ""
                why = (f": {part.error}" if part.error and part.status is not PartStatus.SUCCEEDED
                       else "")
                print(f"[{time.monotonic() - start:6.1f}s] {name} on {part.node}: "
                      f"{part.status}{more}{why}", file=sys.stderr, flush=True)
        if op.status is not OperationStatus.RUNNING:
            missing = [keys.part(op_id, n) for n in op.engines if n not in parts]
            if missing:
                raise DamagedRecordError(
                    f"fleet {op.kind} {op_id} ended {op.status}, but the part records "
                    f"{', '.join(missing)} are missing (deleted while it ran): what became of "
                    "their engines is in their nodes' journals (ckptctl history)",
                    key=missing[0], op_id=op_id, status=op.status, missing=missing)
            return op, [parts[n][0] for n in op.engines]
        if progress and time.monotonic() >= say_at:
            said = patient.read(lambda: waiting_on(c, keys, op, parts))
            print(f"[{time.monotonic() - start:6.1f}s] {said}", file=sys.stderr, flush=True)
            say_at = time.monotonic() + WAIT_SAY_AGAIN_S
        time.sleep(every_s)


def waiting_on(c, keys, op, parts) -> str:
    """What a running fleet operation waits on, in words: its parts not ended, each on its
    node (``node down`` when the node is not registered), and ``no node coordinates`` when
    none holds the coordinator key (none may, or none is up: nothing moves then)."""
    from ckpt_controller.fleet import registry

    up = {n.node for n in registry.read(c, keys).nodes}
    waits = []
    for name in op.engines:
        if name not in parts or parts[name][0].status.ended:
            continue
        part = parts[name][0]
        waits.append(f"{name} {part.status} on {part.node}"
                     + ("" if part.node in up else " (node down)"))
    said = f"fleet {op.kind} {op.op_id} waits on " + (", ".join(waits) or "its end")
    if c.get(keys.coordinator) is None:
        said += "; no node coordinates (none may, or none is up): nothing moves until one does"
    return said


def follow_migration(c, keys, op_id: str, progress: bool, every_s: float = 0.2,
                     lines: bool = False, timeout_s: float | None = None):
    """Wait for migration ``op_id`` to end: (its operation, its record); prints each step's
    start and end on stderr with ``progress``, or each ended step as a JSON line on stdout
    with ``lines``. ``timeout_s``: as ``follow``'s. Woken by a watch of the two keys as
    soon as either changes (read again every ``every_s`` as well: a watch may be lost)."""
    stop = threading.Event()
    try:
        return _follow_migration(c, keys, op_id, progress, every_s, lines, timeout_s, stop)
    finally:
        stop.set()


def _follow_migration(c, keys, op_id, progress, every_s, lines, timeout_s, stop):
    from ckpt_controller.fleet import ops
    from ckpt_controller.fleet.migration import record

    start = time.monotonic()
    said: set[tuple] = set()
    patient = Patient(op_id)
    changed = threading.Event()
    for key in (keys.op(op_id), keys.migration(op_id)):
        threading.Thread(target=c.watch, args=(key, key + "\x00", changed.set, stop),
                         name="follow-watch", daemon=True).start()
    while True:
        changed.clear()
        op = patient.read(lambda: ops.read_op(c, keys, op_id))
        mig, _ = patient.read(lambda: record.read(c, keys, op_id))
        if op is None or mig is None:
            raise UsageError(f"no migration {op_id}", op_id=op_id)
        for end in mig.done:
            if ("end", end.step, end.ended) in said:
                continue
            said.add(("end", end.step, end.ended))
            if lines:
                emit("fleet-step", op_id=op_id, elapsed_s=round(time.monotonic() - start, 3),
                     step=end, stream=True)
            if progress:
                took = f" in {end.ended - end.started:.2f}s" if end.started else ""
                why = f": {end.error}" if end.error else ""
                print(f"[{time.monotonic() - start:6.1f}s] {end.step} on {end.node}: "
                      f"{end.status}{took}{why}", file=sys.stderr, flush=True)
        if progress and mig.started and ("start", mig.step, mig.step_started) not in said:
            said.add(("start", mig.step, mig.step_started))
            print(f"[{time.monotonic() - start:6.1f}s] {mig.step} on {mig.node_of(mig.step)} ...",
                  file=sys.stderr, flush=True)
        if op.status is not OperationStatus.RUNNING:
            return op, mig
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            step = (f"{mig.step} on {mig.node_of(mig.step)}" if mig.started
                    else f"its {mig.step or 'first'} step to start")
            raise gave_up(op_id, timeout_s, f"the migration waits on {step}")
        changed.wait(every_s)


def parts_exit_code(op, parts) -> int:
    """0 when every part succeeded; 4 when one was lost with its node; else 1."""
    if op.status is OperationStatus.SUCCEEDED:
        return 0
    return 4 if any(p.status is PartStatus.LOST for p in parts) else 1


def migration_exit_code(mig) -> int:
    """0 when the engine moved; 4 when it was lost; else 1 (it stayed, or failed)."""
    if mig.outcome is MigrationOutcome.MOVED:
        return 0
    return 4 if mig.outcome is MigrationOutcome.LOST else 1


#: where the engine is after each outcome of a migration, for the human summary
WHERE = {MigrationOutcome.MOVED: "RUNNING on {mig.target}",
         MigrationOutcome.STAYED: "RUNNING on {mig.source}",
         MigrationOutcome.LOST: "lost (the engine died)",
         MigrationOutcome.FAILED: "not RUNNING when it ended"}


def migration_summary(op, mig, now=None) -> str:
    """The human line of a migration's end; ``now``: the engine's record in the registry,
    read after it ended. A ``failed`` migration says where the engine was when it ended
    ("not RUNNING"), and then what the registry says now: a node back from a restart may
    have resumed it since (it once read "not RUNNING" while the engine served again)."""
    where = WHERE.get(mig.outcome, "").format(mig=mig)
    line = (f"fleet migrate {op.op_id}: {op.status}: {mig.engine} {mig.outcome}"
            + (f", {where}" if where else "") + (f" ({mig.error})" if mig.error else ""))
    if mig.outcome == MigrationOutcome.FAILED and now is not None:
        line += (f"; now {now.state or 'unreachable'} on {now.node} (its node's record"
                 + ("" if now.reachable else ", the agent not answering") + ")")
    return line


def engine_now(c, keys, engine: str):
    """The engine's record in the registry now, or None (not there, unreadable)."""
    from ckpt_controller.fleet import records as r

    try:
        return r.read(c, keys.engine(engine), r.EngineRecord)
    except (DamagedRecordError, UnreachableError):  # policy: the summary goes without it
        return None
