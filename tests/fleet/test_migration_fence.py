"""``Fence``: a target cut off from etcd for a lease stops the copies it holds uncertainly
(adopted by a migration, not owned here, not RUNNING, nothing done to them since), and when
etcd answers again lets each go on (owned here after all), keeps it stopped (its migration
still runs) or kills it and gives the engine back (the migration ended without it).

Against a stand-in etcd and controller, with real processes as the copies; the partition
itself is in ``test_migration.py`` (``test_a_target_cut_off_before_its_take_over_...``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import psutil
import pytest

from ckpt_controller.errors import BusyError
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.etcd import KeyValue
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.migration.fence import Fence
from ckpt_controller.vocab import CheckpointState, MigrationOutcome
from support.processes import gone
from support.standins import StandInEtcd
from support.timing import wait_until

KEYS = Keys("/ckpt")


class Copies:
    """Engines on this node: name -> (the migration that adopted it or None, its state,
    its last operation, its process)."""

    def __init__(self) -> None:
        self.engines: dict[str, dict] = {}
        self.records: list[tuple[str, dict, str | None, str | None]] = []
        self.given: list[tuple[str, str, str]] = []
        self.busy: set[str] = set()
        self.procs: list[subprocess.Popen] = []
        self.config = SimpleNamespace(engines=[], knows=lambda n: n in self.engines)

    def add(self, name: str, adopted_by: str | None, state: CheckpointState,
            last_op: str | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        self.procs.append(proc)
        self.engines[name] = dict(adopted_by=adopted_by, state=state, last_op=last_op,
                                  proc=proc)
        self.config.engines = [SimpleNamespace(name=n) for n in self.engines]
        return proc

    # what Fence asks of the controller
    def adopted_by(self, name):
        return self.engines[name]["adopted_by"]

    def last_op(self, name):
        return self.engines[name]["last_op"]

    def status(self, names):
        e = self.engines[names[0]]
        return SimpleNamespace(engines=[SimpleNamespace(status=SimpleNamespace(
            state=e["state"], pid=e["proc"].pid))])

    def record(self, type_, data, *, op_id=None, engine=None):
        self.records.append((type_, data, op_id, engine))

    def give_away(self, name, *, op_id, to):
        if name in self.busy:
            raise BusyError(f"engine {name} is held by operation {op_id}.restore")
        self.engines.pop(name)
        self.config.engines = [SimpleNamespace(name=n) for n in self.engines]
        self.given.append((name, op_id, to))

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def status_of(proc) -> str:
    try:
        return psutil.Process(proc.pid).status()
    except psutil.NoSuchProcess:
        return "gone"


def migration(op: str, outcome: MigrationOutcome) -> bytes:
    return msgspec.json.encode(r.Migration(op_id=op, engine="m", source="n1", target="n2",
                                           outcome=outcome))


@pytest.fixture
def copies():
    made = Copies()
    yield made
    made.close()


def fence_on(tmp_path: Path, copies: Copies, kvs: list[KeyValue], owned=()) -> Fence:
    node = SimpleNamespace(etcd=StandInEtcd(kvs), keys=KEYS, fleet=SimpleNamespace(node="n2"),
                           owned=set(owned), config=SimpleNamespace(image_dir=tmp_path))
    return Fence(node, copies, arriving=set())


def test_cut_off_it_stops_only_the_copies_it_holds_uncertainly(tmp_path, copies):
    m = copies.add("m", "mv", CheckpointState.FAILED, last_op="mv.m.restore")
    toml = copies.add("toml", None, CheckpointState.FAILED)
    owned = copies.add("owned", "mv2", CheckpointState.FAILED, last_op="mv2.owned.restore")
    running = copies.add("running", "mv3", CheckpointState.RUNNING, last_op="mv3.running.restore")
    later = copies.add("later", "mv4", CheckpointState.PREPARED, last_op="cycle-7")
    fence = fence_on(tmp_path, copies, [], owned={"owned"})
    fence.cut_off(2.5)
    wait_until(lambda: status_of(m) == "stopped", timeout_s=5, what="the copy stopped")
    assert all(status_of(p) != "stopped" for p in (toml, owned, running, later))
    assert fence.fenced == {"m": ("mv", m.pid)}
    assert copies.records == [("fenced", {"action": "stopped", "migration": "mv",
                                          "pid": m.pid, "silent_s": 2.5},
                               "mv.m.restore", "m")]
    fence.cut_off(3.0)  # once
    assert len(copies.records) == 1


def test_in_touch_again_a_copy_this_node_owns_goes_on(tmp_path, copies):
    m = copies.add("m", "mv", CheckpointState.FAILED, last_op="mv.m.restore")
    fence = fence_on(tmp_path, copies, [KeyValue(KEYS.owner("m"), b"n2", 5, 5, 0)])
    fence.cut_off(2.5)
    wait_until(lambda: status_of(m) == "stopped", timeout_s=5, what="the copy stopped")
    fence.in_touch()
    wait_until(lambda: status_of(m) != "stopped", timeout_s=5, what="the copy continued")
    assert fence.fenced == {} and "m" in fence.node.owned
    assert [rec[1]["action"] for rec in copies.records] == ["stopped", "continued"]
    assert copies.given == []


def test_in_touch_again_a_copy_stays_stopped_until_its_migration_ends_then_dies(tmp_path,
                                                                                copies):
    m = copies.add("m", "mv", CheckpointState.FAILED, last_op="mv.m.restore")
    fence = fence_on(tmp_path, copies, [KeyValue(KEYS.owner("m"), b"n1", 5, 5, 0),
                                        KeyValue(KEYS.migration("mv"),
                                                 migration("mv", MigrationOutcome.RUNNING),
                                                 6, 6, 0)])
    fence.cut_off(2.5)
    fence.in_touch()  # the coordinator has not decided: stopped still
    wait_until(lambda: status_of(m) == "stopped", timeout_s=5, what="the copy stopped")
    assert "m" in fence.fenced
    fence.node.etcd.put(KEYS.migration("mv"), migration("mv", MigrationOutcome.STAYED))
    copies.busy.add("m")  # its restore still holds it: killed now, given back later
    fence.in_touch()
    wait_until(lambda: gone(m.pid) or m.poll() is not None, timeout_s=5,
               what="the copy killed")
    assert "m" in fence.fenced and copies.given == []
    copies.busy.clear()
    fence.in_touch()
    assert fence.fenced == {} and copies.given == [("m", "mv", "n1")]
    assert [rec[1]["action"] for rec in copies.records] == ["stopped", "killed"]


def test_a_restored_copy_is_known_by_its_pid_file_only_while_that_process_lives(tmp_path):
    """``procs.restored_pid``: the copy criu-restore wrote down, while it lives; a process
    started after the file was written (the PID reused) is not it, so nothing kills it."""
    import os
    import time

    from ckpt_controller.fleet.migration import procs

    copy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        time.sleep(0.05)
        (tmp_path / "criu-restored-pid").write_text(f"{copy.pid}\n")
        assert procs.restored_pid(tmp_path) == copy.pid
        past = time.time() - 3600  # written before that process started: a reused PID
        os.utime(tmp_path / "criu-restored-pid", (past, past))
        assert procs.restored_pid(tmp_path) is None
    finally:
        copy.kill()
        copy.wait()
    assert procs.restored_pid(tmp_path) is None  # gone
    assert procs.restored_pid(tmp_path / "nowhere") is None
