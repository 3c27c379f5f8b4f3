"""``Settler``: what a node puts right after it was away, judged by each engine's newest
migration only, whatever order the records' keys sort in (issue: an older migration that
moved the engine away was settled first, gave the engine away, and the newest one, which had
restored a copy here, was then skipped: the copy stayed alive beside the source's).

Against a stand-in etcd and controller (no etcd, no CRIU): the records and the calls are what
is tried here; the migrations themselves are in ``test_migration.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.etcd import KeyValue
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.migration.settle import Settler
from ckpt_controller.vocab import MigrationOutcome
from support.processes import gone
from support.standins import StandInEtcd
from support.timing import scaled, wait_until


class StandInController:
    """Holds engine ``m``, whose copy here is process ``pid``, until it is given away."""

    def __init__(self, pid: int) -> None:
        self.held = {"m"}
        self.given: list[tuple[str, str, str]] = []
        self.config = SimpleNamespace(knows=lambda name: name in self.held)
        self.pid = pid

    def status(self, names):
        return SimpleNamespace(engines=[SimpleNamespace(status=SimpleNamespace(pid=self.pid))])

    def give_away(self, name: str, *, op_id: str, to: str) -> None:
        self.held.discard(name)
        self.given.append((name, op_id, to))


@pytest.mark.parametrize("older,newer", [("a-first", "b-second"), ("z-first", "b-second")])
def test_a_node_back_settles_the_engines_newest_migration(tmp_path: Path, older, newer):
    """``older`` moved m from n1 to n2; ``newer`` moved it back to n1, which restored a copy
    and was then killed; the coordinator failed ``newer`` and m runs on n2 again. n1 back:
    its restored copy is ended and m given back to n2, by ``newer``, in either key order."""
    keys = Keys("/ckpt")
    records = [
        (older, r.Migration(op_id=older, engine="m", source="n1", target="n2",
                            outcome=MigrationOutcome.MOVED), 10),
        (newer, r.Migration(op_id=newer, engine="m", source="n2", target="n1",
                            outcome=MigrationOutcome.FAILED), 20),
    ]
    kvs = [KeyValue(keys.migration(op), msgspec.json.encode(mig), rev, rev, 0)
           for op, mig, rev in records]
    kvs.append(KeyValue(keys.owner("m"), b"n2", 30, 30, 0))
    copy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        controller = StandInController(copy.pid)
        node = SimpleNamespace(etcd=StandInEtcd(kvs), keys=keys,
                               fleet=SimpleNamespace(node="n1"), owned={"m"},
                               config=SimpleNamespace(image_dir=tmp_path))
        Settler(node, controller).settle()
        assert controller.given == [("m", newer, "n2")]
        copy.wait(scaled(10))
        wait_until(lambda: gone(copy.pid), scaled(10), "the copy restored here ended")
    finally:
        copy.kill()
        copy.wait()
