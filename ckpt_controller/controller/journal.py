"""The controller's journal: every operation and everything that happened during it, in
SQLite (WAL) under the state directory.

Tables: ``operations`` (one row per operation id: kind, engines, parameters, status, result),
``records`` (an append-only sequence: transitions, phases, drain and memory reports, hook
runs, notes; each with wall and monotonic time) and ``roster`` (append-only: each engine the
controller adopted or gave away, by which operation, from or to which node, and an adopted
engine's whole configuration; an engine's newest row says where it is, ``controller.roster``
reads them). ``engine_operations`` (an operation's engines, a row each, filled by a trigger
with the operation's row, in the order operations began: the wall clock never orders them,
it can step back) and partial indexes on ``records`` (captures, the images among
them, lost contact) let every read the controller makes of one engine (``status``'s LAST-OP,
``history``, a restore's image, a start's carried-over metrics) go by index: as fast in a
journal of years as in a new one. A journal written before them is brought up to
``SCHEMA_VERSION`` when opened, once. Writes go through one writer thread that
commits whatever has queued in one transaction (group commit, ``journal_writer``), in the
order they were made, so the file is always a prefix of what was journaled and a controller
killed at any instant leaves a journal that opens clean: an operation whose row still says
``running`` is what restart reconciles.

When things are durable: ``record`` returns at once with the record's ``seq`` (numbered here,
from the table's largest at open); it is committed a moment later, without an fsync of its
own. ``begin`` (before any engine is touched) and ``finish`` (before any caller is answered)
return once their row and every record journaled before it are committed and fsynced, and so
does ``sync``; callers arriving together share one fsync. Reads of records (``records``,
``captures``, ``unsettled``, ``check``) see every record whose ``record`` returned before the
read began; reads of operations need no wait (only ``begin`` and ``finish`` write them).

A write that fails: a duplicate ``begin`` raises ``sqlite3.IntegrityError`` and journals
nothing. A record lost to a failed commit (disk full, I/O error) is logged at once and raised,
as the same ``sqlite3`` error class naming the lost ``seq`` numbers, by the next ``finish``,
``sync`` or ``close``, once; a ``begin`` while such a failure is unreported raises it instead
and journals nothing (the operation is refused before it exists).

Reads go through connections of their own (WAL lets them run beside the writer and each
other), so a long read (a ``history`` of thousands of operations) never holds up a short one
(the lookups the controller's control thread makes for every operation request) or a write.
``records`` can stop at a byte budget, newest records first, so an answer fits in one message.
Neighbours: ``service`` writes it, ``server`` serves ``history`` from it, ``journal_writer``
commits for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from ckpt_controller.controller.journal_writer import GroupWriter
from ckpt_controller.errors import ConfigError
from ckpt_controller.protocol import (
    JournalRecord,
    LastOperation,
    OperationResult,
    OperationSummary,
)
from ckpt_controller.vocab import OperationStatus

log = logging.getLogger("ckpt_controller.journal")

SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
    op_id      TEXT PRIMARY KEY,
    kind       TEXT NOT NULL,
    engines    TEXT NOT NULL,           -- JSON list
    params     TEXT NOT NULL,           -- JSON object
    status     TEXT NOT NULL,           -- vocab.OperationStatus
    wall       REAL NOT NULL,
    monotonic  REAL NOT NULL,
    ended_wall REAL,
    result     BLOB                     -- msgpack OperationResult once ended
);
CREATE INDEX IF NOT EXISTS operations_wall ON operations(wall);
CREATE TABLE IF NOT EXISTS records (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    op_id      TEXT,
    engine     TEXT,
    type       TEXT NOT NULL,
    wall       REAL NOT NULL,
    monotonic  REAL NOT NULL,
    data       TEXT NOT NULL            -- JSON object
);
CREATE INDEX IF NOT EXISTS records_engine ON records(engine, seq);
CREATE INDEX IF NOT EXISTS records_op ON records(op_id, seq);
CREATE TABLE IF NOT EXISTS roster (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    engine     TEXT NOT NULL,
    change     TEXT NOT NULL,           -- vocab.RosterChange
    op_id      TEXT NOT NULL,           -- the operation (a migration's) that made the change
    peer       TEXT NOT NULL,           -- the node it came from (adopted) or went to
    wall       REAL NOT NULL,
    config     BLOB                     -- msgpack roster.AdoptedEngine (adopted only)
);
CREATE TABLE IF NOT EXISTS sync_mark (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    wall       REAL NOT NULL            -- rewritten by a barrier so its commit has a page to fsync
);
-- each operation's engines, a row each, filled by the trigger with the operation's row (in
-- its statement): an engine's operations, newest first, by index however long the journal,
-- in the order they began (the operation's rowid), whatever the wall clock did meanwhile
CREATE TABLE IF NOT EXISTS engine_operations (
    engine     TEXT NOT NULL,
    op_seq     INTEGER NOT NULL,        -- the operation's rowid: the order operations began in
    op_id      TEXT NOT NULL,
    PRIMARY KEY (engine, op_seq)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS engine_operations_fill AFTER INSERT ON operations BEGIN
    INSERT OR IGNORE INTO engine_operations (engine, op_seq, op_id)
    SELECT value, NEW.rowid, NEW.op_id FROM json_each(NEW.engines);
END;
-- the records a restore chooses its image by, and those that leave an engine unsettled
CREATE INDEX IF NOT EXISTS records_captures ON records(engine, seq) WHERE type = 'capture';
CREATE INDEX IF NOT EXISTS records_images ON records(engine, seq)
    WHERE type = 'capture' AND json_extract(data, '$.dumped') = 1;
CREATE INDEX IF NOT EXISTS records_contact ON records(engine, seq)
    WHERE type IN ('contact_lost', 'reconciled');
"""
#: ``PRAGMA user_version`` of a journal with the tables above filled (0: written before an
#: engine's operations had a table; 1: with ``operation_engines``, ordered by wall time, which
#: a clock stepped back turned around; opening fills ``engine_operations`` once)
SCHEMA_VERSION = 2
BACKFILL_ENGINES = ("INSERT OR IGNORE INTO engine_operations (engine, op_seq, op_id) "
                    "SELECT j.value, o.rowid, o.op_id "
                    "FROM operations AS o, json_each(o.engines) AS j")

INSERT_RECORD = ("INSERT INTO records (seq, op_id, engine, type, wall, monotonic, data) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?)")
MARK_SYNC = "INSERT OR REPLACE INTO sync_mark (id, wall) VALUES (1, ?)"

#: read connections kept open for the next read; more readers at once open more
MAX_IDLE_READERS = 8
#: what a record costs in an answer besides its text (seq, times, field names)
RECORD_OVERHEAD_BYTES = 96

_result_dec = msgspec.msgpack.Decoder(OperationResult)
_enc = msgspec.msgpack.Encoder()


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        db = None
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                 timeout=30)
            db.execute("PRAGMA journal_mode=WAL")
            found = db.execute("PRAGMA quick_check").fetchall()
            if [r[0] for r in found] != ["ok"]:  # a damaged page: refused before any use
                db.close()
                raise damaged(self.path, "; ".join(str(r[0]) for r in found[:3]))
            _open_schema(db, self.path)
            # AUTOINCREMENT's own counter too: a seq is never reused, even one deleted
            first = 1 + max(n or 0 for (n,) in db.execute(
                "SELECT MAX(seq) FROM records UNION ALL "
                "SELECT seq FROM sqlite_sequence WHERE name = 'records'"))
        except sqlite3.DatabaseError as exc:  # policy: an unusable journal stops the controller
            if db is not None:
                db.close()
            if type(exc) is sqlite3.DatabaseError:  # not a database, malformed: damage
                raise damaged(self.path, str(exc)) from None
            raise ConfigError(f"cannot open the journal: {exc}", file=str(self.path),
                              key="controller.state_dir", problem=str(exc)) from None
        #: from here on only the writer's thread uses ``db``
        self._writer = GroupWriter(db, first_number=first, mark_sql=MARK_SYNC)
        self._db = db

        #: idle read connections (at most ``MAX_IDLE_READERS`` kept); guarded by
        #: ``_pool_lock``: a read never waits for a write's fsync
        self._pool_lock = threading.Lock()
        self._readers: list[sqlite3.Connection] = []
        self._closed = False

    def close(self) -> None:
        """Write and fsync what is queued, stop the writer, close the connections. Raises a
        write failure no barrier has reported yet (after closing all the same)."""
        try:
            self._writer.close()
        finally:
            with self._pool_lock:
                self._closed = True
                for conn in self._readers:
                    conn.close()
                self._readers.clear()
            self._db.close()

    def sync(self) -> None:
        """Return once every record journaled before this call is committed and fsynced;
        raises a write failure not yet reported (see the module's docstring)."""
        self._writer.wait(self._writer.submit(None, barrier=True))

    def stats(self) -> dict[str, int]:
        """The writer's counts since open: ``rows``, ``commits``, ``syncs`` (fsynced commits),
        ``failed_rows``."""
        return self._writer.stats()

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            with self._reader() as conn:
                return conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            if type(exc) is sqlite3.DatabaseError:  # a page spoiled while serving: said so
                raise damaged(self.path, str(exc)) from None
            raise

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        """A read-only connection of this caller's own for the time of one read."""
        with self._pool_lock:
            if self._closed:
                raise sqlite3.ProgrammingError("the journal is closed")
            conn = self._readers.pop() if self._readers else None
        if conn is None:
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                   timeout=30)
            conn.execute("PRAGMA query_only = ON")
        try:
            yield conn
        finally:
            with self._pool_lock:
                keep = not self._closed and len(self._readers) < MAX_IDLE_READERS
                if keep:
                    self._readers.append(conn)
            if not keep:
                conn.close()

    # ---------------------------------------------------------------- operations

    def begin(self, op_id: str, kind: str, engines: list[str], params: dict[str, Any]) -> None:
        """Journal a new operation as running; returns once it (and every record before it)
        is durable. Raises, journaling nothing, for an id that exists or a failed write."""
        self._writer.wait(self._writer.submit(
            "INSERT INTO operations (op_id, kind, engines, params, status, wall, monotonic) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (op_id, kind, json.dumps(engines), json.dumps(params), OperationStatus.RUNNING,
             time.time(), time.monotonic()),
            barrier=True, takes_failures=False, refuses_after_failure=True))

    def finish(self, result: OperationResult) -> None:
        """Journal an operation's result; returns once it (and every record before it) is
        durable. Raises its own failed write, or one of records journaled before it."""
        self._writer.wait(self._writer.submit(
            "UPDATE operations SET status = ?, ended_wall = ?, result = ? WHERE op_id = ?",
            (result.status, time.time(), _enc.encode(result), result.op_id), barrier=True))

    def result(self, op_id: str) -> OperationResult | None:
        rows = self._read("SELECT result FROM operations WHERE op_id = ?", (op_id,))
        if not rows or rows[0][0] is None:
            return None
        return _result_dec.decode(rows[0][0])

    def identity(self, op_id: str) -> tuple[str, list[str]] | None:
        """``(kind, engines)`` of the operation with this id, or ``None`` if there is none."""
        rows = self._read("SELECT kind, engines FROM operations WHERE op_id = ?", (op_id,))
        return (rows[0][0], json.loads(rows[0][1])) if rows else None

    def lookup(self, op_id: str) -> tuple[str, list[str], OperationResult | None] | None:
        """``(kind, engines, result)`` of the operation with this id (``result`` None while
        it has none), or ``None`` if there is none: what admitting a request needs, in one
        read."""
        rows = self._read("SELECT kind, engines, result FROM operations WHERE op_id = ?",
                          (op_id,))
        if not rows:
            return None
        kind, engines, result = rows[0]
        return kind, json.loads(engines), None if result is None else _result_dec.decode(result)

    def exists(self, op_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM operations WHERE op_id = ?", (op_id,)))

    def unfinished(self) -> list[tuple[str, str, list[str], dict[str, Any]]]:
        """``(op_id, kind, engines, params)`` of every operation still marked running."""
        rows = self._read("SELECT op_id, kind, engines, params FROM operations "
                          "WHERE status = ? ORDER BY rowid", (OperationStatus.RUNNING,))
        return [(r[0], r[1], json.loads(r[2]), json.loads(r[3])) for r in rows]

    def operations(self, engine: str | None = None, op_id: str | None = None,
                   limit: int = 50) -> list[OperationSummary]:
        """The newest ``limit`` operations, newest first; only those on ``engine`` and/or with
        ``op_id`` when given (filtered before the limit, however old the match). An engine's
        are read through ``engine_operations``: as fast in a journal of a million operations
        as in a new one."""
        if engine:
            source, order, where, args = (_ENGINE_OPERATIONS, "e.op_seq", ["e.engine = ?"],
                                          [engine])
        else:
            source, order, where, args = "operations AS o", "o.rowid", [], []
        if op_id:
            where.append("o.op_id = ?")
            args.append(op_id)
        rows = self._read(
            f"SELECT o.op_id, o.kind, o.engines, o.status, o.wall, o.ended_wall FROM {source} "
            + (f"WHERE {' AND '.join(where)} " if where else "")
            + f"ORDER BY {order} DESC LIMIT ?", (*args, max(limit, 1)))
        return [OperationSummary(op_id=op, kind=kind, engines=json.loads(engines), status=status,
                                 wall=wall, duration_s=None if ended is None else ended - wall)
                for op, kind, engines, status, wall, ended in rows]

    def last_operations(self, engines: list[str]) -> dict[str, LastOperation]:
        """The newest operation on each of ``engines`` (one without any is left out), in one
        query: one look into ``engine_operations``'s index per engine, however long the
        journal and whether or not an engine ever had one."""
        found: dict[str, LastOperation] = {}
        if not engines:
            return found
        rows = self._read(
            "SELECT n.value, o.op_id, o.kind, o.status, o.wall, o.ended_wall "
            "FROM json_each(?) AS n JOIN engine_operations AS e ON e.engine = n.value "
            "AND e.op_seq = (SELECT MAX(op_seq) FROM engine_operations WHERE engine = n.value) "
            "JOIN operations AS o ON o.op_id = e.op_id",
            (json.dumps(list(dict.fromkeys(engines))),))
        for name, op, kind, status, wall, ended in rows:
            found[name] = LastOperation(op_id=op, kind=kind, status=status, wall=wall,
                                        duration_s=None if ended is None else ended - wall)
        return found

    # ---------------------------------------------------------------- records

    def record(self, type_: str, data: dict[str, Any], *, op_id: str | None = None,
               engine: str | None = None, wall: float | None = None,
               monotonic: float | None = None) -> JournalRecord:
        rec = JournalRecord(seq=0, op_id=op_id, engine=engine, type=type_,
                            wall=time.time() if wall is None else wall,
                            monotonic=time.monotonic() if monotonic is None else monotonic,
                            data=data)
        rec.seq = self._writer.submit(
            INSERT_RECORD, (op_id, engine, type_, rec.wall, rec.monotonic,
                            msgspec.json.encode(data).decode()), numbered=True).number
        return rec

    def record_all(self, recs: list[JournalRecord]) -> None:
        """Journal ``recs`` in order (as ``record`` each, queued at once): their ``seq`` is
        set here."""
        enc = msgspec.json.encode
        first = self._writer.submit_rows(INSERT_RECORD, [
            (r.op_id, r.engine, r.type, r.wall, r.monotonic, enc(r.data).decode()) for r in recs])
        for i, r in enumerate(recs):
            r.seq = first + i

    def records(self, *, engine: str | None = None, op_id: str | None = None,
                since: int = 0, limit: int = 500,
                op_ids: list[str] | None = None,
                max_bytes: int | None = None) -> list[JournalRecord]:
        """The newest ``limit`` records after ``since``, oldest first; only those of ``engine``,
        of ``op_id`` and of the operations in ``op_ids`` (when given; ``[]`` matches none).
        With ``max_bytes``: only the newest of those whose text (``data`` and names) adds up
        to at most that, so the answer they make fits in one message."""
        self._writer.wait_written()
        where, args = _where(("seq > ?", since), ("engine = ?", engine), ("op_id = ?", op_id),
                             keep=("seq > ?",))
        source = "records"
        if op_ids is not None:
            # the operations' own records (by ``records_op``), not all of an engine's read
            # back until they are found: the named operations drive the join (CROSS JOIN
            # keeps SQLite from reordering it)
            source = "json_each(?) AS ids CROSS JOIN records ON records.op_id = ids.value"
            args = (json.dumps(list(dict.fromkeys(op_ids))), *args)
        sql = ("SELECT records.seq, records.op_id, records.engine, records.type, records.wall, "
               f"records.monotonic, records.data FROM {source} {where} "
               "ORDER BY records.seq DESC LIMIT ?")
        if max_bytes is None:
            rows = self._read(sql, (*args, limit))
        else:
            rows, total = [], 0
            with self._reader() as conn:
                for row in conn.execute(sql, (*args, limit)):  # newest first, read as needed
                    total += RECORD_OVERHEAD_BYTES + sum(
                        len(v.encode()) for v in (row[1], row[2], row[3], row[6]) if v)
                    if total > max_bytes:
                        break
                    rows.append(row)
        return [JournalRecord(seq=r[0], op_id=r[1], engine=r[2], type=r[3], wall=r[4],
                              monotonic=r[5], data=_data(r[6])) for r in reversed(rows)]

    def captures(self, engine: str, limit: int | None = None,
                 dumped: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """``(op_id, data)`` of every ``capture`` record of ``engine`` (the newest ``limit``;
        with ``dumped``, of those that dumped an image), newest first: whether it dumped an
        image, and the engine's generation then. Read by the ``records_captures`` index (and
        ``records_images`` for those that dumped): no other record is looked at."""
        self._writer.wait_written()
        only = "AND json_extract(data, '$.dumped') = 1 " if dumped else ""
        rows = self._read("SELECT op_id, data FROM records WHERE engine = ? AND type = "
                          f"'capture' {only}ORDER BY seq DESC LIMIT ?",
                          (engine, -1 if limit is None else max(limit, 1)))
        return [(op, _data(data)) for op, data in rows]

    # ---------------------------------------------------------------- adopted, given away

    def roster_change(self, engine: str, change: str, op_id: str, peer: str,
                      config: bytes | None = None) -> None:
        """Journal that ``engine`` was adopted (``config``: its encoded configuration) or
        given away; returns once it is durable (a restarted controller must see it)."""
        self._writer.wait(self._writer.submit(
            "INSERT INTO roster (engine, change, op_id, peer, wall, config) "
            "VALUES (?, ?, ?, ?, ?, ?)", (engine, change, op_id, peer, time.time(), config),
            barrier=True))

    def roster(self) -> list[tuple[int, str, str, str, str, float, bytes | None]]:
        """``(seq, engine, change, op_id, peer, wall, config)`` of each engine's newest
        roster row, oldest first."""
        self._writer.wait_written()
        return self._read("SELECT seq, engine, change, op_id, peer, wall, config FROM roster "
                          "WHERE seq IN (SELECT MAX(seq) FROM roster GROUP BY engine) "
                          "ORDER BY seq")

    def unsettled(self) -> dict[str, str]:
        """Engine -> op id of every engine whose last ``contact_lost`` record has no
        ``reconciled`` record after it: an operation ended without knowing how it left it."""
        self._writer.wait_written()
        rows = self._read(
            "SELECT engine, type, op_id FROM records WHERE seq IN (SELECT MAX(seq) FROM records "
            "WHERE type IN ('contact_lost', 'reconciled') AND engine IS NOT NULL "
            "GROUP BY engine)")
        return {engine: op for engine, type_, op in rows if type_ == "contact_lost"}

    # ---------------------------------------------------------------- retention

    def compact(self, keep_days: float, keep_operations: int,
                now: float | None = None) -> dict[str, int]:
        """Forget what ``[journal]`` keeps no longer: every ended operation older than
        ``keep_days`` or beyond the newest ``keep_operations`` (in the order they began),
        with its records, and records of no operation older than ``keep_days``, except what
        the controller still reads: each engine's newest operation (``status``'s LAST-OP),
        the operations of its newest capture and newest image (a restore's default), of its
        newest contact record (whether it is unsettled), and every running one; the roster
        is kept whole. Counts of what went: ``operations``, ``records``."""
        cutoff = (time.time() if now is None else now) - keep_days * 86400.0
        self._writer.wait_written()
        victims = [op for (op,) in self._read(
            "SELECT op_id FROM operations WHERE status != ? AND (wall < ? OR rowid NOT IN "
            "(SELECT rowid FROM operations ORDER BY rowid DESC LIMIT ?))",
            (OperationStatus.RUNNING, cutoff, keep_operations))]
        if victims:
            kept = {op for (op,) in self._read(_STILL_READ) if op is not None}
            victims = [op for op in victims if op not in kept]
        gone = {"operations": 0, "records": 0}
        for i in range(0, len(victims), COMPACT_CHUNK):
            chunk = json.dumps(victims[i:i + COMPACT_CHUNK])
            records = self._count("SELECT COUNT(*) FROM records WHERE op_id IN "
                                  "(SELECT value FROM json_each(?))", chunk)
            self._writer.submit(
                "DELETE FROM records WHERE op_id IN (SELECT value FROM json_each(?))", (chunk,))
            self._writer.submit(
                "DELETE FROM engine_operations WHERE (engine, op_seq) IN (SELECT j.value, "
                "o.rowid FROM operations AS o, json_each(o.engines) AS j WHERE o.op_id "
                "IN (SELECT value FROM json_each(?)))", (chunk,))
            self._writer.wait(self._writer.submit(
                "DELETE FROM operations WHERE op_id IN (SELECT value FROM json_each(?))",
                (chunk,), barrier=True))
            gone["operations"] += len(victims[i:i + COMPACT_CHUNK])
            gone["records"] += records
        loose = ("FROM records WHERE op_id IS NULL AND wall < ? AND type NOT IN "
                 "('capture', 'contact_lost', 'reconciled')")
        count = self._count(f"SELECT COUNT(*) {loose}", cutoff)
        if count:
            self._writer.wait(self._writer.submit(f"DELETE {loose}", (cutoff,), barrier=True))
            gone["records"] += count
        return gone

    def _count(self, sql: str, *args: Any) -> int:
        return self._read(sql, args)[0][0]

    # ---------------------------------------------------------------- consistency

    def check(self) -> list[str]:
        """Problems found (empty when consistent): SQLite's own integrity check, records of
        unknown operations, operations whose engines ``engine_operations`` lacks, operations
        ended without a result."""
        self._writer.wait_written()
        problems = []
        ok = self._read("PRAGMA integrity_check")
        if ok != [("ok",)]:
            problems.append(f"integrity_check: {ok}")
        orphans = self._read("SELECT COUNT(*) FROM records WHERE op_id IS NOT NULL AND op_id "
                             "NOT IN (SELECT op_id FROM operations)")[0][0]
        if orphans:
            problems.append(f"{orphans} records of unknown operations")
        unindexed = self._read(
            "SELECT COUNT(*) FROM operations AS o, json_each(o.engines) AS j WHERE NOT EXISTS "
            "(SELECT 1 FROM engine_operations AS e WHERE e.engine = j.value "
            "AND e.op_seq = o.rowid AND e.op_id = o.op_id)")[0][0]
        if unindexed:
            problems.append(f"{unindexed} engines of operations missing from engine_operations")
        no_result = self._read("SELECT op_id FROM operations WHERE status != ? "
                               "AND result IS NULL", (OperationStatus.RUNNING,))
        if no_result:
            problems.append(f"ended without a result: {[r[0] for r in no_result]}")
        return problems


#: the operations ``compact`` never forgets: each engine's newest, those of its newest
#: capture, newest image and newest contact record (every read by index)
_STILL_READ = """
SELECT op_id FROM engine_operations AS e
    WHERE op_seq = (SELECT MAX(op_seq) FROM engine_operations WHERE engine = e.engine)
UNION SELECT op_id FROM records WHERE seq IN (
    SELECT MAX(seq) FROM records WHERE type = 'capture' GROUP BY engine
    UNION SELECT MAX(seq) FROM records WHERE type = 'capture'
        AND json_extract(data, '$.dumped') = 1 GROUP BY engine
    UNION SELECT MAX(seq) FROM records WHERE type IN ('contact_lost', 'reconciled')
        GROUP BY engine)
"""
#: how many operations one delete of ``compact`` names (its transaction's size)
COMPACT_CHUNK = 500

#: an engine's operations: ``engine_operations`` (``e``, by its index) joined to ``operations``
_ENGINE_OPERATIONS = "engine_operations AS e JOIN operations AS o ON o.op_id = e.op_id"


def damaged(path: Path, why: str) -> ConfigError:
    """The error a damaged journal is: what was found, and how to repair it."""
    return ConfigError(
        f"the journal {path} is damaged ({why}); stop the controller, then `ckptctl journal "
        f"check --config FILE` lists the damage and `ckptctl journal salvage --config FILE` "
        "keeps every row that can still be read (the damaged file is kept beside it)",
        file=str(path), key="controller.state_dir", problem=why)


def _data(raw: object) -> dict[str, Any]:
    """A record's data as written (a JSON object); what a damaged or hand-edited row holds
    instead (a number, a blob, broken text) is said, never a crash of the read."""
    if isinstance(raw, (str, bytes)):
        try:
            data = json.loads(raw)
        except ValueError:  # policy: unreadable text: the row is kept, its data said so
            data = None
        if isinstance(data, dict):
            return data
    return {"unreadable": f"not a JSON object: {type(raw).__name__}"}


def _open_schema(db: sqlite3.Connection, path: Path) -> None:
    """Make the tables (those missing), and bring a journal written before
    ``engine_operations`` up to ``SCHEMA_VERSION`` (version 1's ``operation_engines``, ordered
    by wall time, dropped): its operations' engines are filled in
    once, in one transaction with the version (a controller killed meanwhile leaves the
    journal as it was, and the next start does it again)."""
    db.executescript(SCHEMA)
    (version,) = db.execute("PRAGMA user_version").fetchone()
    if version >= SCHEMA_VERSION:
        return
    start = time.monotonic()
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("DROP TRIGGER IF EXISTS operation_engines_fill")  # version 1's, by wall
        db.execute("DROP TABLE IF EXISTS operation_engines")
        filled = db.execute(BACKFILL_ENGINES).rowcount
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:  # policy: nothing half done: the next start fills it again
        db.execute("ROLLBACK")
        raise
    if filled:
        log.info("journal %s: each operation's engines indexed (%d rows, once, in %.1f s)",
                 path, filled, time.monotonic() - start)


def _where(*conditions: tuple[str, Any], keep: tuple[str, ...] = ()) -> tuple[str, tuple]:
    """A WHERE clause of the ``(sql, value)`` conditions whose value is given (non-empty), or
    named in ``keep``; returns it with its arguments ('' and () when none applies)."""
    used = [(sql, value) for sql, value in conditions if value or sql in keep]
    if not used:
        return "", ()
    return "WHERE " + " AND ".join(sql for sql, _ in used), tuple(v for _, v in used)
