"""The journal's writer: queued rows are committed to SQLite in batches (group commit), so
writers on many threads share one transaction, and barriers arriving together share one
fsync; one round at a time, made by the writer's thread or by a caller waiting for it.

``submit`` queues a statement and returns at once with its place in the stream (and, for a
numbered row, its number: the journal's ``seq``). A round takes everything queued, runs it in
one transaction in the order it was queued, and commits. A caller waiting for a barrier or a
read (``wait``, ``wait_written``) makes the round itself when none is under way (the leader of
what is queued), else waits for the one under way and then leads the next; plain rows alone
are written by the thread ``WRITE_AFTER_S`` after the oldest (or at ``WRITE_BATCH`` rows), so
rows arriving close together cost one commit and one wake-up of the thread, not one each
(waking a thread costs tens of microseconds of CPU on a VM; a process killed within that time
loses those rows, whole, and nothing after them). A plain commit is not fsynced
(``synchronous=NORMAL``): in WAL mode a committed transaction is in the WAL file, so
a process killed right after keeps it, and SQLite's checksummed WAL frames keep what a power
cut leaves a prefix of the commits. A batch holding a barrier (``submit(..., barrier=True)``,
then ``wait``) commits with ``synchronous=FULL``: the WAL is fsynced, which makes every
commit before it durable too. Without a barrier, what was committed is fsynced at most
``SYNC_AFTER_S`` later all the same.

Failures: a row that breaks a constraint fails alone, and the rest of its batch commits. Any
other error (disk full, I/O error) rolls the whole batch back. A barrier's own row that failed
is raised by its ``wait``. A plain row that failed is logged and raised (as the same sqlite3
error class, saying how many rows and which numbers) by the next barrier that takes failures
(``Entry.takes_failures``), once; one that ``refuses_after_failure`` raises it at ``submit``
instead, writing nothing.

Neighbours: ``journal`` is its only user and owns the connection; this module knows no table.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time

log = logging.getLogger("ckpt_controller.journal")

#: rows queued and not yet taken by the writer at most; ``submit`` waits for room beyond
#: it (the writer takes everything queued at each round, so the wait is one round)
MAX_QUEUED = 50_000
#: a row queued is written at most this long after (sooner for a barrier, a read, or a full
#: batch): rows arriving within it share one commit, and the writer wakes once for them
WRITE_AFTER_S = 0.005
#: rows queued that are written at once, without waiting for ``WRITE_AFTER_S``
WRITE_BATCH = 1000
#: a commit made without an fsync is fsynced at most this long after it (with no barrier)
SYNC_AFTER_S = 0.2


class Entry:
    """One queued statement (``sql`` None: a barrier that writes no row of its own)."""

    __slots__ = ("sql", "args", "pos", "number", "barrier", "takes_failures", "error", "done")

    def __init__(self, sql: str | None, args: tuple, barrier: bool, takes_failures: bool) -> None:
        self.sql, self.args = sql, args
        self.pos = self.number = 0
        self.barrier, self.takes_failures = barrier, takes_failures
        self.error: BaseException | None = None
        self.done = False


class GroupWriter:
    """Owns ``db`` (an autocommit connection, ``isolation_level=None``) from now on: only the
    round under way uses it (the thread's, or a waiting caller's). ``mark_sql`` writes a row of no meaning with one argument (the wall
    time): a barrier after commits not yet fsynced writes it, so that its commit surely has a
    page to fsync. ``first_number`` is the number the first numbered row gets."""

    def __init__(self, db: sqlite3.Connection, *, first_number: int, mark_sql: str) -> None:
        self._db, self._mark_sql = db, mark_sql
        self._db.execute("PRAGMA synchronous=NORMAL")
        #: the connection's ``synchronous`` is FULL now (set for a barrier's round, and left
        #: so until a round without one: rounds of barriers in a row set it once)
        self._full = False
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)      # the writer waits here
        self._progress = threading.Condition(self._lock)  # barriers and reads
        self._room = threading.Condition(self._lock)      # a submit waiting on a full queue
        self._queue: list[Entry] = []
        self._pos = 0            # place of the last entry queued
        self._written = 0        # place of the last entry whose batch ended
        self._synced = 0         # place up to which every commit is fsynced
        self._unsynced_since = 0.0
        self._queued_since = 0.0  # when the oldest entry queued was
        self._next_number = first_number
        self._failure: tuple[BaseException, list[int]] | None = None  # rows lost, unreported
        self._closing = False
        self._idle = False       # the writer waits for work (a submit must wake it)
        self._busy = False       # a round is being made (by the thread or a leading caller)
        self._dead: BaseException | None = None
        self._stats = {"rows": 0, "commits": 0, "syncs": 0, "failed_rows": 0}
        self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- callers

    def submit(self, sql: str | None, args: tuple = (), *, numbered: bool = False,
               barrier: bool = False, takes_failures: bool = True,
               refuses_after_failure: bool = False) -> Entry:
        """Queue ``sql``; with ``numbered`` its row takes the next number, passed as the
        first argument. Waits only while ``MAX_QUEUED`` entries are queued. A barrier is
        written once ``wait`` is called for it (its caller makes the round, or the one under
        way does), so call ``wait`` right away."""
        entry = Entry(sql, args, barrier, takes_failures)
        self._enqueue([entry], numbered, refuses_after_failure)
        return entry

    def submit_rows(self, sql: str, rows: list[tuple]) -> int:
        """Queue ``sql`` once per row, in order, each a numbered row (as ``submit(sql, row,
        numbered=True)`` each, under one lock): returns the first row's number, the others
        following it one by one."""
        entries = [Entry(sql, row, False, True) for row in rows]
        return self._enqueue(entries, numbered=True)

    def _enqueue(self, entries: list[Entry], numbered: bool,
                 refuses_after_failure: bool = False) -> int:
        """Queue ``entries`` in order under one lock, placed (and numbered) one after the
        other; the number the first took (or would have). Wakes the idle writer for the
        first plain row queued and for a full batch; a plain row after the first waits
        ``WRITE_AFTER_S``, and a barrier is written by whoever waits for it."""
        with self._lock:
            while len(self._queue) >= MAX_QUEUED and self._usable():
                self._room.wait()
            self._check_usable()
            if refuses_after_failure and self._failure is not None:
                raise self._take_failure()
            first = self._next_number
            for entry in entries:
                self._pos += 1
                entry.pos = self._pos
                if numbered:
                    entry.number = self._next_number
                    entry.args = (self._next_number, *entry.args)
                    self._next_number += 1
            was = len(self._queue)
            if was == 0:
                self._queued_since = time.monotonic()
            self._queue.extend(entries)
            plain = not entries[-1].barrier
            if self._idle and plain and (was == 0 or was < WRITE_BATCH <= len(self._queue)):
                self._work.notify()
        return first

    def wait(self, entry: Entry) -> None:
        """Until ``entry``'s batch is committed (and, for a barrier, fsynced); raises its own
        failure, or for a barrier that takes them, a failure of rows queued before it."""
        with self._lock:
            self._await(lambda: entry.done)
        if entry.error is not None:
            raise entry.error
        if not entry.done:
            raise _stopped(self._dead)

    def wait_written(self) -> None:
        """Until everything queued before this call is committed (or failed): no fsync."""
        with self._lock:
            target = self._pos
            self._await(lambda: self._written >= target)

    def stats(self) -> dict[str, int]:
        """Rows written, commits, fsynced commits, rows that failed: counts since the start."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Write and fsync what is queued, stop the thread; raise a failure not yet reported.
        Later calls do nothing."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._work.notify()
            self._room.notify_all()
        self._thread.join()
        with self._lock:
            failure = self._take_failure() if self._failure is not None else None
        if failure is not None:
            raise failure
        if self._dead is not None:
            raise _stopped(self._dead)

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while self._busy or (left := self._due_in()) > 0:
                        self._idle = True
                        self._work.wait(None if self._busy or left == float("inf") else left)
                        self._idle = False
                    closing = self._closing
                    taken = self._take()
                self._commit(*taken)
                if closing:
                    return
        except BaseException as exc:  # policy: a writer bug fails its waiters, never hangs them
            log.exception("journal: the writer stopped")
            with self._lock:
                self._dead = self._dead or exc
                self._progress.notify_all()
                self._room.notify_all()

    def _await(self, done) -> None:
        """(Lock held.) Until ``done()``: when no round is being made, the caller makes one
        itself (the leader of what is queued), which spares two thread wake-ups; else it
        waits for the round under way to end. On closing, the thread makes the last one."""
        while not done() and self._dead is None:
            if self._busy or self._closing or not self._queue:
                self._progress.wait()
                continue
            taken = self._take()
            self._lock.release()
            try:
                self._commit(*taken)
            finally:
                self._lock.acquire()

    def _take(self) -> tuple[list[Entry], int, bool, bool]:
        """(Lock held.) Take what is queued for one round: ``(batch, last, sync, unsynced)``."""
        self._busy = True
        batch, self._queue = self._queue, []
        sync = self._closing or self._sync_due() or any(e.barrier for e in batch)
        self._room.notify_all()
        return batch, self._pos, sync, self._written > self._synced

    def _commit(self, batch: list[Entry], last: int, sync: bool, unsynced: bool) -> None:
        """Write ``batch`` in one transaction (if there is anything to write) and settle it."""
        try:
            if not any(e.sql for e in batch) and not (sync and unsynced):
                self._settle(batch, last, committed=False, synced=sync)  # nothing to write
                return
            committed = self._write(batch, sync, unsynced)
            self._settle(batch, last, committed=committed, synced=sync and committed)
        except BaseException as exc:  # policy: a bug here fails every waiter, never hangs one
            with self._lock:
                self._dead, self._busy = exc, False
                self._progress.notify_all()
                self._room.notify_all()
                self._work.notify()
            raise

    def _due_in(self) -> float:
        """Seconds until the writer has a round to make (0: now; inf: only once woken)."""
        if self._closing or len(self._queue) >= WRITE_BATCH:
            return 0.0
        now, due = time.monotonic(), float("inf")
        if self._queue:
            due = self._queued_since + WRITE_AFTER_S - now
        if self._written > self._synced:
            due = min(due, self._unsynced_since + SYNC_AFTER_S - now)
        return max(due, 0.0)

    def _sync_due(self) -> bool:
        return (self._written > self._synced
                and time.monotonic() >= self._unsynced_since + SYNC_AFTER_S)

    def _write(self, batch: list[Entry], sync: bool, unsynced: bool) -> bool:
        """Run ``batch`` in one transaction, setting each failed entry's ``error``; True when
        the transaction committed (the rows that did not fail are in it)."""
        db = self._db
        if sync != self._full:
            db.execute("PRAGMA synchronous=FULL" if sync else "PRAGMA synchronous=NORMAL")
            self._full = sync
        try:
            db.execute("BEGIN IMMEDIATE")
            for run in _runs(batch):
                if len(run) == 1:
                    _execute(db, run[0])
                else:
                    _execute_many(db, run)
            if sync and unsynced:  # this batch's rows may add no page (an UPDATE to the same)
                db.execute(self._mark_sql, (time.time(),))
            db.execute("COMMIT")
            return True
        except sqlite3.Error as exc:  # policy: anything else loses the batch, reported below
            if db.in_transaction:
                _rollback(db)
            for entry in batch:
                if entry.error is None and entry.sql is not None:
                    entry.error = exc
            if not any(e.sql for e in batch):
                log.error("journal: a commit to fsync what came before failed: %s", exc)
            return False

    def _settle(self, batch: list[Entry], last: int, *, committed: bool, synced: bool) -> None:
        """Count the batch, keep its lost plain rows for the next barrier, wake its waiters."""
        lost = [e for e in batch if e.error is not None and not e.barrier]
        failed = sum(1 for e in batch if e.error is not None)
        rows = sum(1 for e in batch if e.sql is not None) - failed
        if lost:
            log.error("journal: %d rows not written (seq %s): %s", len(lost),
                      _numbers([e.number for e in lost]), lost[0].error)
        with self._lock:
            s = self._stats
            s["rows"] += rows
            s["failed_rows"] += failed
            s["commits"] += committed
            s["syncs"] += synced and committed
            if lost:
                exc, numbers = self._failure or (lost[0].error, [])
                self._failure = (exc, numbers + [e.number for e in lost])
            if self._written == self._synced or (not synced and self._sync_due()):
                self._unsynced_since = time.monotonic()  # a failed fsync is tried again later
            self._written = last
            if synced:
                self._synced = last
            report = None
            for entry in batch:
                if entry.barrier and entry.takes_failures and entry.error is None \
                        and self._failure is not None:
                    report = report or self._failure
                    entry.error = _lost_error(*report)
                entry.done = True
            if report is not None:
                self._failure = None
            self._busy = False
            self._progress.notify_all()
            if self._idle and (self._queue or self._written > self._synced or self._closing):
                self._work.notify()  # the thread has timers to set, or the last round

    # ---------------------------------------------------------------- helpers

    def _usable(self) -> bool:
        return not self._closing and self._dead is None

    def _check_usable(self) -> None:
        if self._closing:
            raise sqlite3.ProgrammingError("the journal is closed")
        if self._dead is not None:
            raise _stopped(self._dead)

    def _take_failure(self) -> BaseException:
        assert self._failure is not None
        err, self._failure = _lost_error(*self._failure), None
        return err


def _runs(batch: list[Entry]) -> list[list[Entry]]:
    """``batch``'s rows in order, consecutive plain rows of one statement together."""
    runs: list[list[Entry]] = []
    for entry in batch:
        if entry.sql is None:
            continue
        if runs and not entry.barrier and runs[-1][-1].sql is entry.sql \
                and not runs[-1][-1].barrier:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs


def _execute(db: sqlite3.Connection, entry: Entry) -> None:
    try:
        db.execute(entry.sql, entry.args)
    except sqlite3.IntegrityError as exc:  # policy: a constraint fails its row alone
        if not db.in_transaction:  # a trigger's RAISE(ROLLBACK): the whole batch is lost
            raise
        entry.error = exc


def _execute_many(db: sqlite3.Connection, run: list[Entry]) -> None:
    """One ``executemany`` for the run; should a row of it fail, the run again row by row,
    so that only that row fails."""
    db.execute("SAVEPOINT run")
    try:
        db.executemany(run[0].sql, [e.args for e in run])
    except sqlite3.IntegrityError:  # policy: find the row that failed, one by one
        if not db.in_transaction:
            raise
        db.execute("ROLLBACK TO run")
        for entry in run:
            _execute(db, entry)
    db.execute("RELEASE run")


def _lost_error(exc: BaseException, numbers: list[int]) -> BaseException:
    """A new error of ``exc``'s class saying which rows were lost, caused by ``exc``."""
    text = f"the journal did not write {len(numbers)} rows (seq {_numbers(numbers)}): {exc}"
    try:
        err = type(exc)(text)
    except Exception:  # policy: a class that takes other arguments still reports, as sqlite3's
        err = sqlite3.DatabaseError(text)
    err.__cause__ = exc
    return err


def _numbers(numbers: list[int]) -> str:
    numbers = [n for n in numbers if n]
    if not numbers:
        return "(none numbered)"
    return str(numbers[0]) if len(numbers) == 1 else f"{min(numbers)}..{max(numbers)}"


def _stopped(exc: BaseException | None) -> sqlite3.OperationalError:
    return sqlite3.OperationalError(f"the journal's writer stopped: {type(exc).__name__}: {exc}")


def _rollback(db: sqlite3.Connection) -> None:
    try:
        db.execute("ROLLBACK")
    except sqlite3.Error as exc:  # policy: SQLite may have rolled back already; nothing to undo
        log.debug("journal: rollback: %s", exc)

