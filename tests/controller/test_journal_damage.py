"""A damaged journal: refused at start with a typed error naming the file and the repair
(never a traceback), ``ckptctl journal check`` saying what is wrong, ``ckptctl journal
salvage`` keeping every row it can read (the controller stopped), and a record whose data is
not a JSON object read without a crash."""

from __future__ import annotations

import os
import sqlite3

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.controller.journal import Journal
from ckpt_controller.errors import ConfigError
from support.cli import ckptctl
from support.processes import ControllerProcess

PAGE = 4096


def _journal(path, n: int = 400) -> None:
    j = Journal(path)
    try:
        for i in range(n):
            j.begin(f"op{i}", "cycle", [f"e{i % 4}"], {"note": "x" * 200})
            j.record("phase", {"name": "prepare", "pad": "y" * 300}, op_id=f"op{i}",
                     engine=f"e{i % 4}")
            j.finish(p.OperationResult(op_id=f"op{i}", kind="cycle", status="succeeded",
                                       engines=[], wall=0.0, duration_s=0.1))
    finally:
        j.close()


def _scribble(path, at: float, size: int) -> None:
    """``size`` bytes of garbage written over the file at ``at`` (a fraction of its length),
    from a page boundary, as a bad disk or a stray write would."""
    pages = path.stat().st_size // PAGE
    with open(path, "r+b") as f:
        f.seek(int(pages * at) * PAGE)
        f.write(os.urandom(size))


def _config(tmp_path) -> str:
    return (f'[controller]\nendpoint = "ipc://{tmp_path}/c.sock"\n'
            f'state_dir = "{tmp_path}/state"\n')


def test_a_damaged_journal_is_refused_at_start_and_salvaged(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    path = state / "journal.sqlite3"
    _journal(path)
    _scribble(path, 0.5, PAGE)
    with pytest.raises(ConfigError, match="is damaged") as info:
        Journal(path)
    assert "journal salvage" in info.value.message and info.value.details["file"] == str(path)
    config = tmp_path / "c.toml"
    config.write_text(_config(tmp_path))
    out = ckptctl("serve", "--config", str(config))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"the journal {path} is damaged" in out.stderr and "journal check" in out.stderr
    checked = ckptctl("journal", "check", "--config", str(config))
    assert checked.returncode == 1 and "damaged" in checked.stdout, checked.stdout
    saved = ckptctl("journal", "salvage", "--config", str(config))
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert "rows kept" in saved.stdout and ".damaged-" in saved.stdout
    assert list(state.glob("journal.sqlite3.damaged-*"))  # kept beside it
    assert ckptctl("journal", "check", "--config", str(config)).returncode == 0
    j = Journal(path)
    try:
        ops = j.operations(limit=1000)
        assert 300 < len(ops) < 400  # most kept, the bad page's rows lost
        ids = [o.op_id for o in ops]
        assert ids == sorted(ids, key=lambda s: -int(s[2:]))  # still in the order begun
        assert j.check() == [] or all("integrity" not in x for x in j.check())
    finally:
        j.close()
    served = ControllerProcess(tmp_path, "")  # and a controller starts on it
    try:
        assert served.ckptctl("history", "--limit", "1").returncode == 0
        refused = ckptctl("journal", "salvage", "--config", str(served.config))
        assert refused.returncode == 2 and "in use by another controller" in refused.stderr
    finally:
        served.stop()


def test_a_journal_that_is_no_database_is_said_so(tmp_path):
    path = tmp_path / "journal.sqlite3"
    path.write_bytes(b"not a journal at all " * 500)
    with pytest.raises(ConfigError, match="is damaged"):
        Journal(path)


def test_a_record_whose_data_is_not_an_object_is_read_not_crashed_on(tmp_path):
    path = tmp_path / "journal.sqlite3"
    _journal(path, n=3)
    with sqlite3.connect(path) as db:  # hand-edited, or a page that kept its structure
        db.execute("UPDATE records SET data = 42 WHERE op_id = 'op1'")
        db.execute("UPDATE records SET data = x'00ff' WHERE op_id = 'op2'")
    j = Journal(path)
    try:
        recs = {r.op_id: r.data for r in j.records(op_ids=["op0", "op1", "op2"], limit=10)}
        assert recs["op0"]["name"] == "prepare"
        assert "unreadable" in recs["op1"] and "unreadable" in recs["op2"]
    finally:
        j.close()


def test_a_result_the_journal_cannot_take_is_never_answered_as_succeeded(spawn_controller,
                                                                         ipc_dir):
    """The disk fills between an operation's start and its end (SQLite says "database or disk
    is full" for its result): the caller gets ``StateDirError`` (exit 1) saying the outcome
    and that it is not durable, never "succeeded" (a client once saw three such operations
    succeed, and after a restart they read "interrupted"); the log says so once, not once per
    operation; a restarted controller finds the operation interrupted, as the error said."""
    import json

    from ckpt_controller.agent import Agent
    from support.config import engines_toml

    agent = Agent("df", control=f"ipc://{ipc_dir}/df.ctl", heartbeat_interval_s=0.2).start()
    try:
        ctl = spawn_controller(engines_toml(agent))
        with sqlite3.connect(ctl.state_dir / "journal.sqlite3") as db:  # the disk, full
            db.execute("CREATE TRIGGER full BEFORE UPDATE OF result ON operations "
                       "WHEN NEW.result IS NOT NULL BEGIN "
                       "SELECT RAISE(ABORT, 'database or disk is full'); END")
        for i in range(3):
            out = ctl.ckptctl("cycle", "df", "--op-id", f"full-{i}", "--json")
            assert out.returncode == 1, out.stdout + out.stderr
            err = json.loads(out.stdout)["error"]
            assert err["kind"] == "StateDirError", err
            assert "ended succeeded" in err["message"] and "not durable" in err["message"]
        log = (ctl.dir / "controller.log").read_text()
        assert log.count("was not written") == 1, log  # bounded: one line, then counted
        with sqlite3.connect(ctl.state_dir / "journal.sqlite3") as db:  # room again
            db.execute("DROP TRIGGER full")
        ctl.stop()
        ctl.start()
        hist = json.loads(ctl.ckptctl("history", "--op-id", "full-0", "--json").stdout)
        assert hist["operations"][0]["status"] == "interrupted", hist["operations"]
    finally:
        agent.close()
