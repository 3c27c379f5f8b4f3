"""The controller as operators and scripts use it: a real ``ckptctl serve`` process, real
reference-engine processes, the CLI with ``--json`` and its exit codes, and kill -9."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import urllib.request

import msgspec
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckpt_controller.agent import AgentClient, EngineHooks
from ckpt_controller.cli.output import document
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.controller.journal import Journal
from ckpt_controller.engine.client import EngineClient
from ckpt_controller.errors import BusyError, RejectedError
from support import ROOT
from support.cli import CKPTCTL, StreamedLines, ckptctl
from support.config import engine_table, engines_toml
from support.hooks import write_hook
from support.net import ipc_connections, wait_connected
from support.processes import wait_state
from support.timing import deadline_in, scaled, wait_until


def test_full_cycle_through_the_cli_with_json(spawn_reference, spawn_controller):
    eng = spawn_reference("e1")
    ctl = spawn_controller(engines_toml(eng, defaults='drain = "keep"\nlevel = 2'))
    out = ctl.ckptctl("cycle", "e1", "--json", "--op-id", "first")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["status"] == "succeeded" and result["op_id"] == "first"
    (e1,) = result["engines"]
    assert e1["state"] == "running" and e1["generation"] == 1
    # a hook point with no hooks is no phase
    assert [p["name"] for p in e1["phases"]] == ["prepare", "capture", "restore"]
    assert e1["released"]["level"] == 2 and e1["drain"]["mode"] == "keep"
    status = json.loads(ctl.ckptctl("status", "--json").stdout)
    assert status["engines"][0]["status"]["state"] == "running"
    hist = json.loads(ctl.ckptctl("history", "--op-id", "first", "--json").stdout)
    types = [r["record_type"] for r in hist["records"]]
    dests = [r["data"]["dest"] for r in hist["records"] if r["record_type"] == "transition"]
    assert dests == ["preparing", "prepared", "restoring", "running"]
    assert {"operation_start", "phase", "drain", "memory", "operation_end"} <= set(types)
    human = ctl.ckptctl("history")
    assert "first cycle e1: succeeded" in human.stdout


def test_prepare_options_rollback_reason_and_journal_contents(spawn_reference,
                                                               spawn_controller):
    """The CLI's prepare flags reach the agents (--tags, --budget, --no-all-or-nothing), a
    rollback's --reason is journaled with its transition, and the journal keeps hook runs
    (with output tails), phase durations and wall times, in WAL mode."""
    a, b = spawn_reference("o1"), spawn_reference("o2")
    ctl = spawn_controller(engine_table(a, extra='[engine.defaults]\nresidual_budget = "1B"')
                           + engines_toml(b))
    write_hook(ctl, "pre-prepare", "10-say", 'echo "checked $CKPT_ENGINE"')
    out = ctl.ckptctl("prepare", "o2", "--tags", "kv_cache", "--json", "--op-id", "kv")
    assert out.returncode == 0, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["released"]["tags"] == ["kv_cache"] and o["state"] == "prepared"
    out = ctl.ckptctl("rollback", "o2", "--reason", "drill over", "--json", "--op-id", "rb")
    assert out.returncode == 0, out.stdout + out.stderr
    rb = json.loads(ctl.ckptctl("history", "--op-id", "rb", "--json").stdout)["records"]
    reasons = [r["data"].get("reason", "") for r in rb if r["record_type"] == "transition"]
    assert any("drill over" in r for r in reasons), reasons
    # o1's own default budget (1 byte) fails it; o2 stays PREPARED without all-or-nothing
    out = ctl.ckptctl("prepare", "o1", "o2", "--level", "1", "--no-all-or-nothing", "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    by = {e["engine"]: e for e in json.loads(out.stdout)["engines"]}
    assert by["o1"]["error"]["kind"] == "ResidualOverBudgetError"
    assert by["o1"]["status"] == "rolled_back" and by["o1"]["state"] == "running"
    assert by["o2"]["status"] == "succeeded" and by["o2"]["state"] == "prepared"
    assert ctl.ckptctl("rollback", "o2").returncode == 0
    out = ctl.ckptctl("prepare", "o2", "--level", "2", "--budget", "1", "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["engines"][0]["state"] == "running"
    # the journal: hook records with their output, phases with durations, wall times
    records = json.loads(ctl.ckptctl("history", "--op-id", "kv", "--json").stdout)["records"]
    hooks = [r["data"] for r in records if r["record_type"] == "hook"]
    assert hooks and hooks[0]["point"] == "pre-prepare" and hooks[0]["exit_code"] == 0
    assert hooks[0]["stdout_tail"].strip() == "checked o2"
    phases = [r["data"] for r in records if r["record_type"] == "phase"]
    assert {ph["name"] for ph in phases} >= {"pre-prepare", "prepare"}
    assert all(ph["duration_s"] > 0 for ph in phases)
    assert all(abs(r["written_at_unix"] - time.time()) < 600 for r in records)
    import sqlite3

    db = sqlite3.connect(ctl.state_dir / "journal.sqlite3")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def _on_a_terminal(ctl, *args: str) -> tuple[int, str, str]:
    """Run ``ckptctl`` with stderr on a pseudo-terminal: (exit code, stdout, terminal)."""
    import pty
    import subprocess

    master, slave = pty.openpty()
    proc = subprocess.Popen([*CKPTCTL, "--controller",
                             ctl.endpoint, *args], stdout=subprocess.PIPE, stderr=slave,
                            text=True, cwd=ROOT)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read()
    proc.wait(timeout=scaled(60))
    proc.stdout.close()
    os.close(master)
    return proc.returncode, out, seen.decode(errors="replace")


def test_progress_on_a_terminal_and_none_with_json(spawn_reference, spawn_controller):
    eng = spawn_reference("tty")
    ctl = spawn_controller(engines_toml(eng))
    code, out, terminal = _on_a_terminal(ctl, "cycle", "tty")
    assert code == 0, out + terminal
    for line in ("tty: running -> preparing", "tty: prepare done in", "tty: restore done in",
                 "tty: restoring -> running"):
        assert line in terminal, terminal
    assert "cycle " in out and "succeeded" in out  # the result itself goes to stdout
    code, out, terminal = _on_a_terminal(ctl, "cycle", "tty", "--json")
    assert code == 0 and json.loads(out)["status"] == "succeeded"
    assert terminal.strip() == ""  # scripts get one JSON document and nothing else


def test_conflicts_and_repeated_ids(spawn_reference, spawn_controller):
    eng = spawn_reference("e1")
    ctl = spawn_controller(engines_toml(eng))
    gate = ctl.dir / "let-go"
    # holds the prepare in PREPARING until the test lets it go: however fast or slow the
    # machine, "long" holds the engine while the conflicting requests arrive
    write_hook(ctl, "post-drain", "10-hold", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    done = {}
    with ControllerClient(ctl.endpoint) as first:
        def long_prepare():
            with ControllerClient(ctl.endpoint) as other:
                done["r"] = other.prepare(["e1"], op_id="long", drain="wait", level=1)

        t = threading.Thread(target=long_prepare)
        t.start()
        deadline = deadline_in(10)
        while first.status(["e1"]).engines[0].holder != "long":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(BusyError) as info:
            first.rollback(["e1"], op_id="other")
        assert info.value.details["holder"] == "long"
        out = ctl.ckptctl("restore", "e1", "--json")
        assert out.returncode == 1
        assert json.loads(out.stdout)["error"]["details"]["holder"] == "long"
        gate.touch()
        t.join(scaled(60))
        assert done["r"].status == "succeeded"
        # the same id again: the stored result, not a second prepare
        again = first.prepare(["e1"], op_id="long", drain="wait", level=1)
        assert again == done["r"]
        assert first.restore(["e1"], op_id="back").status == "succeeded"
        hist = first.history(op_id="long", limit=500)
        assert [r.type for r in hist.records].count("operation_start") == 1
        assert len(hist.operations) == 1
    # and after a controller restart, from the journal: still not run again (e1 is RUNNING
    # now; a second prepare would leave it PREPARED)
    ctl.stop()
    ctl = spawn_controller(engines_toml(eng))
    out = ctl.ckptctl("prepare", "e1", "--op-id", "long", "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == json.loads(
        msgspec.json.encode(document("operation", done["r"])))
    with AgentClient(eng.control) as agent:
        assert agent.status().state == "running"
    # the same id for another operation is a mistake, refused before anything runs
    out = ctl.ckptctl("rollback", "e1", "--op-id", "long", "--json")
    assert out.returncode == 2
    err = json.loads(out.stdout)["error"]
    assert err["kind"] == "UsageError" and "already used for a prepare of e1" in err["message"]


def test_group_prepare_is_all_or_nothing(spawn_reference, spawn_controller):
    a, b, c = (spawn_reference(n) for n in ("ga", "gb", "gc"))
    ctl = spawn_controller(engines_toml(a, b)
                           + engine_table(c, extra="[engine.defaults]\nresidual_budget = 1"))
    out = ctl.ckptctl("prepare", "--all", "--json", "--level", "2")
    assert out.returncode == 1
    result = json.loads(out.stdout)
    assert result["status"] == "rolled_back"
    by = {o["engine"]: o for o in result["engines"]}
    assert by["gc"]["error"]["kind"] == "ResidualOverBudgetError"
    for name in ("ga", "gb"):
        assert by[name]["status"] == "rolled_back" and by[name]["state"] == "running"
        assert "gc" in by[name]["error"]["message"]
    for eng in (a, b, c):
        with AgentClient(eng.control) as agent:
            assert agent.status().state == "running"


def test_rolling_cycle_respects_max_unavailable(spawn_reference, spawn_controller):
    engines = [spawn_reference(f"r{i}") for i in range(3)]
    ctl = spawn_controller(engines_toml(*engines))
    out = ctl.ckptctl("cycle", "--all", "--max-unavailable", "1", "--json", "--op-id", "roll")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["max_unavailable_seen"] == 1
    # independent of the controller's own count: out-of-service intervals from the journal
    journal = Journal(ctl.dir / "state" / "journal.sqlite3")
    spans: dict[str, list[float]] = {}
    for rec in journal.records(op_id="roll"):
        if rec.type == "transition" and rec.data["source"] == "running":
            spans[rec.engine] = [rec.monotonic]
        elif rec.type == "transition" and rec.data["dest"] == "running":
            spans[rec.engine].append(rec.monotonic)
    journal.close()
    assert len(spans) == 3 and all(len(s) == 2 for s in spans.values())
    intervals = sorted(spans.values())
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(intervals, intervals[1:]))


def _slow_agents(ipc_dir, names, seconds: float):
    from ckpt_controller.agent import Agent

    return [Agent(n, hooks=_SlowPause(seconds), control=f"ipc://{ipc_dir}/{n}.ctl",
                  heartbeat_interval_s=0.2).start() for n in names]


def _out_of_service(ctl, op_id: str) -> dict[str, list[float]]:
    """Engine -> [left RUNNING, back to RUNNING] (monotonic), from the journal's records."""
    journal = Journal(ctl.dir / "state" / "journal.sqlite3")
    spans: dict[str, list[float]] = {}
    for rec in journal.records(op_id=op_id):
        if rec.type == "transition" and rec.data["source"] == "running":
            spans[rec.engine] = [rec.monotonic]
        elif rec.type == "transition" and rec.data["dest"] == "running":
            spans[rec.engine].append(rec.monotonic)
    journal.close()
    return spans


def test_rolling_cycle_with_two_out_at_a_time(spawn_controller, ipc_dir):
    agents = _slow_agents(ipc_dir, [f"roll{i}" for i in range(5)], 0.4)
    try:
        ctl = spawn_controller(engines_toml(*agents))
        out = ctl.ckptctl("cycle", "--all", "--max-unavailable", "2", "--json", "--op-id", "r2")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["max_unavailable_seen"] == 2
        assert [o["status"] for o in result["engines"]] == ["succeeded"] * 5
        spans = _out_of_service(ctl, "r2")
        assert len(spans) == 5 and all(len(s) == 2 for s in spans.values())
        # at every moment one of them left RUNNING, at most two were out (journal's own times)
        for t in [s[0] for s in spans.values()]:
            assert sum(a <= t < b for a, b in spans.values()) <= 2
    finally:
        for a in agents:
            a.close()


def test_a_cycle_rolls_a_quarter_at_a_time_unless_told(spawn_controller, ipc_dir):
    """No limit named: a cycle of 8 takes out 25% (2) at once, never all 8; a percentage is
    of the engines named, rounded down, at least one; 100% is all at once. The CLI and the
    client say it the same way."""
    agents = _slow_agents(ipc_dir, [f"q{i}" for i in range(8)], 0.3)
    try:
        ctl = spawn_controller(engines_toml(*agents))

        def peak(op_id: str) -> int:  # from the journal's own times, not the result's count
            spans = _out_of_service(ctl, op_id)
            assert len(spans) == 8 and all(len(s) == 2 for s in spans.values())
            return max(sum(a <= t < b for a, b in spans.values())
                       for t in [s[0] for s in spans.values()])

        out = ctl.ckptctl("cycle", "--all", "--json", "--op-id", "q-default")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["max_unavailable_seen"] == 2
        assert peak("q-default") == 2
        with ControllerClient(ctl.endpoint, timeout_s=120) as c:
            half = c.cycle(all_engines=True, max_unavailable="50%", op_id="q-half")
            assert half.status == "succeeded" and half.max_unavailable_seen == 4, half
            few = c.cycle(["q0", "q1", "q2"], max_unavailable="10%", op_id="q-few")
            assert few.max_unavailable_seen == 1  # 10% of 3, at least one
        assert peak("q-half") == 4
        out = ctl.ckptctl("cycle", "--all", "--max-unavailable", "100%", "--json",
                          "--op-id", "q-all")
        assert json.loads(out.stdout)["max_unavailable_seen"] == 8
        for bad in ("0%", "101%", "0", "x", "1.5"):
            out = ctl.ckptctl("cycle", "--all", "--max-unavailable", bad)
            assert out.returncode == 2 and "--max-unavailable" in out.stderr, out.stderr
        assert "default: 25%" in " ".join(ctl.ckptctl("cycle", "--help").stdout.split())
    finally:
        for a in agents:
            a.close()


def test_rolling_cycle_gives_each_engine_its_own_deadline(spawn_controller, ipc_dir):
    """--deadline bounds each engine from its turn, not from the operation's start: four
    cycles of about 0.6 s one after another, each within a 1.5 s deadline, all succeed."""
    agents = _slow_agents(ipc_dir, ["dl0", "dl1", "dl2", "dl3"], 0.6)
    try:
        ctl = spawn_controller(engines_toml(*agents))
        out = ctl.ckptctl("cycle", "--all", "--max-unavailable", "1", "--deadline", "1.5",
                          "--json")
        result = json.loads(out.stdout)
        assert out.returncode == 0, result
        assert [o["status"] for o in result["engines"]] == ["succeeded"] * 4
        assert result["duration_s"] > 2.4  # the operation as a whole outlasted 1.5 s
    finally:
        for a in agents:
            a.close()


def test_rolling_cycle_stops_at_its_first_failure(spawn_controller, ipc_dir):
    agents = _slow_agents(ipc_dir, ["st0", "st1", "st2"], 0.0)
    try:
        ctl = spawn_controller(engines_toml(*agents))
        write_hook(ctl, "pre-prepare", "10-veto", '[ "$CKPT_ENGINE" = st1 ] && exit 7; exit 0')
        out = ctl.ckptctl("cycle", "--all", "--max-unavailable", "1", "--json")
        assert out.returncode == 1
        result = json.loads(out.stdout)
        by = {o["engine"]: o for o in result["engines"]}
        assert by["st0"]["status"] == "succeeded" and by["st0"]["state"] == "running"
        assert by["st1"]["status"] == "failed" and by["st1"]["state"] == "running"
        assert by["st1"]["error"]["details"]["exit_code"] == 7
        assert by["st2"]["status"] == "skipped"  # never touched: still serving
        with AgentClient(agents[2].endpoint) as c:
            assert c.status().state == "running" and c.status().generation == 0
    finally:
        for a in agents:
            a.close()


def test_bad_config_and_unreachable_engine(spawn_controller, ipc_dir):
    bad = ipc_dir / "bad.toml"
    bad.write_text('[deadlines]\ndrain = -1\n')
    out = ckptctl("serve", "--config", str(bad))
    assert out.returncode == 2
    assert "deadlines.drain" in out.stderr and str(bad) in out.stderr
    ctl = spawn_controller(engines_toml(("ghost", f"ipc://{ipc_dir}/none")))
    start = time.monotonic()
    out = ctl.ckptctl("prepare", "ghost", "--json")
    assert out.returncode == 4 and time.monotonic() - start < scaled(30)
    # refused before the operation existed (preflight): the error is the whole answer
    error = json.loads(out.stdout)["error"]
    assert error["kind"] == "UnreachableError" and error["details"]["engine"] == "ghost"
    # the message says which engine and which endpoint did not answer
    assert error["message"].startswith("ghost did not answer")
    assert f"ipc://{ipc_dir}/none" in error["message"]
    out = ctl.ckptctl("prepare", "nobody")
    assert out.returncode == 2 and "unknown engine 'nobody'" in out.stderr
    out = ctl.ckptctl("status")
    assert out.returncode == 4 and "ghost: UNREACHABLE" in out.stdout
    out = ckptctl("--controller", f"ipc://{ipc_dir}/nothing.sock", "status")
    assert out.returncode == 4 and "UnreachableError" in out.stderr


def _wait_in_flight(control: str, n: int) -> None:
    """Wait until the engine has admitted ``n`` requests (instead of sleeping a while)."""
    with AgentClient(control) as agent:
        wait_until(lambda: agent.status().in_flight == n, 20, f"{n} requests in flight")


def _kill_mid(ctl, control: str, state: str, *op: str) -> None:
    """Run ``ckptctl *op``, kill -9 the controller once the engine is in ``state``, restart
    it, and check it recovered the one interrupted operation."""
    t = threading.Thread(target=lambda: ctl.ckptctl(*op))
    t.start()
    wait_state(control, state)
    ctl.kill9()
    t.join(scaled(60))
    ctl.start()
    assert ctl.info["recovered"] == 1


def test_controller_killed_mid_preparing_recovers_to_running(spawn_engine, spawn_controller):
    # a step engine: its request (600 steps of 10 ms) holds the wait drain in PREPARING for
    # seconds on any machine, long enough to be seen there and killed
    eng = spawn_engine("k1")
    ctl = spawn_controller(engines_toml(eng))
    eng.submit("long", steps=600)
    _wait_in_flight(eng.control, 1)
    _kill_mid(ctl, eng.control, "preparing", "prepare", "k1", "--drain", "wait",
              "--op-id", "cut")
    with AgentClient(eng.control) as agent:
        assert agent.status().state == "running"
    assert eng.collect(["long"], timeout_s=60)["long"]["reason"] == "length"
    journal = Journal(ctl.dir / "state" / "journal.sqlite3")
    assert journal.check() == [] and journal.unfinished() == []
    result = journal.result("cut")
    assert result.status == "interrupted" and result.engines[0].state == "running"
    journal.close()


def test_controller_killed_mid_restoring_recovers(spawn_reference, spawn_controller):
    eng = spawn_reference("k2", "--model", "small", "--kv-blocks", "256")
    ctl = spawn_controller(engines_toml(eng, defaults="level = 2"))
    assert ctl.ckptctl("prepare", "k2").returncode == 0
    _kill_mid(ctl, eng.control, "restoring", "restore", "k2", "--op-id", "cut2")
    with AgentClient(eng.control) as agent:
        assert agent.status().state == "running"
    journal = Journal(ctl.dir / "state" / "journal.sqlite3")
    assert journal.check() == []
    assert journal.result("cut2").status == "interrupted"
    journal.close()
    with EngineClient(eng.api) as api:
        assert api.generate([1, 2], 4).finish_reason == "length"


def test_metrics_endpoint(spawn_engine, spawn_controller):
    # a step engine: its requests (600 steps of 10 ms) are surely in flight at the prepare
    eng = spawn_engine("m1")
    ctl = spawn_controller("metrics_port = 0\n" + engines_toml(eng))
    ctl_conf = ctl.config.read_text()
    assert "metrics_port" in ctl_conf
    ids = [f"r{i}" for i in range(3)]
    for rid in ids:
        eng.submit(rid, steps=600)
    _wait_in_flight(eng.control, 3)
    out = ctl.ckptctl("cycle", "m1", "--drain", "abort", "--json")
    assert out.returncode == 0, out.stderr
    ends = eng.collect(ids, timeout_s=30)
    assert [ends[i]["reason"] for i in ids] == ["abort"] * 3
    (o,) = json.loads(out.stdout)["engines"]
    port = ctl.info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    assert got[("ckpt_operations_total", (("kind", "cycle"), ("outcome", "succeeded")))] == 1
    assert got[("ckpt_transitions_total",
                (("dest", "preparing"), ("engine", "m1"), ("source", "running")))] == 1
    assert got[("ckpt_phase_duration_seconds_count", (("engine", "m1"), ("phase", "prepare")))] == 1
    # the drain and memory counters carry what the operation's own reports said
    assert o["drain"]["aborted"] == 3
    assert got[("ckpt_drained_requests_total", (("outcome", "aborted"),))] == 3
    assert got[("ckpt_drained_requests_total", (("outcome", "kept"),))] == 0
    assert o["released"]["freed_bytes"] > 0
    assert got[("ckpt_freed_bytes_total", ())] == o["released"]["freed_bytes"]


def test_journal_is_private(spawn_reference, spawn_controller):
    eng = spawn_reference("p1")
    ctl = spawn_controller(engines_toml(eng))
    assert ctl.ckptctl("status").returncode == 0
    st = os.stat(ctl.dir / "state")
    assert stat.S_IMODE(st.st_mode) == 0o700


def test_hooks_veto_and_roll_back(spawn_reference, spawn_controller):
    eng = spawn_reference("h1")
    ctl = spawn_controller(engines_toml(eng))
    write_hook(ctl, "pre-prepare", "10-no",
               'echo "not today: $CKPT_ENGINE $CKPT_ACTION" >&2; exit 3')
    out = ctl.ckptctl("prepare", "h1", "--json")
    assert out.returncode == 1
    (o,) = json.loads(out.stdout)["engines"]
    assert o["state"] == "running" and o["error"]["details"]["exit_code"] == 3
    assert o["hooks"][0]["stderr_tail"].strip() == "not today: h1 pre-prepare"
    (ctl.dir / "hooks" / "pre-prepare" / "10-no").unlink()
    write_hook(ctl, "dump", "10-dump", 'echo "$CRTOOLS_SCRIPT_ACTION $CRTOOLS_INIT_PID" > '
                                  '"$CKPT_IMAGE_DIR/seen"; exit 1')
    out = ctl.ckptctl("cycle", "h1", "--json")
    assert out.returncode == 1
    (o,) = json.loads(out.stdout)["engines"]
    assert o["status"] == "rolled_back" and o["state"] == "running"
    seen = list((ctl.dir / "state" / "images" / "h1").glob("*/seen"))
    assert seen and seen[0].read_text().split() == ["pre-dump", str(eng.pid)]
    write_hook(ctl, "dump", "10-dump", "sleep 30")
    (ctl.dir / "hooks" / "dump" / "10-dump").chmod(0o775)  # group-writable: refused
    out = ctl.ckptctl("cycle", "h1", "--json")
    (o,) = json.loads(out.stdout)["engines"]
    assert o["error"]["kind"] == "ConfigError" and "writable" in o["error"]["message"]
    assert o["state"] == "running"


def test_demo_runs_end_to_end():
    """The demo: a timeline of phases with durations, a real CRIU dump when CRIU is here (or
    the reason there was none), every request accounted for, and nothing left behind."""
    import re

    out = ckptctl("demo", "--duration", "3", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "demo passed" in text and "lost 0" in text
    assert "running -> preparing" in text and "restoring -> running" in text
    timeline = text.split("timeline:", 1)[1]
    for phase in ("prepare", "capture", "restore"):
        assert re.search(rf"\+\s+[\d.]+ ms\s+{phase}\s+[\d.]+ ms", timeline), phase
    criu = ROOT / ".cache" / "criu" / "bin" / "criu"
    if criu.exists() and os.geteuid() == 0:
        assert re.search(r"capture: criu-dump: dumped pid \d+ .*: \d+ bytes", text), text
    else:
        assert "(capture ran no dump hook:" in text
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", text)]
    assert len(pids) == 2  # the engine and the controller, both stopped
    wait_until(lambda: all(_gone(p) for p in pids), 5, f"processes {pids} gone")
    tmp = re.search(r"ipc://(/\S*ckpt-demo-[^/]+)/", text).group(1)
    assert not os.path.exists(tmp)  # the temporary directory is gone


def test_deadline_is_a_failure_with_exit_3(spawn_engine, spawn_controller):
    # a step engine: its request takes 600 steps of 10 ms whatever the machine's speed, so the
    # wait drain surely outlasts the 0.5 s deadline
    eng = spawn_engine("d1")
    ctl = spawn_controller(engines_toml(eng))
    eng.submit("long", steps=600)
    _wait_in_flight(eng.control, 1)
    out = ctl.ckptctl("prepare", "d1", "--drain", "wait", "--deadline", "0.5", "--json")
    assert out.returncode == 3, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["error"]["kind"] == "DeadlineError" and o["state"] == "running"
    assert o["status"] == "rolled_back"
    # the deadline did not abort the request: it runs to its end
    assert eng.collect(["long"], timeout_s=60)["long"]["reason"] == "length"


def test_the_capture_deadline_bounds_the_dump_hooks_together(spawn_reference, spawn_controller):
    """``[deadlines] capture`` bounds the dump hooks together (each alone is within the
    60 s ``hook`` limit here): a capture that runs over it rolls back with exit 3."""
    eng = spawn_reference("cap")
    ctl = spawn_controller(engines_toml(eng) + "[deadlines]\ncapture = 2.0\nhook = 60\n")
    write_hook(ctl, "dump", "10-first", "sleep 1")
    write_hook(ctl, "dump", "20-second", "sleep 30")
    start = time.monotonic()
    out = ctl.ckptctl("cycle", "cap", "--json")
    assert time.monotonic() - start < scaled(15, below=30)  # not the 30 s hook's end
    assert out.returncode == 3, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["error"]["kind"] == "HookTimeoutError" and o["status"] == "rolled_back"
    assert o["state"] == "running"
    runs = {h["path"].rsplit("/", 1)[-1]: h for h in o["hooks"]}
    assert runs["10-first"]["exit_code"] == 0 and not runs["10-first"]["timed_out"]
    assert runs["20-second"]["timed_out"]  # it had what the first left of the 2 s
    assert runs["20-second"]["duration_s"] < 2.0


def test_release_and_restore_deadlines(spawn_reference, spawn_controller):
    """A release over its deadline rolls the prepare back (exit 3, RUNNING); a re-wake over
    the restore deadline leaves the engine FAILED (exit 3), never serving unchecked, and a
    recovery restore with time enough brings it back. The tiny model: its re-wake (a reload
    from its file at level 2) ends well within the controller's wait beyond the deadline, so
    the agent's own deadline check, not the controller's patience, decides, on a busy
    machine too."""
    eng = spawn_reference("rel")
    ctl = spawn_controller(engines_toml(eng, defaults="level = 2")
                           + "[deadlines]\nrelease = 0.001\n")
    out = ctl.ckptctl("prepare", "rel", "--json")
    assert out.returncode == 3, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["error"]["kind"] == "DeadlineError" and o["status"] == "rolled_back"
    assert o["state"] == "running"
    ctl.stop()
    ctl = spawn_controller(engines_toml(eng, defaults="level = 2")
                           + "[deadlines]\nrestore = 0.001\n")
    assert ctl.ckptctl("prepare", "rel").returncode == 0
    out = ctl.ckptctl("restore", "rel", "--json")
    assert out.returncode == 3, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["error"]["kind"] == "DeadlineError" and o["state"] == "failed"
    with EngineClient(eng.api) as api, pytest.raises(RejectedError):
        api.generate([1, 2], 3)
    ctl.stop()
    ctl = spawn_controller(engines_toml(eng))
    assert ctl.ckptctl("restore", "rel").returncode == 0
    with EngineClient(eng.api) as api:
        assert api.generate([1, 2], 3).finish_reason == "length"


def test_engine_death_fails_the_operation_promptly(spawn_engine, spawn_controller):
    # a step engine: its request (100,000 steps of 10 ms) holds the wait drain in PREPARING
    # until the kill on any machine; the reference model's longest request (its 1,024-token
    # limit, a second or two) could end before a busy machine's ckptctl had started, and the
    # drain then passed PREPARING too fast to be seen there
    eng = spawn_engine("dead")
    ctl = spawn_controller(engines_toml(eng))
    eng.submit("forever", steps=100_000)
    _wait_in_flight(eng.control, 1)
    box = {}
    t = threading.Thread(target=lambda: box.update(out=ctl.ckptctl(
        "prepare", "dead", "--drain", "wait", "--deadline", "300", "--json")))
    t.start()
    wait_state(eng.control, "preparing")
    killed = time.monotonic()
    eng.proc.kill()
    t.join(scaled(60))
    assert time.monotonic() - killed < scaled(20, below=300)  # heartbeats, not the deadline
    out = box["out"]
    assert out.returncode == 4
    (o,) = json.loads(out.stdout)["engines"]
    assert o["error"]["kind"] == "UnreachableError" and o["status"] == "failed"
    assert "no heartbeat" in o["error"]["message"] and eng.control in o["error"]["message"]
    assert o["error"]["details"]["silent_s"] < scaled(20, below=300)


def test_watch_shows_an_operation_live(spawn_reference, spawn_controller):
    import signal
    import subprocess

    eng = spawn_reference("w1")
    ctl = spawn_controller(engines_toml(eng))
    before = ipc_connections(ctl.pid, ctl.endpoint)
    watch = subprocess.Popen([*CKPTCTL, "--controller",
                              ctl.endpoint, "watch", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed = StreamedLines(watch.stdout)
    try:
        wait_connected(ctl.pid, ctl.endpoint, before)  # watch is there and subscribing
        assert ctl.ckptctl("cycle", "w1", "--op-id", "seen").returncode == 0
        # printed as it happened, up to the operation's end, while watch still runs
        wait_until(lambda: any('"operation_end"' in line for line in list(printed.lines)), 20,
                   "the operation's end printed")
        assert watch.poll() is None
    finally:
        watch.send_signal(signal.SIGINT)
        watch.communicate(timeout=scaled(30))
    records = [json.loads(line) for line in printed.join()]
    assert {r["op_id"] for r in records} == {"seen"}
    dests = [r["data"]["dest"] for r in records if r["record_type"] == "transition"]
    assert dests == ["preparing", "prepared", "restoring", "running"]
    seqs = [r["seq"] for r in records]
    assert seqs == sorted(seqs)


class _SlowPause(EngineHooks):
    """Agent hooks whose pause takes a fixed time: a stand-in for a slow release."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def pause_scheduling(self) -> None:
        time.sleep(self.seconds)


class _PauseTogether(EngineHooks):
    """Agent hooks whose pause ends only once every agent sharing ``together`` is in its
    pause: a stand-in for slow releases that shows they ran at once, with no timing."""

    def __init__(self, together: threading.Barrier) -> None:
        self.together = together

    def pause_scheduling(self) -> None:
        self.together.wait()  # broken (an error: the prepare fails) if they came one by one


def test_group_prepare_fans_out_concurrently(spawn_controller, ipc_dir):
    """20 agents whose pause waits for all 20 to be pausing: the group prepare succeeds only
    when the controller drives them all at once (one by one, the first would wait alone)."""
    from ckpt_controller.agent import Agent

    all_pausing = threading.Barrier(20, timeout=60)
    agents = [Agent(f"fan{i}", hooks=_PauseTogether(all_pausing),
                    control=f"ipc://{ipc_dir}/fan{i}.ctl", heartbeat_interval_s=0.2).start()
              for i in range(20)]
    try:
        ctl = spawn_controller(engines_toml(*agents))
        with ControllerClient(ctl.endpoint, timeout_s=120) as c:
            group = c.prepare(all_engines=True, level=0)
            assert group.status == "succeeded", group
            c.rollback(all_engines=True)
        assert len(group.engines) == 20 and not all_pausing.broken
    finally:
        all_pausing.abort()  # nobody waits on it after the test
        for a in agents:
            a.close()


def test_hook_failures_of_every_kind(spawn_reference, spawn_controller):
    eng = spawn_reference("hk")
    ctl = spawn_controller("[deadlines]\nhook = 0.5\n" + engines_toml(eng))
    folder = ctl.dir / "hooks" / "dump"
    folder.mkdir(parents=True)
    (folder / "10-no-shebang").write_text("echo hi\n")
    (folder / "10-no-shebang").chmod(0o755)
    out = ctl.ckptctl("cycle", "hk", "--json")
    (o,) = json.loads(out.stdout)["engines"]
    assert out.returncode == 1 and o["status"] == "rolled_back" and o["state"] == "running"
    assert o["hooks"][0]["exit_code"] == 127
    (folder / "10-no-shebang").unlink()
    write_hook(ctl, "dump", "20-slow", "sleep 30")
    start = time.monotonic()
    out = ctl.ckptctl("cycle", "hk", "--json")
    # a hook timeout is a deadline: not the hook's 30 s
    assert out.returncode == 3 and time.monotonic() - start < scaled(20, below=30)
    (o,) = json.loads(out.stdout)["engines"]
    assert o["error"]["kind"] == "HookTimeoutError" and o["state"] == "running"
    assert o["hooks"][0]["timed_out"]
    # restore of a RUNNING engine runs no hook and fails nothing
    write_hook(ctl, "pre-restore", "10-fail", "exit 1")
    out = ctl.ckptctl("restore", "hk", "--json")
    error = json.loads(out.stdout)["error"]  # refused before it began: no hook ran
    assert out.returncode == 2 and error["details"]["state"] == "running"
    with ControllerClient(ctl.endpoint) as c:
        from ckpt_controller.errors import UsageError

        with pytest.raises(UsageError):
            c.history(limit=2**62)
        assert c.status().engines[0].status.state == "running"


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan waits for its new parent to reap it,
    and in a PID namespace that parent may never do so)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_controller_killed_during_capture_stops_the_orphanwrite_hook(spawn_reference,
                                                                 spawn_controller):
    eng = spawn_reference("cap")
    ctl = spawn_controller(engines_toml(eng))
    write_hook(ctl, "dump", "10-long", 'echo $$ > "$CKPT_IMAGE_DIR/../hook.pid"; sleep 300')
    t = threading.Thread(target=lambda: ctl.ckptctl("cycle", "cap", "--op-id", "cut3"))
    t.start()
    pidfile = ctl.dir / "state" / "images" / "cap" / "hook.pid"
    deadline = deadline_in(30)
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    hook_pid = int(pidfile.read_text())
    ctl.kill9()
    t.join(scaled(60))
    ctl.start()
    assert ctl.info["recovered"] == 1
    assert _gone(hook_pid)  # recovery stopped the dump left running
    with AgentClient(eng.control) as agent:
        assert agent.status().state == "running"
    journal = Journal(ctl.dir / "state" / "journal.sqlite3")
    assert journal.check() == [] and journal.result("cut3").status == "interrupted"
    journal.close()


def test_hooks_inside_preparing_and_restoring(spawn_reference, spawn_controller):
    eng = spawn_reference("in")
    ctl = spawn_controller(engines_toml(eng, defaults="level = 2"))
    log = ctl.dir / "hooks.log"
    for point in ("post-drain", "post-release", "post-restore"):
        write_hook(ctl, point, "10-note", f'echo "$CKPT_ACTION $CKPT_STATE" >> {log}')
    out = ctl.ckptctl("cycle", "in", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert [p["name"] for p in o["phases"]] == [
        "drain", "post-drain", "release", "post-release", "seal", "capture",
        "rewake", "post-restore", "resume"]
    assert log.read_text().split("\n")[:3] == ["post-drain preparing", "post-release preparing",
                                               "post-restore restoring"]
    assert o["released"]["tensor_bytes"] > 0 and o["rewoken"]["verified_tensors"] > 0
    write_hook(ctl, "post-release", "20-veto", "exit 4")
    out = ctl.ckptctl("prepare", "in", "--json")
    (o,) = json.loads(out.stdout)["engines"]
    assert out.returncode == 1 and o["status"] == "rolled_back" and o["state"] == "running"
    (ctl.dir / "hooks" / "post-release" / "20-veto").unlink()
    write_hook(ctl, "post-restore", "20-veto", "exit 5")
    out = ctl.ckptctl("cycle", "in", "--json")
    (o,) = json.loads(out.stdout)["engines"]
    assert out.returncode == 1 and o["state"] == "failed"
    with AgentClient(eng.control) as agent:
        assert agent.status().state == "failed"
    (ctl.dir / "hooks" / "post-restore" / "20-veto").unlink()
    assert ctl.ckptctl("restore", "in").returncode == 0  # recovery from FAILED


# point -> (state the engine ends in, operation status) after a cycle whose hook at that point
# fails; on-fail needs a failure to run, so a failing post-restore hook comes with it
HOOK_EFFECTS = {
    "pre-prepare": ("running", "failed"),
    "post-drain": ("running", "rolled_back"),
    "post-release": ("running", "rolled_back"),
    "dump": ("running", "rolled_back"),
    "post-dump": ("running", "rolled_back"),
    "pre-restore": ("failed", "failed"),
    "post-restore": ("failed", "failed"),
    "post-resume": ("running", "succeeded"),
    "on-fail": ("failed", "failed"),
}


@pytest.mark.parametrize("how", ["fails", "hangs"])
def test_every_hook_point_has_its_documented_effect(spawn_reference, spawn_controller, how):
    from ckpt_controller.controller.hooks import POINTS

    assert set(HOOK_EFFECTS) == set(POINTS)
    eng = spawn_reference(f"pt-{how}")
    ctl = spawn_controller("[deadlines]\nhook = 0.4\n" + engines_toml(eng))
    body = "exit 7" if how == "fails" else "sleep 30"
    for point, (state, status) in HOOK_EFFECTS.items():
        write_hook(ctl, point, "50-bad", body)
        if point == "on-fail":
            write_hook(ctl, "post-restore", "50-bad", "exit 7")
        out = ctl.ckptctl("cycle", eng.name, "--json")
        (o,) = json.loads(out.stdout)["engines"]
        assert (o["state"], json.loads(out.stdout)["status"]) == (state, status), point
        bad = [h for h in o["hooks"] if h["point"] == point]
        assert bad and (bad[0]["timed_out"] if how == "hangs" else bad[0]["exit_code"] == 7)
        if status != "succeeded":
            kind = o["error"]["kind"]
            assert out.returncode == (3 if how == "hangs" and point != "on-fail" else 1), point
            # on-fail's own failure is only logged: the error is the post-restore one
            hung = how == "hangs" and point != "on-fail"
            assert kind == ("HookTimeoutError" if hung else "HookError"), point
        for folder in ("hooks/" + point, "hooks/post-restore"):
            for f in (ctl.dir / folder).glob("50-bad"):
                f.unlink()
        if o["state"] == "failed":
            assert ctl.ckptctl("restore", eng.name).returncode == 0  # recovery from FAILED


def test_a_failed_capture_that_cannot_be_undone_leaves_the_engine_failed(spawn_reference,
                                                                          spawn_controller):
    eng = spawn_reference("undo")
    ctl = spawn_controller(engines_toml(eng))
    write_hook(ctl, "dump", "10-dump", "echo dump broke >&2; exit 1")
    write_hook(ctl, "pre-restore", "10-give-back",
          '[ "$CKPT_UNDO_CAPTURE" = 1 ] && { echo "cannot give the GPU back" >&2; exit 9; }\n'
          'exit 0')
    out = ctl.ckptctl("cycle", "undo", "--json")
    assert out.returncode == 1
    (o,) = json.loads(out.stdout)["engines"]
    assert o["status"] == "failed" and o["state"] == "failed"
    assert o["error"]["kind"] == "HookError" and o["error"]["details"]["point"] == "dump"
    assert "exited 9" in o["error"]["details"]["undo_error"]
    assert [h["point"] for h in o["hooks"]] == ["dump", "pre-restore"]
    with AgentClient(eng.control) as agent:
        st = agent.status()
    assert st.state == "failed" and "could not undo" in st.last_transition.reason
    (ctl.dir / "hooks" / "dump" / "10-dump").unlink()
    assert ctl.ckptctl("restore", "undo").returncode == 0  # recovery once the hook is fixed


def test_a_dump_that_kills_the_engine_fails_instead_of_rolling_back(spawn_reference,
                                                                    spawn_controller):
    eng = spawn_reference("killed")
    ctl = spawn_controller("missed_beats = 5\n"
                           + engines_toml(eng))
    write_hook(ctl, "dump", "10-dump", 'kill -9 "$CKPT_ENGINE_PID"; exit 1')
    out = ctl.ckptctl("cycle", "killed", "--json")
    assert out.returncode in (1, 4)
    (o,) = json.loads(out.stdout)["engines"]
    assert o["status"] == "failed" and o["state"] != "running"
    assert not any(p["name"] == "rollback" for p in o["phases"])  # nothing left to roll back
    eng.proc.wait(timeout=scaled(10))
    status = json.loads(ctl.ckptctl("status", "killed", "--json").stdout)
    assert status["engines"][0]["reachable"] is False


def test_hook_owned_by_another_user_is_refused(spawn_reference, spawn_controller):
    import pwd

    if os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    eng = spawn_reference("own")
    ctl = spawn_controller(engines_toml(eng))
    write_hook(ctl, "pre-prepare", "10-theirs", "exit 0")
    nobody = pwd.getpwnam("nobody")
    os.chown(ctl.dir / "hooks" / "pre-prepare" / "10-theirs", nobody.pw_uid, nobody.pw_gid)
    out = ctl.ckptctl("prepare", "own", "--json")
    (o,) = json.loads(out.stdout)["engines"]
    assert out.returncode == 2 and o["error"]["kind"] == "ConfigError"
    assert "owned by another user" in o["error"]["message"] and o["state"] == "running"


def test_the_operations_drain_timeout_reaches_the_agent(spawn_engine, spawn_controller):
    # --drain-timeout overrides the configured [deadlines] drain (30 s): the wait drain
    # escalates to abort after it instead of waiting the requests out. A step engine: each
    # request takes 600 steps of 10 ms whatever the machine's speed, so none can end before
    # the drain has begun (a reference engine's could, on a busy machine)
    eng = spawn_engine("dt")
    ctl = spawn_controller(engines_toml(eng))
    ids = [f"r{i}" for i in range(4)]
    for rid in ids:
        eng.submit(rid, steps=600)
    _wait_in_flight(eng.control, 4)
    out = ctl.ckptctl("prepare", "dt", "--drain", "wait", "--drain-timeout", "0.05",
                      "--on-deadline", "abort", "--level", "0", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    (e,) = json.loads(out.stdout)["engines"]
    assert e["drain"]["escalated_to"] == "abort" and e["drain"]["aborted"] >= 1
    ends = eng.collect(ids, timeout_s=30)  # every request ended
    assert "abort" in {end["reason"] for end in ends.values()}
    assert ctl.ckptctl("restore", "dt").returncode == 0


def test_a_transition_whose_event_was_lost_is_journaled_from_the_reply(tmp_path):
    # events can be lost (a connection reopened while the agent publishes); the operation's
    # reply lists its transitions, and the session journals each one exactly once
    from ckpt_controller import protocol as p
    from ckpt_controller.controller.config import parse_config
    from ckpt_controller.controller.session import EngineSession

    cfg = parse_config(engines_toml(("x", f"ipc://{tmp_path}/none")))
    records = []
    session = EngineSession(cfg, "x", "op1", cfg.prepare_defaults("x"), 60,
                            lambda type_, data, **kw: records.append((type_, data["dest"])))
    try:
        first = p.TransitionRecord(trigger="prepare", source="running", dest="preparing",
                                   generation=0, monotonic=1.0, wall=10.0)
        second = p.TransitionRecord(trigger="seal", source="preparing", dest="prepared",
                                    generation=0, monotonic=2.0, wall=11.0)
        session._on_agent_event(p.StateChanged(engine="x", transition=first, op_id="op1"))
        # the StateChanged of the second one never arrived; the reply lists both
        session._on_agent_reply(p.PrepareReply(op_id="op1", state="prepared",
                                               drain=p.DrainReport(mode="wait"),
                                               memory=p.MemoryReport(action="release"),
                                               duration_s=1.0, transitions=[first, second]))
    finally:
        session.close()
    assert records == [("transition", "preparing"), ("transition", "prepared")]
    assert session.outcome.state == "prepared"


@pytest.mark.parametrize("op, point, held_in, policy, want", [
    ("prepare", "post-drain", "preparing", "resume", "running"),
    ("prepare", "post-drain", "preparing", "leave", "failed"),
    # a capture may have begun (its dump hook was running): never resumed blindly
    ("cycle", "dump", "prepared", "resume", "failed"),
])
def test_an_engine_found_failed_after_a_restart_is_resumed_if_never_captured(
        spawn_reference, spawn_controller, op, point, held_in, policy, want):
    """The controller and the engine's agent both went down in the middle of an operation,
    and the agent came back FAILED (as a restarted vLLM sidecar does when it finds vLLM
    paused). Where the journal shows the operation never began a capture, the restarted
    controller restores the engine by itself under ``recover_uncaptured = "resume"``, and
    leaves it under "leave"; where a capture may have begun, it leaves it FAILED."""
    eng = spawn_reference("uc")
    ctl = spawn_controller(f'recover_uncaptured = "{policy}"\n' + engines_toml(eng))
    gate, held = ctl.dir / "let-go", ctl.dir / "held"
    write_hook(ctl, point, "10-hold", f"touch {held}; while [ ! -e {gate} ]; do sleep 0.05; done")
    t = threading.Thread(target=lambda: ctl.ckptctl(op, "uc", "--op-id", "cut"))
    t.start()
    wait_state(eng.control, held_in)
    wait_until(held.exists, 30, "the hook running")
    ctl.kill9()
    t.join(scaled(60))
    with AgentClient(eng.control) as agent:
        agent.fail(reason="came back and found the engine paused")
        assert agent.status().state == "failed"
    gate.touch()
    ctl.start()
    assert ctl.info["recovered"] == 1
    with AgentClient(eng.control) as agent:
        assert agent.status().state == want
    journal = Journal(ctl.dir / "state" / "journal.sqlite3")
    assert journal.result("cut").engines[0].state == want
    journal.close()
