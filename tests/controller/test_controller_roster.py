"""A controller adopts engines and gives them away (a migration's two ends): journaled, so a
restarted controller starts with the adopted ones and without the given-away ones; a TOML
entry of a given-away engine is shown as moved and refused for operations, saying where it
lives; the link, gauges and monitor follow. Real step engine processes, an in-process
``ControllerServer`` (``ckptctl`` against it where the text matters)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import msgspec
import pytest

from ckpt_controller import protocol as p
from ckpt_controller.controller.config import EngineConfig, parse_config
from ckpt_controller.controller.roster import AdoptedEngine
from ckpt_controller.controller.server import ControllerServer
from ckpt_controller.controller.service import Controller
from ckpt_controller.errors import BusyError, ConfigError, UsageError
from ckpt_controller.rpc import new_op_id
from ckpt_controller.vocab import DrainMode, ReleaseLevel
from support.cli import ckptctl
from support.config import controller_toml
from support.timing import scaled, wait_until


def _toml(tmp_path: Path, *engines) -> str:
    return controller_toml(tmp_path, *engines, defaults='level = 0\ndrain = "wait"',
                           keys="heartbeat_interval_s = 0.2\nmissed_beats = 3\nmetrics_port = 0\n")


def _server(toml: str) -> ControllerServer:
    return ControllerServer(parse_config(toml)).start()


def _op(kind: str, *engines: str) -> p.OperationCommand:
    return p.OperationCommand(call_id=0, op_id=new_op_id(), kind=kind, engines=list(engines))


def _views(ctl: Controller) -> dict[str, p.EngineView]:
    return {v.engine: v for v in ctl.status([]).engines}


def _up_series(server: ControllerServer, name: str) -> str | None:
    lines = [ln for ln in server.metrics.render().splitlines()
             if ln.startswith(f'ckpt_engine_up{{engine="{name}"}}')]
    return lines[0].split()[-1] if lines else None


def test_adopt_restart_give_away_restart_and_adopt_back(tmp_path, spawn_engine):
    home, guest = spawn_engine("r1", weights_mib=4, kv_mib=1), \
        spawn_engine("r2", weights_mib=4, kv_mib=1)
    toml = _toml(tmp_path, home)
    adopted = EngineConfig(name="r2", control=guest.control, labels={"pool": "b"},
                           defaults={"level": ReleaseLevel.NOTHING, "drain": DrainMode.KEEP})
    server = _server(toml)
    try:
        ctl = server.controller
        ctl.adopt(adopted, op_id="mig-1", origin="node-a")
        assert _views(ctl)["r2"].status.state == "running"
        assert ctl.run(_op("cycle", "r2"), 60).status == "succeeded"
        wait_until(lambda: _up_series(server, "r2") == "1.0", what="r2's gauge up")
        ctl.adopt(adopted, op_id="mig-1", origin="node-a")  # repeated: done already
        with pytest.raises(UsageError, match="driven by this controller already"):
            ctl.adopt(adopted, op_id="mig-9", origin="node-a")
        with pytest.raises(UsageError, match="driven by this controller already"):
            ctl.adopt(EngineConfig(name="r1", control=home.control), op_id="m", origin="x")
        with pytest.raises(UsageError, match="absolute ipc path"):
            ctl.adopt(EngineConfig(name="r3", control="ipc://rel.sock"), op_id="m", origin="x")
    finally:
        server.close()

    server = _server(toml)  # restarted: r2 is still driven, with its whole configuration
    try:
        ctl = server.controller
        assert [e.name for e in ctl.config.engines] == ["r1", "r2"]
        assert ctl.config.engine("r2") == adopted
        assert ctl.config.prepare_defaults("r2").drain == DrainMode.KEEP
        assert ctl.run(_op("cycle", "r2"), 60).status == "succeeded"
        # the TOML's r1 and the adopted r2 both leave
        ctl.give_away("r2", op_id="mig-2", to="node-b")
        ctl.give_away("r1", op_id="mig-3", to="node-c")
        ctl.give_away("r2", op_id="mig-2", to="node-b")  # repeated: done already
        views = _views(ctl)
        assert (views["r2"].moved_to, views["r2"].moved_by, views["r2"].status) == \
            ("node-b", "mig-2", None)
        with pytest.raises(UsageError, match="given away to node node-b by operation mig-2"):
            ctl.run(_op("prepare", "r2"), 60)
        with pytest.raises(UsageError, match="no engines are configured"):
            ctl.run(_op("prepare"), 60)
        wait_until(lambda: _up_series(server, "r2") is None, what="r2's gauges gone")
        out = ckptctl("status", endpoint=server.endpoint)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "r1: MOVED to node node-c by operation mig-3" in out.stdout
        out = ckptctl("prepare", "r1", endpoint=server.endpoint)
        assert out.returncode == 2 and "node node-c" in out.stderr, out.stdout + out.stderr
    finally:
        server.close()

    server = _server(toml)  # restarted: both still moved; r1's TOML entry is only shown
    try:
        ctl = server.controller
        assert ctl.config.engines == ()
        assert {n: v.moved_to for n, v in _views(ctl).items()} == {"r1": "node-c",
                                                                    "r2": "node-b"}
        with pytest.raises(UsageError, match="node-c"):
            ctl.run(_op("cycle", "r1"), 60)
        ctl.adopt(EngineConfig(name="r1", control=home.control), op_id="mig-4",
                  origin="node-c")  # it comes back
        views = _views(ctl)
        assert views["r1"].status.state == "running" and views["r1"].moved_to is None
        assert ctl.run(_op("cycle", "r1"), 60).status == "succeeded"
        wait_until(lambda: _up_series(server, "r1") == "1.0", what="r1's gauge up again")
    finally:
        server.close()


def test_give_away_and_operations_race_status_polls(tmp_path, spawn_engine):
    """Status polls on other threads never fail or see a half-changed roster while the
    engine is adopted and given away over and over; an operation and a give_away of the
    same engine: the operation holds the engine first (the give_away is refused as busy) or
    is refused naming the node: never both, never an operation on a given-away engine."""
    home, guest = spawn_engine("b1", weights_mib=4, kv_mib=1), \
        spawn_engine("b2", weights_mib=4, kv_mib=1)
    ctl = Controller(parse_config(_toml(tmp_path, home)))
    stop = threading.Event()
    seen: list[set[str]] = []
    failures: list[BaseException] = []

    def poll() -> None:
        while not stop.is_set():
            try:
                views = ctl.status([]).engines
                assert all(v.moved_to is not None or v.engine in ("b1", "b2") for v in views)
                seen.append({f"{v.engine}:{'moved' if v.moved_to else 'driven'}"
                             for v in views})
            except BaseException as exc:  # policy: the test's assertion, below
                failures.append(exc)
                return

    pollers = [threading.Thread(target=poll) for _ in range(2)]
    for t in pollers:
        t.start()
    outcomes = []
    try:
        guest_cfg = EngineConfig(name="b2", control=guest.control)
        for i in range(8):
            ctl.adopt(guest_cfg, op_id=f"in-{i}", origin="elsewhere")
            box: list = []
            gave: list[bool] = []
            done = threading.Event()
            racer = threading.Thread(target=lambda i=i: gave.append(_give_away(ctl, i)))
            if i % 2:  # the give_away first, or the operation first: both orders
                racer.start()
                racer.join(scaled(30))
            try:
                ctl.start(_op("cycle", "b2"), lambda r: (box.append(r), done.set()))
                started = True
            except UsageError as err:
                assert "given away to node elsewhere" in err.message
                started = False
            if not i % 2:
                racer.start()
                racer.join(scaled(30))
            if started:
                assert done.wait(scaled(60))
                assert box[0].status == "succeeded", box
                if gave == [False]:  # refused while held (or given away once it ended)
                    ctl.give_away("b2", op_id=f"out-{i}", to="elsewhere")
            else:
                assert gave == [True]
            outcomes.append("busy" if started else "refused")
            assert not ctl.config.knows("b2")
    finally:
        stop.set()
        for t in pollers:
            t.join(scaled(30))
        ctl.close()
    assert not failures, failures
    assert {"b2:driven", "b2:moved"} <= set().union(*seen)
    assert outcomes == ["busy", "refused"] * 4
    journal = sqlite3.connect(tmp_path / "state" / "journal.sqlite3")
    changes = [r[0] for r in journal.execute("SELECT change FROM roster ORDER BY seq")]
    journal.close()
    assert changes == ["adopted", "given_away"] * 8


def _give_away(ctl: Controller, i: int) -> bool:
    try:
        ctl.give_away("b2", op_id=f"out-{i}", to="elsewhere")
        return True
    except BusyError:  # policy: held by the operation: the test's outcome
        return False


def _damage(tmp_path: Path, sql: str, *args) -> None:
    db = sqlite3.connect(tmp_path / "state" / "journal.sqlite3")
    with db:
        db.execute(sql, args)
    db.close()


@pytest.mark.parametrize("damage, problem", [
    (b"\xc1", "roster row 1 of engine 'g1' is malformed"),
    (msgspec.msgpack.encode(AdoptedEngine(name="g1", control="http://x:1", kind="native")),
     "endpoint must start with ipc://"),
    (msgspec.msgpack.encode(AdoptedEngine(name="other", control="tcp://x:1", kind="native")),
     "names engine 'other'"),
], ids=["not-msgpack", "bad-endpoint", "another-name"])
def test_a_malformed_roster_row_refuses_the_start_clearly(tmp_path, damage, problem):
    toml = _toml(tmp_path)
    ctl = Controller(parse_config(toml))
    ctl.adopt(EngineConfig(name="g1", control="tcp://127.0.0.1:1"), op_id="m1", origin="n")
    ctl.close()
    _damage(tmp_path, "UPDATE roster SET config = ?", damage)
    with pytest.raises(ConfigError, match=problem) as err:
        Controller(parse_config(toml))
    assert err.value.details["seq"] == 1 and err.value.details["engine"] == "g1"
    (tmp_path / "ctl.toml").write_text(toml)
    out = ckptctl("serve", "--config", str(tmp_path / "ctl.toml"))
    assert out.returncode == 2 and "malformed" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    _damage(tmp_path, "DELETE FROM roster")  # the person's repair: it starts again
    Controller(parse_config(toml)).close()


def test_an_adoption_the_open_files_limit_cannot_hold_is_refused_before_it_is_journaled(
        tmp_path, monkeypatch):
    """One engine more than the hard open-files limit holds: the adoption is refused with
    the ``ConfigError`` that says what to raise, and nothing is journaled or driven."""
    from ckpt_controller.controller import openfiles

    server = _server(_toml(tmp_path, ("h1", f"ipc://{tmp_path}/h1.ctl")))
    try:
        ctl = server.controller
        hard = openfiles.needed(1)  # room for the one engine it has, not for two
        monkeypatch.setattr(openfiles.resource, "getrlimit", lambda which: (hard, hard))
        with pytest.raises(ConfigError, match="room for 1 engines: raise LimitNOFILE="):
            ctl.adopt(EngineConfig(name="g1", control=f"ipc://{tmp_path}/g1.ctl"),
                      op_id="mig-fd", origin="node-a")
        assert "g1" not in _views(ctl)
        assert [row for row in ctl.journal.roster() if row[1] == "g1"] == []
    finally:
        server.close()
