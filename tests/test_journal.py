"""The journal on its own: what ``history`` reads back, however many operations came since."""

from __future__ import annotations

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.controller.journal import Journal


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
