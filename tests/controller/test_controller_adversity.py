"""The controller tried as an adversary and an operator would: starts that race, restarts,
odd names. Real ``ckptctl serve`` processes where a process is what is tried.

- A controller holds its ``ipc://`` endpoint from the moment it claims its state directory,
  not only once it binds: while it still recovers interrupted operations (the socket is not
  bound yet), a second controller of another state directory on the same endpoint is refused
  instead of binding the socket the first then takes from it.
- A long-lived journal (10,000 operations, 30,000 records of 2 KB): ``history --limit 10000``
  is answered with what fits in a message (the newest records), not lost to the wire's 16 MiB
  limit and reported as an unreachable controller; and while such large queries run, the
  control thread, which reads the journal for every operation request, still answers within
  about a second (a long read does not hold up the short ones). Operations on hundreds of
  engines each are bounded the same way: the newest that fit.
- A restarted controller carries the last good cycle's time and the image size over from its
  journal, so those gauges do not go blank.
- Connections to the metrics port that never send a request hold no thread each for ever.
- A controller whose TCP endpoint or metrics port is taken exits 2 before it touches an
  engine (it recovered, rolling engines back, and only then found the port taken).
- A journal result that cannot be decoded costs a gauge, not the controller's start.
- Threads sending through a full outbox each wait their own timeout, not each other's.

Neighbours: ``test_serve_start`` (one controller per state directory, stale sockets),
``conftest`` (``ipc_dir``).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckpt_controller import protocol as p

from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.controller.config import load_config
from ckpt_controller.controller.journal import Journal
from ckpt_controller.controller.server import ControllerServer
from support import ROOT
from support.cli import CKPTCTL, ckptctl
from support.config import engines_toml
from support.hooks import write_hook
from support.timing import deadline_in, scaled, wait_until


def _config(folder: Path, name: str, endpoint: str) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(f'[controller]\nendpoint = "{endpoint}"\n'
                    f'state_dir = "{folder / f"{name}-state"}"\n')
    return path


def test_an_endpoint_is_held_from_the_claim_not_only_from_the_bind(ipc_dir):
    """The first controller has claimed its state directory and endpoint but not bound yet
    (``serve`` recovers interrupted operations in between, which can take as long as an
    operation): a second one of another state directory on the same endpoint exits 2
    naming ``controller.endpoint`` and the first's PID, and the first then binds and serves,
    alone."""
    endpoint = f"ipc://{ipc_dir}/ctl.sock"
    first = ControllerServer(load_config(_config(ipc_dir, "first", endpoint)))
    try:
        second = subprocess.Popen([*CKPTCTL, "serve",
                                   "--config", str(_config(ipc_dir, "second", endpoint))],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT)
        try:
            out, err = second.communicate(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            second.terminate()
            out, err = second.communicate()
            raise AssertionError(f"the second controller runs on the first's endpoint: {out}")
        assert second.returncode == 2, out + err
        assert out == ""  # never announced itself ready
        assert "controller.endpoint" in err, err
        assert f"pid {os.getpid()}" in err and "Traceback" not in err, err
        first.start()
        with ControllerClient(endpoint, timeout_s=5, retries=0) as c:
            assert c.handshake().pid == os.getpid()
    finally:
        first.close()
    assert not [f.name for f in ipc_dir.iterdir() if f.name.startswith("ctl.sock")]
    # let go on close: a later controller of either state directory may take the endpoint
    again = ControllerServer(load_config(ipc_dir / "second.toml")).start()
    again.close()


#: what the issue asks: answered "within a second", with slack for two cores (and `scaled`)
ANSWER_BOUND_S = 2.5


def _long_journal(state_dir: Path, operations: int = 10_000, per_op: int = 3) -> None:
    """A journal as a controller that ran for months leaves it: ``operations`` finished
    cycles of engine ``e`` (``done-0`` the first), each with ``per_op`` records of 2 KB."""
    state_dir.mkdir(mode=0o700)
    path = state_dir / "journal.sqlite3"
    journal = Journal(path)
    journal.begin("done-0", "cycle", ["e"], {})
    journal.finish(p.OperationResult(op_id="done-0", kind="cycle", status="succeeded",
                                     engines=[], wall=time.time(), duration_s=0.1))
    journal.close()
    now = time.time()
    data = json.dumps({"name": "capture", "duration_s": 0.1, "ok": True, "note": "x" * 2000})
    db = sqlite3.connect(path)
    with db:
        db.executemany("INSERT INTO operations (op_id, kind, engines, params, status, wall, "
                       "monotonic, ended_wall) VALUES (?, 'cycle', '[\"e\"]', '{}', "
                       "'succeeded', ?, 0, ?)",
                       [(f"op-{i:05d}", now - operations + i, now - operations + i + 0.5)
                        for i in range(1, operations)])
        db.executemany("INSERT INTO records (op_id, engine, type, wall, monotonic, data) "
                       "VALUES (?, 'e', 'phase', ?, 0, ?)",
                       [(f"op-{i // per_op:05d}", now, data)
                        for i in range(per_op, operations * per_op)])
    db.close()


def test_a_history_too_large_for_one_message_is_answered_with_what_fits(spawn_controller,
                                                                        ipc_dir):
    _long_journal(ipc_dir / "state")
    ctl = spawn_controller(engines_toml(("e", f"ipc://{ipc_dir}/e")))
    out = ctl.ckptctl("history", "--limit", "10000", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    reply = json.loads(out.stdout)
    assert len(reply["operations"]) == 10_000
    records = reply["records"]
    assert records, "no record fits?"
    assert len(records) < 30_000  # 62 MiB of them would not fit in one 16 MiB message
    # the newest ones, oldest first, as always
    seqs = [r["seq"] for r in records]
    assert seqs == list(range(seqs[0], 29_998))  # 29,997 records in all


@pytest.mark.slow  # about 14 s on two loaded cores
def test_large_history_queries_do_not_hold_up_the_control_thread(spawn_controller, ipc_dir):
    """Four ``history --limit 10000`` at once (each reads for seconds); meanwhile a repeat of
    a finished operation, which the control thread answers from the journal, and heartbeats
    are answered within about a second."""
    _long_journal(ipc_dir / "state")
    ctl = spawn_controller(engines_toml(("e", f"ipc://{ipc_dir}/e")))
    stop = threading.Event()
    failures: list[str] = []

    def big() -> None:
        with ControllerClient(ctl.endpoint, timeout_s=60, retries=0) as c:
            while not stop.is_set():
                try:
                    c.history(limit=10_000)
                except Exception as exc:  # policy: recorded; asserted empty below
                    failures.append(repr(exc))
                    return

    threads = [threading.Thread(target=big, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    latencies: list[float] = []
    try:
        with ControllerClient(ctl.endpoint, timeout_s=30, retries=0) as c:
            c.subscribe()
            end = time.monotonic() + 8
            while time.monotonic() < end:
                start = time.monotonic()
                assert c.operation("cycle", ["e"], op_id="done-0").status == "succeeded"
                c.heartbeat()
                latencies.append(time.monotonic() - start)
                time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=scaled(60))
    assert not failures, failures
    assert max(latencies) < scaled(ANSWER_BOUND_S), (max(latencies), len(latencies))


def test_a_restarted_controller_still_reports_the_last_cycle_and_image(spawn_engine,
                                                                       spawn_controller,
                                                                       ipc_dir):
    """``ckpt_last_successful_cycle_timestamp_seconds`` and ``ckpt_image_bytes`` come from the
    journal when the controller starts: a restart (an upgrade, a crash) must not blank the
    series an alert on "no good cycle for a day" watches."""
    from test_metrics import scrape, values

    eng = spawn_engine("m1", weights_mib=4, kv_mib=4, layers=1)
    write_hook(ipc_dir / "hooks", "dump", "50-test",
               'head -c 4096 /dev/zero > "$CKPT_IMAGE_DIR/pages.img"')
    config = "metrics_port = 0\n" + engines_toml(eng)
    ctl = spawn_controller(config)
    out = ctl.ckptctl("cycle", "m1", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    before = scrape(ctl.info["metrics_port"])
    stamp = values(before, "ckpt_last_successful_cycle_timestamp_seconds")
    op = json.loads(out.stdout)["op_id"]  # its image: 4096 bytes and the capture's manifest
    size = 4096 + (ipc_dir / "state" / "images" / "m1" / op / "ckpt-manifest.json").stat().st_size
    assert values(before, "ckpt_image_bytes") == {(("engine", "m1"),): size}
    ctl.stop()
    ctl = spawn_controller(config)
    after = scrape(ctl.info["metrics_port"])
    assert values(after, "ckpt_image_bytes") == {(("engine", "m1"),): size}
    restarted = values(after, "ckpt_last_successful_cycle_timestamp_seconds")
    assert restarted.keys() == stamp.keys()
    assert abs(restarted[(("engine", "m1"),)] - stamp[(("engine", "m1"),)]) < 1.0


@pytest.mark.slow  # the idle connections are closed after 5 s: about 20 s in all
def test_idle_connections_to_the_metrics_port_pile_up_no_threads(spawn_controller):
    """300 connections to the metrics port that never send a request: the controller holds
    a bounded number of threads for them (not one each, for ever), closes the idle ones, and
    answers the next scrape once they are gone."""
    import psutil

    from test_metrics import scrape

    ctl = spawn_controller("metrics_port = 0\n")
    port = ctl.info["metrics_port"]
    proc = psutil.Process(ctl.pid)
    base = proc.num_threads()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    try:
        time.sleep(1.0)
        assert proc.num_threads() < base + 40, proc.num_threads()
        for s in idle:  # each is closed by the controller: in time, or at once if refused
            s.settimeout(15)
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()
    assert scrape(port)
    deadline = deadline_in(10)
    while proc.num_threads() > base + 2:
        assert time.monotonic() < deadline, proc.num_threads()
        time.sleep(0.1)


@pytest.mark.parametrize("taken", ["controller.endpoint", "controller.metrics_port"])
def test_a_port_in_use_is_refused_before_any_engine_is_touched(spawn_engine, ipc_dir, taken):
    """The state directory holds an operation a killed controller left running on a PREPARED
    engine; the new controller's TCP endpoint (or metrics port) is taken. ``serve`` exits 2
    naming the key, and leaves the engine as it was: recovering it is the job of the
    controller that does start."""
    from ckpt_controller.agent.client import AgentClient

    eng = spawn_engine("t1", weights_mib=4, kv_mib=4, layers=1)
    with AgentClient(eng.control, timeout_s=10) as agent:
        assert agent.prepare(op_id="direct", drain="abort", level=1).state == "prepared"
    state = ipc_dir / "state"
    state.mkdir(mode=0o700)
    journal = Journal(state / "journal.sqlite3")
    journal.begin("left-running", "prepare", ["t1"], {})
    journal.close()
    port_holder = socket.socket()
    port_holder.bind(("127.0.0.1", 0))
    port_holder.listen()
    port = port_holder.getsockname()[1]
    endpoint = (f"tcp://127.0.0.1:{port}" if taken == "controller.endpoint"
                else f"ipc://{ipc_dir}/ctl.sock")
    config = ipc_dir / "c.toml"
    config.write_text(f'[controller]\nendpoint = "{endpoint}"\nstate_dir = "{state}"\n'
                      + (f"metrics_port = {port}\n" if taken == "controller.metrics_port" else "")
                      + engines_toml(("t1", eng.control)))
    try:
        out = ckptctl("serve", "--config", str(config))
    finally:
        port_holder.close()
    assert out.returncode == 2, out.stdout + out.stderr
    assert taken in out.stderr and "Traceback" not in out.stderr, out.stderr
    with AgentClient(eng.control, timeout_s=10) as agent:
        assert agent.status().state == "prepared"  # not rolled back by a refused controller
    journal = Journal(state / "journal.sqlite3")
    try:
        assert [op for op, *_ in journal.unfinished()] == ["left-running"]
    finally:
        journal.close()


def test_an_unreadable_result_in_the_journal_does_not_stop_the_controller(spawn_controller,
                                                                          ipc_dir):
    """Carrying the gauges over reads old results; one that cannot be decoded (a disk error,
    a downgrade) costs that gauge, not the controller's start."""
    state = ipc_dir / "state"
    state.mkdir(mode=0o700)
    journal = Journal(state / "journal.sqlite3")
    journal.begin("garbled", "cycle", ["e"], {})
    journal.close()
    db = sqlite3.connect(state / "journal.sqlite3")
    with db:
        db.execute("UPDATE operations SET status = 'succeeded', ended_wall = wall + 1, "
                   "result = ? WHERE op_id = 'garbled'", (b"\xc1 not msgpack",))
    db.close()
    ctl = spawn_controller(engines_toml(("e", f"ipc://{ipc_dir}/e")))
    out = ctl.ckptctl("history", "--json")
    assert out.returncode == 0 and "garbled" in out.stdout, out.stdout + out.stderr


def test_outbox_senders_each_wait_their_own_timeout_not_each_others():
    """The outbox is full and nobody forwards (the owner is stuck): eight threads send at
    once. Each gives up after about its own timeout; none waits for the others' in turn (the
    last would wait eight timeouts: 4 s here, 40 s with the real 5 s)."""
    import zmq

    from ckpt_controller.zmqutil import Outbox

    ctx = zmq.Context()
    outbox = Outbox(ctx, "stuck", hwm=10, send_timeout_s=0.5)
    try:
        while outbox.send([b"peer", b"fill"]):
            pass
        waited: list[float] = []

        def one() -> None:
            start = time.monotonic()
            assert not outbox.send([b"peer", b"more"])
            waited.append(time.monotonic() - start)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=scaled(30))
        assert len(waited) == 8
        assert max(waited) < scaled(1.5), sorted(round(w, 2) for w in waited)
    finally:
        outbox.close()
        ctx.term()


def test_a_history_of_large_group_operations_is_answered_with_what_fits(spawn_controller,
                                                                        ipc_dir):
    """2,000 group operations on 150 engines with names of the longest allowed (64
    characters) each: their summaries alone are about 21 MiB, past the 16 MiB a message may
    have. ``history --limit 2000`` answers with the newest that fit in one message instead of
    being lost to the limit. (Long names, not more engines: each engine of an operation is a
    row of the journal's index as well, and 3 million of them took the test 47 s of CPU.)"""
    state = ipc_dir / "state"
    _long_journal(state, operations=10, per_op=1)
    engines = json.dumps([f"engine-{n:04d}-{'x' * 52}" for n in range(150)])
    assert len(json.loads(engines)[0]) == 64
    now = time.time()
    db = sqlite3.connect(state / "journal.sqlite3")
    with db:
        db.executemany("INSERT INTO operations (op_id, kind, engines, params, status, wall, "
                       "monotonic, ended_wall) VALUES (?, 'cycle', ?, '{}', 'succeeded', ?, 0, "
                       "?)", [(f"group-{i:05d}", engines, now + i, now + i + 1)
                              for i in range(2_000)])
    db.close()
    ctl = spawn_controller(engines_toml(("e", f"ipc://{ipc_dir}/e")))
    out = ctl.ckptctl("history", "--limit", "2000", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    ops = [o["op_id"] for o in json.loads(out.stdout)["operations"]]
    assert 100 < len(ops) < 2_000
    assert ops == [f"group-{i:05d}" for i in range(1_999, 1_999 - len(ops), -1)]  # the newest


def test_a_full_disk_refuses_an_operation_naming_the_state_dir(spawn_engine, spawn_controller):
    """The journal cannot be written (a trigger stands in for a full disk: SQLite's own
    words): the operation is refused before it touches an engine, as a ``StateDirError``
    (exit 1) naming the state dir and saying what to do, not an untyped ``OperationalError``;
    with room again the same request goes through."""
    eng = spawn_engine("df1", weights_mib=4, kv_mib=1, layers=1)
    ctl = spawn_controller(engines_toml(eng))
    journal = ctl.state_dir / "journal.sqlite3"
    db = sqlite3.connect(journal, isolation_level=None)
    db.execute("CREATE TRIGGER full BEFORE INSERT ON operations "
               "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    out = ctl.ckptctl("prepare", "df1", "--op-id", "df-1", "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    err = json.loads(out.stdout)["error"]
    assert err["kind"] == "StateDirError" and err["exit_code"] == 1, err
    assert err["details"]["state_dir"] == str(ctl.state_dir)
    assert "disk is full" in err["details"]["problem"] and "free space" in err["message"]
    status = json.loads(ctl.ckptctl("status", "df1", "--json").stdout)
    assert status["engines"][0]["status"]["state"] == "running"
    db.execute("DROP TRIGGER full")
    db.close()
    out = ctl.ckptctl("prepare", "df1", "--op-id", "df-1", "--level", "0", "--json")
    assert out.returncode == 0, out.stdout + out.stderr


def test_sigterm_mid_hook_ends_the_hook_and_the_operation_before_the_journal_closes(
        ipc_dir, spawn_controller):
    """SIGTERM while a dump hook runs (here: for ever): the hook's whole tree is ended at
    once (SIGTERM, the hook grace), the operation ends its step as at a hook failure (the
    engine put back RUNNING) and answers its caller, and only then does the journal close:
    the controller exits within the bound, nothing of the hook is left, nothing is written
    after the journal closed, and the next start has nothing to recover."""
    from ckpt_controller.agent import Agent
    from support.processes import gone, pids_naming

    agent = Agent("st", control=f"ipc://{ipc_dir}/st.ctl", heartbeat_interval_s=0.2).start()
    try:
        marker = str(ipc_dir / "hook-marker")
        ctl = spawn_controller(engines_toml(agent) + "[deadlines]\nhook_grace = 2.0\n")
        write_hook(ctl, "dump", "10-forever",  # this Python: no launcher of its own
                   f"exec {sys.executable} -c 'import time; time.sleep(600)' {marker}")
        cycle = subprocess.Popen([*CKPTCTL, "--controller", ctl.endpoint, "cycle", "st",
                                  "--json"], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        wait_until(lambda: len(pids_naming(marker)) == 1, scaled(30), "the hook running")
        (hook,) = pids_naming(marker)
        started = time.monotonic()
        ctl.proc.terminate()
        assert ctl.proc.wait(timeout=scaled(30)) == 0
        assert time.monotonic() - started < scaled(15, below=25)  # not STOP_WAIT_S's 20 s
        assert gone(hook) and not pids_naming(marker)
        out, _ = cycle.communicate(timeout=scaled(30))
        result = json.loads(out)
        assert result["status"] != "succeeded" and result["engines"][0]["state"] == "running"
        assert "the controller is stopping" in json.dumps(result)
        log = ctl.log_path.read_text()
        assert "Traceback" not in log and "closed" not in log.lower(), log[-3000:]
        journal = Journal(ctl.state_dir / "journal.sqlite3")
        try:
            assert journal.unfinished() == []  # ended before the journal closed
        finally:
            journal.close()
    finally:
        agent.close()
