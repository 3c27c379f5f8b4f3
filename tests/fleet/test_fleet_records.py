"""The fleet's records as etcd holds them, decoded without etcd: what a damaged or hostile
value does to the decoders the coordinator and the nodes use."""

from __future__ import annotations

import pytest

from ckpt_controller.errors import DamagedRecordError
from ckpt_controller.fleet import unavailable
from ckpt_controller.fleet.records import FleetOp, Task, decode, encode


@pytest.mark.parametrize("kind", [FleetOp, Task], ids=["op", "task"])
def test_parameters_nested_without_end_are_a_damaged_record_not_a_recursion(kind):
    deep = b'{"params":{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    with pytest.raises(DamagedRecordError) as info:
        decode(kind, deep, "/ckpt/ops/x")
    assert info.value.details["key"] == "/ckpt/ops/x" and info.value.exit_code == 2


def test_every_parameter_the_cli_sends_round_trips():
    params = {"deadline_s": 30.0, "drain": "keep", "drain_timeout_s": None, "level": 2,
              "tags": ["kv_cache", "weights"], "all_or_nothing": True, "reason": "drill",
              "residual_budget_bytes": 1 << 30, "image": "op-1"}
    op = FleetOp(op_id="x", kind="prepare", engines=["a"], params=params, max_unavailable=1,
                 created=1.0)
    assert decode(FleetOp, encode(op), "k").params == params


class _OneKey:
    """Stands in for ``fleet.etcd.Etcd``: ``get`` answers one value for every key."""

    def __init__(self, value: bytes) -> None:
        self.value = value

    def get(self, key: str):
        from ckpt_controller.fleet.etcd import KeyValue

        return KeyValue(key=key, value=self.value, mod_revision=7, create_revision=1, lease=0)


@pytest.mark.parametrize("value", [b"{not json", b"[]", b'{"a": 1}',
                                   b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
                         ids=["garbage", "a-list", "not-a-name", "nested"])
def test_a_damaged_unavailable_record_is_said_and_nothing_counts_on_it(value):
    from ckpt_controller.fleet.keys import Keys

    with pytest.raises(DamagedRecordError) as info:
        unavailable.read(_OneKey(value), Keys("/ckpt"))
    assert "etcdctl put /ckpt/unavailable '{}'" in info.value.message
    assert info.value.details["key"] == "/ckpt/unavailable"
    assert unavailable.read(_OneKey(b'{"a": "op-1"}'), Keys("/ckpt")) == ({"a": "op-1"}, 7)


class _StderrInterruptedOnce:
    """stderr whose first write is where Ctrl-C lands: the moment after the submit."""

    def __init__(self) -> None:
        self.text, self.hit = "", False

    def write(self, text: str) -> int:
        if not self.hit:
            self.hit = True
            raise KeyboardInterrupt
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("when", ["submitting", "announcing", "following"])
def test_ctrl_c_at_any_moment_says_what_became_of_the_operation(when, monkeypatch, capsys):
    """Ctrl-C ends ``fleet cycle``, never the operation; the command says so whether the
    interrupt comes during the submit or any moment after it (CI once caught the moment
    between the submit and the first line of progress answering 130 with nothing said)."""
    import contextlib

    from ckpt_controller.cli import fleet_cmd, main
    from ckpt_controller.fleet.drivers import SUBMIT
    from ckpt_controller.fleet.kinds import Drive

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def submitted(client, keys, spec, **kw):
        return FleetOp(op_id=kw["op_id"], kind=spec.kind, engines=kw["engines"],
                       params=kw["params"], max_unavailable=1, created=1.0)

    monkeypatch.setattr(fleet_cmd, "client", lambda args: contextlib.nullcontext(None))
    monkeypatch.setitem(SUBMIT, Drive.PARTS, interrupted if when == "submitting" else submitted)
    monkeypatch.setattr(fleet_cmd, "follow", interrupted)
    stderr = _StderrInterruptedOnce()
    if when == "announcing":
        monkeypatch.setattr("sys.stderr", stderr)
    assert main(["--etcd", "http://127.0.0.1:1", "fleet", "cycle", "e0", "--op-id",
                 "op-7"]) == 130
    err = stderr.text if when == "announcing" else capsys.readouterr().err
    if when == "submitting":
        assert "may be recorded" in err and "--op-id op-7" in err
    else:
        assert "fleet operation op-7 goes on" in err


def test_an_inbox_written_by_the_earlier_shape_still_reads():
    """An earlier version wrote a migration step's task with kind ``migrate-<step>``; it
    reads as kind ``migrate`` with its step. Any other word stays a damaged record."""
    from ckpt_controller.vocab import FleetKind, MigrationStep

    old = (b'{"op_id":"mv","kind":"migrate-adopt","engine":"m0","node":"n2",'
           b'"local_op":"mv.m0.adopt","params":{"source":"n1"},"started":1.5}')
    task = decode(Task, old, "/ckpt/todo/n2/mv/m0")
    assert (task.kind, task.step, task.params) == (FleetKind.MIGRATE, MigrationStep.ADOPT,
                                                   {"source": "n1"})
    for word in (b"migrate-teleport", b"teleport", b"migrate-"):
        with pytest.raises(DamagedRecordError):
            decode(Task, old.replace(b"migrate-adopt", word), "/ckpt/todo/n2/mv/m0")
    new = encode(task)
    assert b'"kind":"migrate"' in new and b'"step":"adopt"' in new


@pytest.mark.parametrize("kind", ["NodeRecord", "EngineRecord", "FleetOp", "Part", "Task",
                                  "StepEnd", "Migration", "Unavailable"])
@pytest.mark.parametrize("raw", [b"{not json", b"[]", b'{"schema": 99}', b"\xff\xfe",
                                 b'{"state": 5}'], ids=["garbage", "list", "schema", "bytes",
                                                        "shape"])
def test_every_record_kind_damaged_is_one_typed_error_naming_its_key(kind, raw):
    from ckpt_controller.fleet import records

    with pytest.raises(DamagedRecordError) as info:
        decode(getattr(records, kind), raw, "/ckpt/some/key")
    assert info.value.details["key"] == "/ckpt/some/key"
    assert "/ckpt/some/key" in info.value.message and info.value.exit_code == 2


def test_a_record_of_a_newer_schema_is_refused_by_name():
    from ckpt_controller.fleet.records import SCHEMA, NodeRecord

    rec = NodeRecord(schema=SCHEMA + 1, node="n", controller="c", pid=1, host="h",
                     started=0.0, version="9", lease=1)
    with pytest.raises(DamagedRecordError, match="newer than this version"):
        decode(NodeRecord, encode(rec), "/ckpt/nodes/n")


def test_a_word_the_vocabulary_does_not_have_is_a_damaged_record():
    from ckpt_controller.fleet.records import Part

    good = encode(Part(engine="a", node="n", local_op="op.a", status="failed",
                       state="prepared"))
    assert decode(Part, good, "k").status == "failed"
    for bad in (good.replace(b'"failed"', b'"FAILED"'),
                good.replace(b'"prepared"', b'"sleepy"')):
        with pytest.raises(DamagedRecordError, match="k is damaged"):
            decode(Part, bad, "k")


def test_a_part_record_deleted_under_a_followed_operation_is_said_not_a_crash(monkeypatch,
                                                                               capsys):
    """``fleet watch`` (and every command that follows an operation) once died of a
    ``KeyError`` when a part's record was deleted: the missing part is said once while the
    operation runs, the others are followed on, and at its end a ``DamagedRecordError``
    names the missing keys."""
    from ckpt_controller.cli import fleet_follow
    from ckpt_controller.fleet import ops
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.records import Part
    from ckpt_controller.vocab import OperationStatus, PartStatus

    rounds = iter([OperationStatus.RUNNING, OperationStatus.RUNNING, OperationStatus.SUCCEEDED])

    def read_op(client, keys, op_id):
        return FleetOp(op_id=op_id, kind="cycle", engines=["a0", "b0"], params={},
                       max_unavailable=1, created=1.0, status=next(rounds))

    def read_parts(client, keys, op_id):
        return {"a0": (Part(engine="a0", node="n1", local_op="w.a0",
                            status=PartStatus.SUCCEEDED), 1)}

    monkeypatch.setattr(ops, "read_op", read_op)
    monkeypatch.setattr(ops, "read_parts", read_parts)
    with pytest.raises(DamagedRecordError, match="/ckpt/parts/w/b0 are missing") as info:
        fleet_follow.follow(None, Keys("/ckpt"), "w", progress=True, every_s=0.0)
    assert info.value.details["missing"] == ["/ckpt/parts/w/b0"]
    assert info.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.count("b0: its part record /ckpt/parts/w/b0 is missing") == 1
    assert "a0 on n1: succeeded" in err


def test_a_followed_operation_that_does_not_move_says_what_it_waits_on(monkeypatch, capsys):
    """A node that died before its part started, and no node holding the coordinator key:
    ``fleet cycle`` once waited silently for ever. With no part changed for
    ``WAIT_SAY_S`` it says which parts it waits on, on which nodes, which of those are down,
    and that no node coordinates; then again every ``WAIT_SAY_AGAIN_S``."""
    from ckpt_controller.cli import fleet_follow
    from ckpt_controller.fleet import ops, registry
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.records import NodeRecord, Part
    from ckpt_controller.vocab import OperationStatus, PartStatus

    rounds = iter([OperationStatus.RUNNING] * 3 + [OperationStatus.FAILED])

    def read_op(client, keys, op_id):
        return FleetOp(op_id=op_id, kind="cycle", engines=["a0", "b0"], params={},
                       max_unavailable=1, created=1.0, status=next(rounds))

    def read_parts(client, keys, op_id):
        return {"a0": (Part(engine="a0", node="n1", local_op="s.a0",
                            status=PartStatus.SUCCEEDED), 1),
                "b0": (Part(engine="b0", node="n2", local_op="s.b0"), 1)}

    class NoCoordinator:
        def get(self, key):
            assert key == "/ckpt/coordinator"
            return None

    n1 = NodeRecord(node="n1", controller="ipc:///c", pid=1, host="h", started=1.0,
                    version="0", lease=1)
    monkeypatch.setattr(ops, "read_op", read_op)
    monkeypatch.setattr(ops, "read_parts", read_parts)
    monkeypatch.setattr(registry, "read", lambda c, keys: registry.FleetView(
        revision=1, nodes=[n1], engines=[]))
    monkeypatch.setattr(fleet_follow, "WAIT_SAY_S", 0.0)
    monkeypatch.setattr(fleet_follow, "WAIT_SAY_AGAIN_S", 0.0)
    op, parts = fleet_follow.follow(NoCoordinator(), Keys("/ckpt"), "s", progress=True,
                                    every_s=0.0)
    assert op.status == "failed"
    waits = [line for line in capsys.readouterr().err.splitlines() if "waits on" in line]
    assert len(waits) == 3, waits  # once a round while nothing changed
    assert waits[0].endswith("fleet cycle s waits on b0 pending on n2 (node down); no node "
                             "coordinates (none may, or none is up): nothing moves until "
                             "one does")


def test_a_mark_in_unavailable_that_no_longer_holds_is_found_stale():
    """``unavailable.stale_marks``, for engines RUNNING and free on their node: a part lost with the
    node and a fleet operation that ended (a failed migration left its mark while the engine
    ran again on its source) no longer hold; a running fleet operation's mark, a node-local
    operation's (no fleet record: its own end takes it back) and an unreadable one stay."""
    from ckpt_controller.fleet.unavailable import stale_marks

    def op(status):
        return FleetOp(op_id="x", kind="migrate", engines=["a"], max_unavailable=1,
                       created=1.0, status=status)

    ops = {"ended-mig": op("failed"), "moving": op("running")}

    def read_op(op_id):
        if op_id == "damaged":
            raise DamagedRecordError("unreadable", key="/ckpt/ops/damaged")
        return ops.get(op_id)

    marks = {"a": "ended-mig", "b": "lost:old-cycle", "c": "moving", "d": "local-op-7",
             "e": "damaged"}
    assert stale_marks(marks, read_op) == {"a": "ended-mig", "b": "lost:old-cycle"}


def test_a_node_local_operation_past_a_running_fleet_limit_is_refused():
    """``guard.check_room``: with a fleet cycle at ``--max-unavailable 2`` running and two
    engines out, a node-local cycle of a third is refused naming the fleet operation (3 were
    out at once); one of an engine out already, or with room, or with no fleet operation
    that takes engines out running, goes on."""
    from ckpt_controller.errors import BusyError
    from ckpt_controller.fleet.guard import check_room

    def op(kind, limit):
        return FleetOp(op_id=f"f-{kind}", kind=kind, engines=["a", "b", "c"],
                       max_unavailable=limit, created=1.0)

    out = {"a": "f-cycle", "b": "f-cycle"}
    with pytest.raises(BusyError, match="past fleet operation f-cycle's --max-unavailable 2"):
        check_room(out, ["c"], [op("cycle", 2)], "local-1")
    check_room(out, ["a"], [op("cycle", 2)], "local-2")  # out already: nothing more
    check_room(out, ["c"], [op("cycle", 3)], "local-3")
    check_room(out, ["c"], [op("restore", 1)], "local-4")  # takes nothing out
    check_room(out, ["c"], [], "local-5")


def test_a_failed_migration_s_summary_says_where_the_engine_is_now():
    """``fleet migrate``'s human line for a ``failed`` migration: where the engine was when
    it ended, then what its node's record says now (a source back from a restart resumed it:
    the line once said "not RUNNING" while it served again)."""
    from ckpt_controller.cli.fleet_follow import migration_summary
    from ckpt_controller.fleet.records import EngineRecord, Migration

    op = FleetOp(op_id="m-1", kind="migrate", engines=["m0"], max_unavailable=1, created=1.0,
                 status="failed")
    mig = Migration(op_id="m-1", engine="m0", source="n1", target="n2", outcome="failed",
                    error="the source could not send it: node n1 was lost")
    now = EngineRecord(engine="m0", node="n1", state="running")
    line = migration_summary(op, mig, now)
    assert line == ("fleet migrate m-1: failed: m0 failed, not RUNNING when it ended (the "
                    "source could not send it: node n1 was lost); now running on n1 (its "
                    "node's record)")
    assert migration_summary(op, mig).endswith("node n1 was lost)")  # no record: as before


def test_a_node_identity_is_made_whole_once_and_kept(tmp_path):
    """``identity.node_identity``: made the first time, the same ever after; never an empty
    file (a controller killed while making it left one, refused at every later start); a
    file that is not an identity (garbage, empty, a FIFO: never waited on) refuses the start
    naming it."""
    import os

    from ckpt_controller.errors import ConfigError
    from ckpt_controller.fleet.identity import node_identity

    first = node_identity(tmp_path)
    assert len(first) == 32 and node_identity(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node-id"]  # no temporary left
    for damage in ("garbage", "empty", "fifo"):
        (tmp_path / "node-id").unlink()
        if damage == "fifo":
            os.mkfifo(tmp_path / "node-id")
        else:
            (tmp_path / "node-id").write_text("zz\n" if damage == "garbage" else "")
        with pytest.raises(ConfigError, match="is not a node identity") as info:
            node_identity(tmp_path)
        assert info.value.details["path"] == str(tmp_path / "node-id")


def test_a_round_does_not_ask_an_engine_a_migration_froze_here():
    """A node's round asks the status of its engines and publishes them; one a migration is
    dumping here or has left stopped answers nothing, so it is published out of reach
    without asking: a round once waited out a status request's 2 s timeout on one while the
    migration's finish waited in the node's inbox (``bench/migrate.py``: 0.2 to 0.65 s
    between the adopt and the finish, 0.02 s since)."""
    from types import SimpleNamespace

    from ckpt_controller.fleet.node import FleetNode
    from ckpt_controller.protocol import EngineView

    asked: list[str] = []
    written: list = []

    def status(names):
        asked.extend(names)
        return SimpleNamespace(engines=[EngineView(engine=n, kind="native", control="c",
                                                   reachable=True) for n in names])

    def out_of_reach(name):
        return EngineView(engine=name, kind="native", control="c", reachable=False)

    node = SimpleNamespace(
        _status=status, migration=SimpleNamespace(stopped={"b"}, out_of_reach=out_of_reach),
        config=SimpleNamespace(roster=SimpleNamespace(by_name={"a": None, "b": None})),
        record=lambda view, eng: SimpleNamespace(engine=view.engine,
                                                 content=lambda: view.reachable),
        _written={}, _write=written.extend, rounds=1)
    FleetNode._publish(node, ["a", "b"])  # (``publish`` is it under a lock)
    assert asked == ["a"]
    assert {(rec.engine, rec.content()) for rec in written} == {("a", True), ("b", False)}
