"""The migration's coordinator side against a real etcd (``make etcd``), with the nodes played
by the test: each step the driver starts lands in its node's inbox, and the test writes its
end as a node would (``record.write_end``) or lets its node's lease run out. What is
checked is what decides where the engine ends: the next step after every end, the single
transaction on ``moving/<engine>`` that lets either the target take the engine over or the
source resume it (never both), and what the operation, its part, the engine's lock and
``unavailable`` say at the end. The real thing, with CRIU between two network namespaces, is
``test_migration.py``."""

from __future__ import annotations

import time

import pytest

from ckpt_controller.errors import BusyError, UsageError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import ops, parts, unavailable
from ckpt_controller.fleet.coordinator import Coordinator
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.kinds import spec
from ckpt_controller.fleet.migration import record as m
from ckpt_controller.fleet.migration.driver import MigrationDriver
from ckpt_controller.fleet.records import (
    EngineRecord,
    Migration,
    NodeRecord,
    Part,
    StepEnd,
    Task,
    decode,
    encode,
)
from ckpt_controller.vocab import FleetKind

pytestmark = pytest.mark.fleet

K = Keys("/ckpt")


class Fleet:
    """Two nodes registered under leases of their own, engine ``m0`` on ``n1``."""

    def __init__(self, client) -> None:
        self.c = client
        self.leases = {}
        for node in ("n1", "n2"):
            self.up(node)
        self.c.put(K.owner("m0"), "n1")
        self.c.put(K.engine("m0"), encode(EngineRecord(engine="m0", node="n1",
                                                       state="running", generation=0)))
        self.coordinator = Coordinator(client, K)

    def up(self, node: str) -> None:
        lease = self.c.grant(60)
        self.leases[node] = lease
        rec = NodeRecord(node=node, controller="ipc:///x", pid=1, host="h", started=0.0,
                         version="0", lease=lease)
        self.c.put(K.node(node), encode(rec), lease)

    def down(self, node: str) -> None:
        self.c.revoke(self.leases.pop(node))

    def drive(self, rounds: int = 4) -> None:
        for _ in range(rounds):
            if not self.coordinator.drive():
                return

    def task(self, node: str):
        """The one task in ``node``'s inbox, with its revision."""
        (kv,) = self.c.get_prefix(K.inbox(node))
        return decode(Task, kv.value, kv.key), kv.create_revision

    def end(self, node: str, status: str = "succeeded", **detail) -> str:
        """``node`` ends the step in its inbox; returns the step's name."""
        task, rev = self.task(node)
        step = task.step
        assert m.write_end(self.c, K, task, rev, StepEnd(
            step=step, node=node, status=status, ended=time.time(), detail=detail,
            error=None if status == "succeeded" else f"{step} failed"))
        return step

    def end_part(self, node: str) -> None:
        """``node`` ends the part in its inbox, succeeded, its engine RUNNING: the part's end
        written and the task taken out in one transaction, as a node writes it."""
        task, rev = self.task(node)
        ended = Part(engine=task.engine, node=node, local_op=task.local_op,
                     status="succeeded", state="running", started=task.started,
                     ended=time.time())
        todo = K.todo(node, task.op_id, task.engine)
        assert self.c.txn([e.compare_created(todo, rev)],
                          [e.put_op(K.part(task.op_id, task.engine), encode(ended)),
                           e.delete_op(todo)])[0]

    def at_adopt(self) -> None:
        """A migration of m0 to n2 submitted, received and sent: the adopt in n2's inbox."""
        submit(self)
        self.drive()
        self.end("n2")
        self.drive()
        self.end("n1", pid=4242)
        self.drive()

    def mig(self) -> Migration:
        return m.read(self.c, K, "mv")[0]

    def op(self):
        return ops.read_op(self.c, K, "mv")


@pytest.fixture
def fleet(etcd):
    with etcd.client() as c:
        yield Fleet(c)


MIGRATE = spec(FleetKind.MIGRATE)


def submit(f: Fleet, **params):
    return m.submit(f.c, K, MIGRATE, op_id="mv", engine="m0", to="n2", params=params)


def test_a_migration_that_goes_well_moves_the_engine_and_frees_it(fleet):
    f = fleet
    submit(f, drain="keep")
    f.drive()
    assert f.c.get(K.lock("m0")).value == b"mv"  # one operation on it, fleet-wide
    assert unavailable.read(f.c, K)[0] == {"m0": "mv"}
    task, _ = f.task("n2")
    assert task.step == "receive" and task.params["drain"] == "keep"
    assert f.end("n2", transport="page-server", page_server="169.254.77.2:7000") == "receive"
    f.drive()
    assert f.end("n1", pid=4242, control="tcp://0.0.0.0:7701") == "send"
    f.drive()
    assert f.c.get(K.moving("m0")).value == b"mv"  # the target may take it now
    # the target takes it over between re-wake and re-admission (NodeMigration._take_over)
    ok, _ = f.c.txn([e.compare_value(K.moving("m0"), "mv")],
                    [e.put_op(K.owner("m0"), "n2"), e.delete_op(K.moving("m0"))])
    assert ok
    assert f.end("n2", state="running") == "adopt"
    f.drive()
    assert f.end("n1", killed=True) == "finish"
    f.drive()
    mig = f.mig()
    assert mig.outcome == "moved" and [d.step for d in mig.done] == [
        "receive", "send", "adopt", "finish"]
    assert f.op().status == "succeeded"
    (part, _), = ops.read_parts(f.c, K, "mv").values()
    assert (part.node, part.status, part.state) == ("n2", "succeeded", "running")
    assert f.c.get(K.lock("m0")) is None and f.c.get(K.moving("m0")) is None
    assert unavailable.read(f.c, K)[0] == {}
    assert f.c.get(K.owner("m0")).value == b"n2"
    assert f.c.get_prefix(K.inbox("n1")) == [] and f.c.get_prefix(K.inbox("n2")) == []


def test_a_failed_restore_on_the_target_resumes_the_source(fleet):
    f = fleet
    f.at_adopt()
    assert f.end("n2", status="failed") == "adopt"  # before it took the engine over
    f.drive()
    assert f.c.get(K.moving("m0")) is None  # the target can no longer take it
    task, _ = f.task("n1")
    assert task.step == "resume"
    f.end("n1", state="running")
    f.drive()
    mig = f.mig()
    assert mig.outcome == "stayed" and "the target did not take it" in mig.error
    assert f.op().status == "failed" and f.c.get(K.owner("m0")).value == b"n1"
    assert unavailable.read(f.c, K)[0] == {}


def test_the_target_lost_after_it_took_the_engine_over_finishes_not_resumes(fleet):
    f = fleet
    f.at_adopt()
    ok, _ = f.c.txn([e.compare_value(K.moving("m0"), "mv")],
                    [e.put_op(K.owner("m0"), "n2"), e.delete_op(K.moving("m0"))])
    assert ok
    f.down("n2")  # died before it wrote the adopt's end
    f.drive()
    assert f.mig().done[-1].status == "lost"
    task, _ = f.task("n1")
    assert task.step == "finish"  # it is the target's: the source's copy is ended
    f.end("n1")
    f.drive()
    assert f.mig().outcome == "moved" and f.op().status == "succeeded"


def test_the_target_lost_before_it_took_the_engine_over_resumes_the_source(fleet):
    f = fleet
    f.at_adopt()
    f.down("n2")
    f.drive()
    # from now on the target's own take-over transaction fails: moving/m0 is gone
    assert f.c.get(K.moving("m0")) is None
    assert f.task("n1")[0].step == "resume"
    ok, _ = f.c.txn([e.compare_value(K.moving("m0"), "mv")],
                    [e.put_op(K.owner("m0"), "n2")])
    assert not ok and f.c.get(K.owner("m0")).value == b"n1"


def test_a_failed_send_abandons_the_target_and_the_engine_stays(fleet):
    f = fleet
    submit(f)
    f.drive()
    f.end("n2", transport="page-server")
    f.drive()
    f.end("n1", status="failed", state="running")  # the source's own rules rolled it back
    f.drive()
    assert f.task("n2")[0].step == "abandon"
    f.end("n2")
    f.drive()
    mig = f.mig()
    assert mig.outcome == "stayed" and "could not send it" in mig.error
    assert f.op().status == "failed" and f.c.get(K.lock("m0")) is None


def test_an_engine_that_died_in_the_dump_is_reported_lost(fleet):
    f = fleet
    submit(f)
    f.drive()
    f.end("n2")
    f.drive()
    f.end("n1", status="failed", state=None, engine_died=True)  # its process is gone
    f.drive()
    f.end("n2")
    f.drive()
    assert f.mig().outcome == "lost"
    (part, _), = ops.read_parts(f.c, K, "mv").values()
    assert part.status == "lost" and f.op().status == "failed"
    assert unavailable.read(f.c, K)[0] == {"m0": "lost:mv"}  # out until it is back


def test_a_coordinator_killed_between_any_two_writes_leaves_a_state_the_next_goes_on_from(
        fleet):
    """Each round is written with a check of the record's revision: a second coordinator
    working from a stale read writes nothing, and the same end is never applied twice."""
    f = fleet
    submit(f)
    f.drive()
    f.end("n2")
    stale = m.read(f.c, K, "mv")
    f.drive(rounds=1)  # the receive's end applied: send is next
    other = MigrationDriver(f.c, K)
    op = f.op()
    other._after(op, stale[0], stale[1], StepEnd(step="receive", node="n2",
                                                    status="succeeded", ended=time.time()))
    assert [d.step for d in f.mig().done] == ["receive"]  # not twice


def test_bad_migrations_are_refused_up_front(fleet):
    f = fleet
    with pytest.raises(UsageError, match="on n1 already"):
        m.submit(f.c, K, MIGRATE, op_id="x1", engine="m0", to="n1", params={})
    with pytest.raises(UsageError, match="not registered"):
        m.submit(f.c, K, MIGRATE, op_id="x2", engine="nope", to="n2", params={})
    f.down("n2")
    with pytest.raises(e.UnreachableError, match="the target n2 is not registered"):
        m.submit(f.c, K, MIGRATE, op_id="x3", engine="m0", to="n2", params={})
    f.up("n2")
    f.c.put(K.lock("m0"), "other-op")
    with pytest.raises(BusyError, match="held by operation other-op"):
        m.submit(f.c, K, MIGRATE, op_id="x4", engine="m0", to="n2", params={})
    f.c.delete(K.lock("m0"))
    # its node could not reach it: retryable (exit 4), not a usage error
    for rec in (EngineRecord(engine="m0", node="n1", state=None, reachable=False),
                EngineRecord(engine="m0", node="n1", state=None)):
        f.c.put(K.engine("m0"), encode(rec))
        with pytest.raises(e.UnreachableError, match="n1 could not reach m0") as got:
            m.submit(f.c, K, MIGRATE, op_id="x5", engine="m0", to="n2", params={})
        assert got.value.exit_code == 4
    f.c.put(K.engine("m0"), encode(EngineRecord(engine="m0", node="n1", state="prepared")))
    with pytest.raises(UsageError, match="m0 is prepared on n1; only a RUNNING") as got:
        m.submit(f.c, K, MIGRATE, op_id="x6", engine="m0", to="n2", params={})
    assert got.value.exit_code == 2
    f.c.put(K.engine("m0"), encode(EngineRecord(engine="m0", node="n1", state="running",
                                                generation=0)))
    first = submit(f)
    assert submit(f) == first  # the same id again follows the same migration
    with pytest.raises(UsageError, match="already used"):
        parts.submit(f.c, K, spec(FleetKind.CYCLE), op_id="mv", engines=["m0"], params={},
                     max_unavailable=None)


@pytest.mark.parametrize("handed_back", [True, False])
def test_a_target_that_failed_after_its_take_over_resumes_the_source_only_if_it_handed_back(
        fleet, handed_back):
    """The target took the engine over, then its restore failed before re-admission: it
    ends its copy and hands ``owners`` back (then the source resumes), or, when it could
    not, keeps the engine (the migration finishes with the engine there, said)."""
    f = fleet
    f.at_adopt()
    ok, _ = f.c.txn([e.compare_value(K.moving("m0"), "mv")],
                    [e.put_op(K.owner("m0"), "n2"), e.delete_op(K.moving("m0"))])
    assert ok
    if handed_back:
        f.c.put(K.owner("m0"), "n1")
    f.end("n2", status="failed", handed_back=handed_back)
    f.drive()
    task, _ = f.task("n1")
    assert task.step == ("resume" if handed_back else "finish")


def test_a_target_down_before_the_adopt_starts_resumes_the_source(fleet):
    """The target went away after its receive: the adopt never starts (so never takes the
    engine over), and the source, holding it stopped, resumes it."""
    f = fleet
    submit(f)
    f.drive()
    f.end("n2")
    f.drive()
    f.down("n2")
    f.end("n1", pid=4242)
    f.drive()
    assert f.task("n1")[0].step == "resume"
    f.end("n1", state="running")
    f.drive()
    assert f.mig().outcome == "stayed" and f.c.get(K.owner("m0")).value == b"n1"


def test_a_source_down_before_the_send_starts_the_target_abandons(fleet):
    f = fleet
    submit(f)
    f.drive()
    f.down("n1")
    f.end("n2", transport="page-server")
    f.drive()
    assert f.task("n2")[0].step == "abandon"  # its page server stopped
    f.end("n2")
    f.drive()
    mig = f.mig()
    assert mig.outcome == "failed" and "was down before it could send it" in mig.error
    assert f.op().status == "failed"


def test_a_target_down_at_the_start_nothing_moves(fleet):
    f = fleet
    submit(f)
    f.down("n2")
    f.drive()
    mig = f.mig()
    assert mig.outcome == "stayed" and "the target n2 is down" in mig.error
    assert f.c.get_prefix(K.inbox("n1")) == [] and f.c.get(K.lock("m0")) is None


def test_a_coordinator_that_died_after_taking_moving_back_decides_the_same_again(fleet):
    """The adopt failed before the take-over; a coordinator deleted ``moving`` and died
    before writing its decision: the next one, finding ``moving`` gone, still resumes the
    source (``owners`` names it), never ends the source's copy."""
    f = fleet
    f.at_adopt()
    f.end("n2", status="failed")
    f.c.delete(K.moving("m0"))  # what the dead coordinator did before it died
    f.drive()
    assert f.task("n1")[0].step == "resume"


@pytest.mark.parametrize("when", ["before", "while"])
def test_a_source_down_at_the_finish_the_engine_has_moved_either_way(fleet, when):
    """The source died after the send: whether its lease ran out before the finish was put
    in its inbox or while it sat there, the migration has moved the engine and says the
    source ends its stopped copy when it is back."""
    f = fleet
    f.at_adopt()
    ok, _ = f.c.txn([e.compare_value(K.moving("m0"), "mv")],
                    [e.put_op(K.owner("m0"), "n2"), e.delete_op(K.moving("m0"))])
    assert ok
    if when == "before":
        f.down("n1")
    f.end("n2", state="running")
    f.drive()
    if when == "while":
        assert f.task("n1")[0].step == "finish"
        f.down("n1")
        f.drive()
    mig = f.mig()
    assert mig.outcome == "moved"
    assert mig.error == "RUNNING on n2; n1 is down and ends its stopped copy when it is back"


@pytest.mark.parametrize("raw", [b"{not json", b'{"step":"receive","node":"n2","status":"x",'
                                 b'"ended":1,"detail":{"a":' + b"[" * 100_000 + b"]" * 100_000
                                 + b"}}"], ids=["garbage", "nested"])
def test_a_damaged_step_end_counts_as_lost_and_the_migration_goes_on(fleet, raw):
    f = fleet
    submit(f)
    f.drive()
    f.c.put(K.step_end("mv", "receive"), raw)
    f.drive()
    mig = f.mig()
    assert mig.done[-1].status == "lost" and "damaged" in mig.done[-1].error
    assert mig.outcome == "stayed" and f.op().status == "failed"


@pytest.mark.parametrize("kind", [FleetKind.CYCLE, FleetKind.MIGRATE])
def test_a_fleet_operation_on_an_engine_a_node_local_one_holds_never_takes_its_lock(fleet, kind):
    """A node-local operation holds m0's lock (it runs there): a fleet part or migration
    about to start on m0 ends failed without starting, naming the holder, and the lock stays
    the local one's (the part's start once overwrote it, and its end deleted it while the
    local one still ran)."""
    f = fleet
    if kind is FleetKind.MIGRATE:
        submit(f)  # a migration is refused up front while the lock is held: taken just after
    else:
        parts.submit(f.c, K, spec(kind), op_id="mv", engines=["m0"], params={},
                     max_unavailable=None)
    f.c.put(K.lock("m0"), "local-op-1", f.leases["n1"])
    f.drive(rounds=6)
    assert f.c.get(K.lock("m0")).value == b"local-op-1"
    assert f.c.get_prefix(K.inbox("n1")) == [] and f.c.get_prefix(K.inbox("n2")) == []
    op = f.op()
    assert op.status == "failed"
    assert "held by operation local-op-1" in op.error
    assert unavailable.read(f.c, K)[0] == {}  # m0 was never taken out


def test_unavailable_deleted_under_a_running_cycle_never_lets_more_out_than_its_limit(fleet):
    """``unavailable`` deleted by hand while a cycle at ``--max-unavailable 1`` has a part
    running: the next part still waits for it (3 of 1 were out once), and the start that
    follows writes the running part's place back."""
    f = fleet
    f.c.put(K.owner("x1"), "n2")
    f.c.put(K.engine("x1"), encode(EngineRecord(engine="x1", node="n2", state="running",
                                                generation=0)))
    parts.submit(f.c, K, spec(FleetKind.CYCLE), op_id="roll", engines=["m0", "x1"],
                 params={}, max_unavailable=1)
    f.drive()
    assert unavailable.read(f.c, K)[0] == {"m0": "roll"}
    f.c.delete(K.unavailable)
    f.drive()
    assert f.c.get_prefix(K.inbox("n2")) == []  # x1 waits for m0's part
    f.end_part("n1")  # m0's part, RUNNING again
    f.drive()
    assert f.task("n2")[0].engine == "x1"
    assert unavailable.read(f.c, K)[0] == {"x1": "roll"}


def test_a_started_parts_task_deleted_from_its_inbox_is_put_back(fleet):
    """The task of a running part deleted by hand from its node's inbox (the operation ran
    for ever, its engine's place held): the coordinator puts it back, the node's end is
    written against it, and the operation ends."""
    f = fleet
    parts.submit(f.c, K, spec(FleetKind.CYCLE), op_id="lost-task", engines=["m0"], params={},
                 max_unavailable=1)
    f.drive()
    task, _ = f.task("n1")
    f.c.delete(K.todo("n1", "lost-task", "m0"))
    f.drive()
    again, _ = f.task("n1")
    assert (again.local_op, again.engine) == (task.local_op, "m0")
    f.end_part("n1")
    f.drive()
    assert ops.read_op(f.c, K, "lost-task").status == "succeeded"
    assert unavailable.read(f.c, K)[0] == {}
