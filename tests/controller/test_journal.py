"""The journal on its own: what ``history`` reads back, however many operations came since."""

from __future__ import annotations

import sqlite3

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.controller.journal import Journal
from support.config import engines_toml
from support.timing import scaled


def _done(j: Journal, op_id: str, engines: list[str]) -> None:
    j.begin(op_id, "cycle", engines, {})
    j.record("phase", {"name": "prepare"}, op_id=op_id, engine=engines[0])
    j.finish(p.OperationResult(op_id=op_id, kind="cycle", status="succeeded", engines=[],
                               wall=0.0, duration_s=0.1))


def test_an_old_operation_is_found_by_id_and_by_engine_under_many_newer_ones(tmp_path):
    j = Journal(tmp_path / "journal.sqlite3")
    try:
        _done(j, "old", ["rare"])
        for i in range(60):
            _done(j, f"new{i}", ["busy", "other"])
        (found,) = j.operations(op_id="old", limit=20)
        assert found.op_id == "old" and found.engines == ["rare"] and found.status == "succeeded"
        assert [o.op_id for o in j.operations(engine="rare", limit=20)] == ["old"]
        newest = j.operations(engine="busy", limit=5)
        assert [o.op_id for o in newest] == [f"new{i}" for i in range(59, 54, -1)]
        assert [o.op_id for o in j.operations(limit=3)] == ["new59", "new58", "new57"]
        # an engine name is matched whole, never as part of another
        assert j.operations(engine="bus", limit=20) == []
        assert j.operations(engine="busy", op_id="old", limit=20) == []
        assert [r.op_id for r in j.records(op_id="old")] == ["old"]
        assert j.check() == []
    finally:
        j.close()


def test_last_operations_are_each_engines_newest_in_one_read(tmp_path):
    """``last_operations``: each named engine's newest operation (a running one too), none
    for an engine without any, whatever else the journal holds; a journal from before the
    ``wall`` index gets it when opened."""
    j = Journal(tmp_path / "journal.sqlite3")
    try:
        assert j.last_operations(["a", "b"]) == {}
        _done(j, "old-b", ["b"])
        _done(j, "both", ["a", "b"])
        for i in range(30):
            _done(j, f"c{i}", ["c"])
        _done(j, "newer-a", ["a", "c"])
        j.begin("running-b", "prepare", ["b"], {})
        last = j.last_operations(["a", "b", "c", "none", "ab"])
        assert set(last) == {"a", "b", "c"}
        assert last["a"].op_id == last["c"].op_id == "newer-a"
        assert last["a"].kind == "cycle" and last["a"].status == "succeeded"
        assert last["a"].duration_s is not None and last["a"].duration_s >= 0
        assert last["b"].op_id == "running-b" and last["b"].status == "running"
        assert last["b"].kind == "prepare" and last["b"].duration_s is None
        assert j.last_operations(["b"])["b"].wall == last["b"].wall
        # the same answer as asking for each engine's newest operation on its own
        for name in ("a", "b", "c"):
            assert j.operations(engine=name, limit=1)[0].op_id == last[name].op_id
        assert j.last_operations([]) == {}
    finally:
        j.close()
    with sqlite3.connect(tmp_path / "journal.sqlite3") as db:
        db.execute("DROP INDEX operations_wall")
    j = Journal(tmp_path / "journal.sqlite3")
    try:
        with sqlite3.connect(tmp_path / "journal.sqlite3") as db:
            plan = db.execute("EXPLAIN QUERY PLAN SELECT op_id FROM operations "
                              "ORDER BY wall DESC").fetchall()
        assert "operations_wall" in str(plan), plan
        assert j.last_operations(["a"])["a"].op_id == "newer-a"
    finally:
        j.close()


def _plans(j: Journal, monkeypatch, call) -> list[str]:
    """The query plan (SQLite's ``EXPLAIN QUERY PLAN`` lines) of each read ``call`` makes."""
    reads: list[tuple[str, tuple]] = []
    real = Journal._read

    def spy(self, sql, args=()):
        reads.append((sql, args))
        return real(self, sql, args)

    monkeypatch.setattr(Journal, "_read", spy)
    call()
    monkeypatch.setattr(Journal, "_read", real)
    assert reads
    with sqlite3.connect(j.path) as db:
        return [" | ".join(row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {sql}", args))
                for sql, args in reads]


def test_an_engines_operations_and_records_are_read_by_index_not_by_scan(tmp_path, monkeypatch):
    """What ``status``, ``history``, a restore's image choice and a starting controller ask
    of one engine is found through an index, never by reading the whole journal: the
    journal of a year answers as fast as a new one (``bench/journal_growth.py``)."""
    j = Journal(tmp_path / "journal.sqlite3")
    try:
        for i in range(20):
            _done(j, f"op{i}", [f"e{i % 3}"])
        j.record("capture", {"dumped": True, "generation": 1}, op_id="op4", engine="e1")
        j.record("contact_lost", {}, op_id="op5", engine="e2")
        for call, index in [
                (lambda: j.operations(engine="e1", limit=5), "engine_operations"),
                (lambda: j.operations(engine="e1", op_id="op4"), "engine_operations"),
                (lambda: j.last_operations(["e0", "e1", "never"]), "engine_operations"),
                (lambda: j.records(engine="e1", op_ids=["op1", "op4"]), "records_op"),
                (lambda: j.captures("e1"), "records_captures"),
                (lambda: j.captures("e1", limit=1), "records_captures"),
                (lambda: j.captures("e1", limit=1, dumped=True), "records_images"),
                (lambda: j.captures("e1", dumped=True), "records_images"),
                (lambda: j.unsettled(), "records_contact")]:
            for plan in _plans(j, monkeypatch, call):
                scans = [step for step in plan.split(" | ") if step.startswith("SCAN ")
                         and "VIRTUAL TABLE" not in step]  # the names or ids asked for
                assert not scans, plan
                assert "SEARCH" in plan and (index in plan or "PRIMARY KEY" in plan), plan
        assert [c[0] for c in j.captures("e1", limit=1)] == ["op4"]
        j.record("capture", {"dumped": False, "generation": 1}, op_id="op7", engine="e1")
        assert [c[0] for c in j.captures("e1")] == ["op7", "op4"]
        assert [c[0] for c in j.captures("e1", dumped=True)] == ["op4"]
        assert [(r.op_id, r.type) for r in j.records(engine="e1", op_ids=["op4", "op1"])] == [
            ("op1", "phase"), ("op4", "phase"), ("op4", "capture")]
        assert j.unsettled() == {"e2": "op5"}
    finally:
        j.close()


def test_a_journal_from_before_engine_operations_is_indexed_once_when_opened(tmp_path):
    """A journal written before ``engine_operations`` (``user_version`` 0, no table, no
    trigger) answers by engine as before once opened: its operations are filled in, once."""
    path = tmp_path / "journal.sqlite3"
    j = Journal(path)
    try:
        _done(j, "first", ["a"])
    finally:
        j.close()
    with sqlite3.connect(path) as db:  # as an older controller left it
        db.execute("DROP TRIGGER engine_operations_fill")
        db.execute("DROP TABLE engine_operations")
        db.execute("PRAGMA user_version = 0")
    with sqlite3.connect(path) as db:  # and an operation an older controller journaled
        db.execute("INSERT INTO operations (op_id, kind, engines, params, status, wall, "
                   "monotonic) VALUES ('second', 'cycle', '[\"a\", \"b\"]', '{}', "
                   "'running', 2e9, 0)")
    j = Journal(path)
    try:
        assert [o.op_id for o in j.operations(engine="a", limit=5)] == ["second", "first"]
        assert [o.op_id for o in j.operations(engine="b", limit=5)] == ["second"]
        assert {k: v.op_id for k, v in j.last_operations(["a", "b"]).items()} == {
            "a": "second", "b": "second"}
        assert j.check() == []
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA user_version").fetchone() == (2,)
            rows = db.execute("SELECT COUNT(*) FROM engine_operations").fetchone()
        assert rows == (3,)
    finally:
        j.close()
    with sqlite3.connect(path) as db:  # a row lost from the index is a problem check names
        db.execute("DELETE FROM engine_operations WHERE op_id = 'first'")
    j = Journal(path)  # at the version already: not filled again
    try:
        assert j.operations(engine="a", limit=5)[0].op_id == "second"
        assert j.check() == ["1 engines of operations missing from engine_operations"]
    finally:
        j.close()


def test_the_newest_operation_is_the_last_begun_whatever_the_wall_clock_did(tmp_path,
                                                                          monkeypatch):
    """The wall clock stepped back 10 minutes between two operations: ``history``'s newest
    and LAST-OP are still the one begun last (they went by wall time and showed the older),
    also after the journal is opened again, and in a journal of version 1 (ordered by wall
    time) once it is brought up to version 2."""
    import time as real_time

    path = tmp_path / "journal.sqlite3"
    walls = iter([1_000_000.0, 1_000_000.0 - 600.0, 1_000_000.0 - 3600.0])
    monkeypatch.setattr("ckpt_controller.controller.journal.time.time", lambda: next(walls))
    j = Journal(path)
    try:
        for op in ("before", "after-step-back", "after-another"):
            j.begin(op, "cycle", ["a"], {})
        assert [o.op_id for o in j.operations(limit=3)] == [
            "after-another", "after-step-back", "before"]
        assert [o.op_id for o in j.operations(engine="a", limit=1)] == ["after-another"]
        assert j.last_operations(["a"])["a"].op_id == "after-another"
        assert [u[0] for u in j.unfinished()] == ["before", "after-step-back", "after-another"]
    finally:
        j.close()
    monkeypatch.setattr("ckpt_controller.controller.journal.time.time", real_time.time)
    j = Journal(path)
    try:
        assert j.last_operations(["a"])["a"].op_id == "after-another"
        assert j.check() == [] or all("without a result" not in p for p in j.check())
    finally:
        j.close()
    with sqlite3.connect(path) as db:  # as version 1 left it: an index ordered by wall time
        db.execute("DROP TRIGGER engine_operations_fill")
        db.execute("DROP TABLE engine_operations")
        db.execute("CREATE TABLE operation_engines (engine TEXT NOT NULL, wall REAL NOT NULL, "
                   "op_id TEXT NOT NULL, PRIMARY KEY (engine, wall, op_id)) WITHOUT ROWID")
        db.execute("INSERT INTO operation_engines SELECT j.value, o.wall, o.op_id FROM "
                   "operations AS o, json_each(o.engines) AS j")
        db.execute("PRAGMA user_version = 1")
    j = Journal(path)
    try:
        assert j.operations(engine="a", limit=1)[0].op_id == "after-another"
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA user_version").fetchone() == (2,)
            assert not db.execute("SELECT 1 FROM sqlite_master WHERE name = "
                                  "'operation_engines'").fetchall()
    finally:
        j.close()


def test_an_indexing_that_fails_leaves_the_journal_as_it_was_for_the_next_start(tmp_path):
    from ckpt_controller.errors import ConfigError

    path = tmp_path / "journal.sqlite3"
    j = Journal(path)
    try:
        _done(j, "first", ["a"])
        _done(j, "second", ["a", "b"])
    finally:
        j.close()
    with sqlite3.connect(path) as db:  # as an older controller left it, and a disk that
        db.execute("DELETE FROM engine_operations")  # fails once a row was written
        db.execute("PRAGMA user_version = 0")
        db.execute("CREATE TRIGGER full BEFORE INSERT ON engine_operations WHEN (SELECT "
                   "COUNT(*) FROM engine_operations) >= 1 BEGIN "
                   "SELECT RAISE(ABORT, 'database or disk is full'); END")
    with pytest.raises(ConfigError, match="disk is full"):
        Journal(path)
    with sqlite3.connect(path) as db:  # nothing of it stayed
        assert db.execute("PRAGMA user_version").fetchone() == (0,)
        assert db.execute("SELECT COUNT(*) FROM engine_operations").fetchone() == (0,)
        db.execute("DROP TRIGGER full")
    j = Journal(path)  # the next start does it all
    try:
        assert [o.op_id for o in j.operations(engine="a", limit=5)] == ["second", "first"]
        assert j.check() == []
    finally:
        j.close()


def test_begin_indexes_each_engine_once_and_a_refused_begin_none(tmp_path):
    j = Journal(tmp_path / "journal.sqlite3")
    try:
        j.begin("op", "prepare", ["a", "b", "a"], {})
        with pytest.raises(sqlite3.IntegrityError):
            j.begin("op", "prepare", ["c"], {})
        with sqlite3.connect(j.path) as db:
            rows = db.execute("SELECT engine, op_id FROM engine_operations ORDER BY engine")
            assert rows.fetchall() == [("a", "op"), ("b", "op")]
        assert j.operations(engine="c", limit=5) == []
    finally:
        j.close()


def test_concurrent_writes_are_each_kept(tmp_path):
    """Writers on many threads at once (a fan-out's sessions): every record is there
    afterwards, in order per writer, with its own sequence number."""
    import sqlite3
    import threading

    j = Journal(tmp_path / "journal.sqlite3")
    seqs: list[int] = []
    lock = threading.Lock()

    def writer(n: int) -> None:
        for i in range(50):
            rec = j.record("note", {"writer": n, "i": i}, engine=f"e{n}")
            with lock:
                seqs.append(rec.seq)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seqs) == sorted(set(seqs)) and len(seqs) == 400
    for n in range(8):
        assert [r.data["i"] for r in j.records(engine=f"e{n}")] == list(range(50))
    # a failing write fails only itself: the op id exists already
    j.begin("op", "cycle", ["e0"], {})
    with pytest.raises(sqlite3.IntegrityError):
        j.begin("op", "cycle", ["e0"], {})
    assert j.record("note", {"after": True}, op_id="op").seq > max(seqs)
    j.close()
    reopened = Journal(tmp_path / "journal.sqlite3")  # everything was committed, on disk
    try:
        assert len(reopened.records(limit=1000)) == 401 and reopened.check() == []
    finally:
        reopened.close()


def test_history_limit_returns_records_only_of_the_operations_it_lists(tmp_path):
    """``history --limit N`` lists the newest N operations and the records of those, and of
    no other operation (older ones had many more records than the newest N)."""
    from ckpt_controller.controller.config import default_config
    from ckpt_controller.controller.service import Controller

    import dataclasses

    config = default_config(state_dir=tmp_path / "state")
    ctl = Controller(dataclasses.replace(config, endpoint=f"ipc://{tmp_path}/c.sock"))
    try:
        for i in range(6):
            _done(ctl.journal, f"op{i}", ["e"])
            for k in range(30 if i < 3 else 2):
                ctl.journal.record("note", {"k": k}, op_id=f"op{i}", engine="e")
        for limit in (1, 2, 3):
            reply = ctl.history(p.HistoryCommand(call_id=0, limit=limit))
            listed = [o.op_id for o in reply.operations]
            assert listed == [f"op{i}" for i in range(5, 5 - limit, -1)]
            assert reply.records, limit
            assert {r.op_id for r in reply.records} <= set(listed), (limit, listed)
            # every record of each listed operation is there
            assert len(reply.records) == 3 * limit
    finally:
        ctl.close()


# ---------------------------------------------------------------- group commit

def _result(op_id: str) -> p.OperationResult:
    return p.OperationResult(op_id=op_id, kind="cycle", status="succeeded", engines=[],
                             wall=0.0, duration_s=0.1)


def test_a_burst_from_many_threads_shares_commits_and_keeps_every_record_in_order(tmp_path):
    """While the file is held by another writer, 32 threads journal 100 records each: every
    ``record`` returns at once, and once the file is free they go in a few commits, each
    record whole, in order per writer, numbered without a gap; ``sync`` makes them durable in
    one fsync. A reopened journal numbers on from the largest."""
    import sqlite3
    import threading

    path = tmp_path / "journal.sqlite3"
    j = Journal(path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the writer's commits wait for it
    seqs: dict[int, list[int]] = {}

    def writer(n: int) -> None:
        seqs[n] = [j.record("note", {"writer": n, "i": i}, engine=f"e{n}").seq
                   for i in range(100)]

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(20))
    assert not any(t.is_alive() for t in threads)  # nobody waited for the disk
    assert j.stats()["rows"] == 0
    holder.execute("ROLLBACK")
    j.sync()
    stats = j.stats()
    assert stats["rows"] == 3200 and stats["failed_rows"] == 0
    assert stats["commits"] <= 6 and stats["syncs"] <= 2, stats
    every = sorted(s for ss in seqs.values() for s in ss)
    assert every == list(range(every[0], every[0] + 3200))
    for n in range(32):
        recs = j.records(engine=f"e{n}")
        assert [r.data for r in recs] == [{"writer": n, "i": i} for i in range(100)]
        assert [r.seq for r in recs] == seqs[n]
    j.close()
    holder.close()
    reopened = Journal(path)
    try:
        assert reopened.record("note", {}).seq == every[-1] + 1
        assert len(reopened.records(limit=10_000)) == 3201 and reopened.check() == []
    finally:
        reopened.close()


def test_a_read_sees_every_record_journaled_before_it(tmp_path):
    """A record is written a moment after ``record`` returns; a read made after that sees
    it all the same, from any thread."""
    import threading

    j = Journal(tmp_path / "journal.sqlite3")
    misses: list[tuple[int, int]] = []

    def writer(n: int) -> None:
        for i in range(40):
            rec = j.record("note", {"i": i}, engine=f"e{n}", op_id=f"op{n}")
            seen = j.records(engine=f"e{n}", since=rec.seq - 1)
            if [r.seq for r in seen] != [rec.seq]:
                misses.append((n, i))
            if i % 10 == 0 and j.captures(f"e{n}") != []:
                misses.append((n, -i))

    try:
        threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(30))
        assert misses == []
        rec = j.record("capture", {"image_dir": "/x"}, engine="e9", op_id="op9")
        assert j.captures("e9") == [("op9", {"image_dir": "/x"})]
        j.record("contact_lost", {}, engine="e9", op_id="op9")
        assert j.unsettled() == {"e9": "op9"} and rec.seq > 0
    finally:
        j.close()


CHILD = r"""
import sys, time
from ckpt_controller import protocol as p
from ckpt_controller.controller.journal import Journal
j = Journal(sys.argv[1])
for i in range(3):
    j.record("note", {"i": i}, op_id="op", engine="e")
j.begin("op", "cycle", ["e"], {})
if sys.argv[2] == "begin":
    print("returned", flush=True)
    time.sleep(60)
for i in range(3, 6):
    j.record("note", {"i": i}, op_id="op", engine="e")
j.finish(p.OperationResult(op_id="op", kind="cycle", status="succeeded", engines=[],
                           wall=0.0, duration_s=0.1))
print("returned", flush=True)
time.sleep(60)
"""


def _killed_at(tmp_path, script: str, *args: str, after: float = 0.0):
    """Start ``script`` in a child, wait for its first line, SIGKILL it ``after`` seconds on."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        time.sleep(after)
    finally:
        proc.kill()
        proc.wait(scaled(10))
        proc.stdout.close()
    return line


@pytest.mark.parametrize("barrier", ["begin", "finish"])
def test_begin_and_finish_are_on_disk_when_they_return(tmp_path, barrier):
    """A controller killed -9 right after ``begin`` (or ``finish``) returned: the reopened
    journal has that row and every record journaled before it."""
    path = tmp_path / "journal.sqlite3"
    assert _killed_at(tmp_path, CHILD, str(path), barrier) == "returned\n"
    j = Journal(path)
    try:
        assert j.check() == []
        (op,) = j.operations()
        before = [r.data["i"] for r in j.records(op_id="op")]
        if barrier == "begin":
            assert op.status == "running" and j.unfinished()[0][0] == "op"
            assert before == [0, 1, 2]
        else:
            assert op.status == "succeeded" and j.result("op") == _result("op")
            assert before == list(range(6))
    finally:
        j.close()


WRITER = r"""
import sys
from ckpt_controller.controller.journal import Journal
j = Journal(sys.argv[1])
print("writing", flush=True)
i = 0
while True:
    j.record("note", {"i": i, "pad": "x" * (i % 700), "sum": i * 7}, engine="e")
    if i % 50 == 0:
        j.sync()
    i += 1
"""


@pytest.mark.parametrize("after", [0.05, 0.2, 0.5])
def test_records_cut_by_a_kill_leave_a_whole_prefix(tmp_path, after):
    """A controller killed -9 while journaling as fast as it can: the journal opens clean
    and holds records 0..k, each whole, and none after a missing one."""
    path = tmp_path / "journal.sqlite3"
    assert _killed_at(tmp_path, WRITER, str(path), after=after) == "writing\n"
    j = Journal(path)
    try:
        assert j.check() == []
        recs = j.records(limit=10**7)
        assert recs, "nothing was written before the kill"
        assert [r.data["i"] for r in recs] == list(range(len(recs)))
        assert all(r.data == {"i": i, "pad": "x" * (i % 700), "sum": i * 7}
                   for i, r in enumerate(recs))
        assert [r.seq for r in recs] == list(range(recs[0].seq, recs[0].seq + len(recs)))
    finally:
        j.close()


def test_a_failed_write_is_raised_by_the_next_barrier(tmp_path, caplog):
    """Records lost to a failed commit (a trigger stands in for a full disk: it rolls the
    whole transaction back) are logged at once and raised by the next ``finish``/``sync``,
    once; a ``begin`` then refuses, journaling nothing. A row that breaks a constraint fails
    alone: the others in its commit stay."""
    import sqlite3

    path = tmp_path / "journal.sqlite3"
    j = Journal(path)
    other = sqlite3.connect(path, isolation_level=None)
    other.executescript(
        "CREATE TRIGGER lose BEFORE INSERT ON records WHEN NEW.type = 'lose' "
        "BEGIN SELECT RAISE(ROLLBACK, 'disk is full (stand-in)'); END;"
        "CREATE TRIGGER refuse BEFORE INSERT ON records WHEN NEW.type = 'refuse' "
        "BEGIN SELECT RAISE(ABORT, 'constraint (stand-in)'); END;")
    other.close()
    try:
        j.begin("op", "cycle", ["e"], {})
        kept = j.record("note", {"n": 1}, op_id="op")
        lost = j.record("lose", {}, op_id="op")
        assert lost.seq == kept.seq + 1  # record() itself cannot know yet
        assert j.records(op_id="op") == []  # a read writes them: the whole batch is lost
        assert "not written" in caplog.text and str(lost.seq) in caplog.text
        with pytest.raises(sqlite3.IntegrityError, match=f"{kept.seq}..{lost.seq}"):
            j.finish(_result("op"))
        assert j.result("op") == _result("op")  # its own row was written
        j.sync()  # reported once

        bad = j.record("refuse", {}, op_id="op")
        good = j.record("note", {"n": 2}, op_id="op")
        with pytest.raises(sqlite3.IntegrityError, match=rf"1 rows \(seq {bad.seq}\)"):
            j.sync()
        assert [r.seq for r in j.records(op_id="op")] == [good.seq]

        j.record("lose", {})
        j.records()
        with pytest.raises(sqlite3.IntegrityError, match="did not write 1 rows"):
            j.begin("op2", "cycle", ["e"], {})
        assert not j.exists("op2")
        j.begin("op2", "cycle", ["e"], {})  # the journal works again
        j.record("lose", {})
    finally:
        with pytest.raises(sqlite3.IntegrityError, match="did not write"):
            j.close()  # the last failure is not left unsaid


def test_close_writes_what_is_queued_and_stops_its_thread(tmp_path):
    import sqlite3
    import threading

    path = tmp_path / "journal.sqlite3"
    j = Journal(path)
    for i in range(100):
        j.record("note", {"i": i})
    j.close()
    j.close()  # a second close does nothing
    assert not [t for t in threading.enumerate() if t.name == "journal-writer"]
    with pytest.raises(sqlite3.ProgrammingError):
        j.record("note", {})
    reopened = Journal(path)
    try:
        assert [r.data["i"] for r in reopened.records()] == list(range(100))
    finally:
        reopened.close()


def test_barrier_rounds_commit_with_fsync_and_plain_ones_without(tmp_path):
    """A round holding a barrier commits with ``synchronous=FULL`` (the WAL fsynced), a plain
    round with NORMAL; barriers in a row set FULL once, not once each (two statements fewer
    per barrier on the operation's path)."""
    j = Journal(tmp_path / "journal.sqlite3")
    try:
        writer = j._writer
        said: list[str] = []
        writer._db.set_trace_callback(said.append)

        def mode() -> int:  # between rounds: nothing else uses the connection now
            return writer._db.execute("PRAGMA synchronous").fetchone()[0]

        j.record("note", {"i": 0})
        writer.wait_written()
        assert mode() == 1  # NORMAL
        for i in range(3):
            j.record("note", {"i": i})
            j.sync()
            assert mode() == 2  # FULL
        assert sum(s == "PRAGMA synchronous=FULL" for s in said) == 1, said
        j.record("note", {"i": 9})
        writer.wait_written()
        assert mode() == 1
        assert said.count("PRAGMA synchronous=NORMAL") == 1, said
        assert j.stats()["syncs"] == 3
    finally:
        j.close()


def test_a_starting_controller_finds_the_last_good_cycle_behind_many_failed_ones(tmp_path):
    """The gauge of an engine's last successful cycle is carried over from the journal: the
    newest cycle that succeeded on it, also behind more failed ones than the first look
    reads, and none for an engine whose cycles all failed."""
    from ckpt_controller.controller import service
    from ckpt_controller.controller.config import parse_config
    from ckpt_controller.controller.metrics import Metrics

    state = tmp_path / "state"
    j = Journal(state / "journal.sqlite3")

    def cycle(op_id: str, engine: str, status: str, wall: float) -> None:
        j.begin(op_id, "cycle", [engine], {})
        j.finish(p.OperationResult(op_id=op_id, kind="cycle", status=status, wall=wall,
                                   duration_s=1.0, engines=[p.EngineOutcome(
                                       engine=engine, status=status)]))

    try:
        cycle("good", "a", "succeeded", 0.0)
        for i in range(service.CARRY_OVER_FIRST + 4):
            cycle(f"bad{i}", "a", "failed", 0.0)
            cycle(f"other{i}", "b", "failed", 0.0)
        with sqlite3.connect(j.path) as db:
            ended = db.execute("SELECT ended_wall FROM operations WHERE op_id = 'good'"
                               ).fetchone()[0]
    finally:
        j.close()
    config = parse_config(f'[controller]\nstate_dir = "{state}"\n'
                          f'endpoint = "ipc://{tmp_path}/c"\n'
                          + engines_toml(*((n, f"ipc://{tmp_path}/{n}") for n in "ab")))
    metrics = Metrics()
    ctl = service.Controller(config, metrics=metrics)
    try:
        gauge = "ckpt_last_successful_cycle_timestamp_seconds"
        assert metrics.registry.get_sample_value(gauge, {"engine": "a"}) == ended
        assert metrics.registry.get_sample_value(gauge, {"engine": "b"}) is None
    finally:
        ctl.close()


def test_compact_forgets_old_and_surplus_operations_but_never_what_is_still_read(tmp_path):
    """``compact``: ended operations past ``keep_operations`` (oldest first) or older than
    ``keep_days`` go with their records, and old records of no operation; each engine's
    newest operation, its newest capture and image, its newest contact record, the running
    ones and the roster stay, and every read answers as before for what is kept."""
    j = Journal(tmp_path / "journal.sqlite3")
    try:
        _done(j, "image-a", ["a"])
        j.record("capture", {"dumped": True, "image": "/img/a"}, op_id="image-a", engine="a")
        _done(j, "lost-b", ["b"])
        j.record("contact_lost", {"state": None, "error": "x"}, op_id="lost-b", engine="b")
        for i in range(40):
            _done(j, f"old{i}", ["a", "c"])
        j.record("note", {"text": "an old loose record"}, wall=1.0)
        j.begin("running-d", "prepare", ["d"], {})
        j.roster_change("e", "adopted", "mig-1", "n2")
        _done(j, "newest-c", ["c"])
        gone = j.compact(keep_days=3650, keep_operations=5)
        left = {o.op_id for o in j.operations(limit=1000)}
        assert left == {"image-a", "lost-b", "old37", "old38", "old39", "running-d",
                        "newest-c"}  # the newest five, and what is still read
        assert gone == {"operations": 37, "records": 37 + 1}
        assert j.last_operations(["a", "b", "c"])["a"].op_id == "old39"
        assert [op for op, _ in j.captures("a")] == ["image-a"]
        assert j.unsettled() == {"b": "lost-b"}
        assert len(j.roster()) == 1 and j.check() == []
        # by age: everything ended is older than a day from now (but what is still read)
        gone = j.compact(keep_days=1, keep_operations=1000, now=10 * 86400.0 + 2e9)
        assert {o.op_id for o in j.operations(limit=1000)} == {
            "image-a", "lost-b", "old39", "running-d", "newest-c"}
        assert gone["operations"] == 2 and j.check() == []
        assert j.compact(keep_days=1, keep_operations=1) == {"operations": 0, "records": 0}
    finally:
        j.close()
