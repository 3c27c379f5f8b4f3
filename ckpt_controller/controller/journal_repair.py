"""A damaged journal: found at start, said plainly, and repaired by hand.

``problems(path)`` is SQLite's ``quick_check`` of the file (every page's structure, about a
second for a journal of months); the controller runs it when it opens the journal and refuses
to start on a damaged one (``ConfigError``, exit 2, naming the file and the two commands
below), and a read that finds damage later (a page spoiled while serving) is the same typed
error, never a traceback. ``ckptctl journal check --config FILE`` prints what ``quick_check``
finds; ``ckptctl journal salvage --config FILE`` (the controller stopped: it takes the state
directory's lock) copies every row that can still be read, each table row by row (one bad
page costs the rows on it, not the rest), into a new journal, keeps the damaged one beside it
as ``journal.sqlite3.damaged-<time>`` and puts the new one in its place.

Neighbours: ``journal`` (opens and reads it, and says what damage is: ``damaged``), ``statedir`` (the lock), ``cli.controller_cmds``
(the commands), docs/journal.md.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from ckpt_controller.controller.journal import Journal

#: the tables salvaged, each with the columns copied (in the order they are made)
TABLES = {
    # the rowid too: it is the order operations began in (``engine_operations``)
    "operations": ("rowid", "op_id", "kind", "engines", "params", "status", "wall", "monotonic",
                   "ended_wall", "result"),
    "records": ("seq", "op_id", "engine", "type", "wall", "monotonic", "data"),
    "roster": ("seq", "engine", "change", "op_id", "peer", "wall", "config"),
}


def problems(path: Path) -> list[str]:
    """What ``PRAGMA quick_check`` finds in the journal at ``path`` (empty: sound); a file
    SQLite cannot open at all is one problem."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as exc:
        return [str(exc)]
    try:
        rows = db.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as exc:  # policy: a header SQLite cannot read is damage
        return [str(exc)]
    finally:
        db.close()
    found = [str(r[0]) for r in rows]
    return [] if found == ["ok"] else found


def salvage(path: Path) -> dict[str, object]:
    """Copy what can be read of the journal at ``path`` into a new one put in its place
    (module doc); what was kept and lost, per table, and where the damaged file went."""
    fresh = path.with_name(path.name + ".salvaged")
    for leftover in (fresh, *(fresh.with_name(fresh.name + s) for s in ("-wal", "-shm"))):
        leftover.unlink(missing_ok=True)
    Journal(fresh).close()  # the tables, indexes and triggers of today's schema
    src = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    dst = sqlite3.connect(fresh, isolation_level=None)
    counts: dict[str, dict[str, int]] = {}
    try:
        dst.execute("BEGIN")
        for table, columns in TABLES.items():
            counts[table] = _copy(src, dst, table, columns)
        dst.execute("COMMIT")
    finally:
        src.close()
        dst.close()
    kept = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, kept)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, kept.with_name(kept.name + suffix))
    os.replace(fresh, path)
    for suffix in ("-wal", "-shm"):
        fresh.with_name(fresh.name + suffix).unlink(missing_ok=True)
    return {"tables": counts, "damaged_kept_as": str(kept)}


def _copy(src: sqlite3.Connection, dst: sqlite3.Connection, table: str,
          columns: tuple[str, ...]) -> dict[str, int]:
    """Every row of ``table`` ``src`` can read, one by one by rowid (a bad page costs its own
    rows): ``kept`` and ``lost`` (rowids asked that could not be read)."""
    try:
        (top,) = src.execute(f"SELECT MAX(rowid) FROM {table}").fetchone()
    except sqlite3.DatabaseError:
        top = _highest_readable(src, table)
    kept = lost = 0
    names = ", ".join(columns)
    marks = ", ".join("?" * len(columns))
    for rowid in range(1, (top or 0) + 1):
        try:
            row = src.execute(f"SELECT {names} FROM {table} WHERE rowid = ?",
                              (rowid,)).fetchone()
        except sqlite3.DatabaseError:
            lost += 1
            continue
        if row is None:
            continue  # never there, or deleted (compaction)
        try:
            dst.execute(f"INSERT OR IGNORE INTO {table} ({names}) VALUES ({marks})", row)
            kept += 1
        except sqlite3.Error:  # policy: a row whose values no longer fit is lost, not fatal
            lost += 1
    return {"kept": kept, "lost": lost}


def _highest_readable(src: sqlite3.Connection, table: str) -> int:
    """The highest rowid found by walking the table until it breaks (``MAX`` itself failed)."""
    top = 0
    try:
        for (rowid,) in src.execute(f"SELECT rowid FROM {table}"):
            top = max(top, rowid)
    except sqlite3.DatabaseError:  # policy: as far as it could be read
        pass
    return top
