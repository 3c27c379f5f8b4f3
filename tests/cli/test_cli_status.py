"""``ckptctl status`` as a table (``fleet status``'s renderer), ``-o wide``, rows for engines
that did not answer or moved away, ``agent status`` in the same columns, LAST-OP from the
status reply alone, and what it says while a stopped (SIGSTOP) controller does not answer; a
real controller and real step engines, the renderer also on replies made here."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.cli.common import STATUS_COLUMNS, WIDE_COLUMNS, age, table
from ckpt_controller.cli.controller_cmds import status_table
from support import ROOT
from support.cli import CKPTCTL, StreamedLines, ckptctl
from support.config import controller_toml, engines_toml
from support.hooks import write_hook
from support.timing import scaled, wait_until


def _rows(text: str) -> list[list[str]]:
    """The table's rows (up to the first blank line), split on runs of 2+ spaces."""
    block = text.split("\n\n")[0]
    return [re.split(r"\s{2,}", line.strip()) for line in block.splitlines()]


def test_age_and_table():
    assert [age(s) for s in (0, 5.9, 59, 60, 192, 3600, 18240, 86400, 356400)] == \
        ["0s", "5s", "59s", "1m0s", "3m12s", "1h0m", "5h4m", "1d0h", "4d3h"]
    assert age(-3) == "0s"  # a clock a little ahead of ours
    assert table([("A", "LONGER"), ("wide cell", "x"), ("b", "")]) == \
        "A          LONGER\nwide cell  x\nb"


def _status(engine: str, state: str = "running", gen: int = 0, wall: float | None = None,
            **kw) -> p.StatusReply:
    t = None if wall is None else p.TransitionRecord(
        trigger="restore", source="restoring", dest=state, generation=gen, monotonic=1.0,
        wall=wall)
    return p.StatusReply(engine=engine, pid=4242, state=state, is_restored=gen > 0,
                         generation=gen, in_flight=3, kept=1, released_tags=[],
                         registered_bytes={"weights": 3 << 20}, incarnation=0,
                         restored_from_image=False, last_transition=t,
                         endpoints={"control": f"ipc:///x/{engine}"}, **kw)


def test_every_engine_gets_a_readable_row():
    """Answered, held, unreachable and moved engines each have a row; the ones that need it
    a line under the table; -o wide adds its columns."""
    now = 10_000.0
    reply = p.ControllerStatusReply(controller_pid=1, engines=[
        p.EngineView(engine="a", kind="native", control="ipc:///x/a", reachable=True,
                     status=_status("a", gen=2, wall=now - 192), images_bytes=3 << 30),
        p.EngineView(engine="b", kind="native", control="ipc:///x/b", reachable=True,
                     status=_status("b", state="prepared", wall=now - 5), holder="op-7",
                     unsettled_by=None),
        p.EngineView(engine="c", kind="vllm", control="tcp://h:1", reachable=False,
                     error=p.ErrorInfo(kind="UnreachableError", message="c did not answer"),
                     unsettled_by="op-6"),
        p.EngineView(engine="d", kind="native", control="ipc:///x/d", reachable=False,
                     moved_to="node-2", moved_by="mig-1"),
    ])
    text = status_table(reply, {"a": "op-5", "b": "op-7", "c": "op-6"}, now=now)
    rows = _rows(text)
    assert rows[0] == list(STATUS_COLUMNS)
    assert rows[1] == ["a", "running", "2", "3", "4242", "-", "op-5", "3m12s"]
    assert rows[2] == ["b", "prepared", "0", "3", "4242", "op-7", "op-7", "5s"]
    assert rows[3] == ["c", "UNREACHABLE", "-", "-", "-", "-", "op-6", "-"]
    assert rows[4] == ["d", "MOVED", "-", "-", "-", "-", "mig-1", "-"]
    notes = text.split("\n\n")[1].splitlines()
    assert notes == ["c: UNREACHABLE (c did not answer)",
                     "c: unsettled since operation op-6 lost contact (the reconciler settles it)",
                     "d: MOVED to node node-2 by operation mig-1 (not driven here)"]
    wide = _rows(status_table(reply, {}, wide=True, now=now))
    assert wide[0] == list(STATUS_COLUMNS + WIDE_COLUMNS)
    assert wide[1][8:] == ["native", "-", "1", "ipc:///x/a", "3.0 MiB", "-", "-", "3.0 GiB", "-"]
    assert wide[2][-2] == "-"  # its images not counted
    assert wide[3][-1] == "c did not answer" and wide[4][-1] == "on node node-2"
    assert all(len(r) == len(wide[0]) for r in wide)


def test_status_of_a_real_controller(spawn_engine, spawn_controller, ipc_dir):
    eng = spawn_engine("s1", weights_mib=4, kv_mib=4, step_s=0.01)
    ctl = spawn_controller(engines_toml(("s1", eng.control), ("ghost", f"ipc://{ipc_dir}/none")))
    out = ctl.ckptctl("cycle", "s1", "--op-id", "c-1", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    out = ctl.ckptctl("status")
    assert out.returncode == 4, out.stdout + out.stderr  # ghost did not answer
    rows = {r[0]: r for r in _rows(out.stdout)}
    assert rows["NAME"] == list(STATUS_COLUMNS)
    assert rows["s1"][1:7] == ["running", "1", "0", str(eng.pid), "-", "c-1"]
    assert re.fullmatch(r"\d+s", rows["s1"][7]), rows["s1"]
    assert rows["ghost"][1:] == ["UNREACHABLE", "-", "-", "-", "-", "-", "-"]
    assert "ghost: UNREACHABLE (" in out.stdout
    wide = {r[0]: r for r in _rows(ctl.ckptctl("status", "-o", "wide", "s1").stdout)}
    assert wide["s1"][11] == eng.control and wide["s1"][8] == "native"
    assert wide["s1"][9] == "embedded"  # the API it is driven through
    # --json: the same exit code as the table (4: ghost did not answer), its document printed
    out = ctl.ckptctl("status", "--json")
    assert out.returncode == 4, out.stdout + out.stderr
    ghost = {e["engine"]: e for e in json.loads(out.stdout)["engines"]}["ghost"]
    assert ghost["reachable"] is False and ghost["status"] is None
    # --json is the status reply, as it was
    out = ctl.ckptctl("status", "s1", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["engines"][0]["status"]["generation"] == 1
    assert doc["engines"][0]["status"]["pid"] == eng.pid

    # held by a running operation: its id in HELD-BY until it ends
    write_hook(ctl, "dump", "10-wait", f"while [ ! -e {ipc_dir}/go ]; do sleep 0.05; done")
    op = subprocess.Popen([*CKPTCTL, "--controller",
                           ctl.endpoint, "cycle", "s1", "--op-id", "held-1", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        def held() -> bool:
            row = {r[0]: r for r in _rows(ctl.ckptctl("status", "s1").stdout)}["s1"]
            return row[5] == "held-1" and row[1] == "prepared"
        wait_until(held, 30, "s1 held by held-1 in status")
    finally:
        (Path(ipc_dir) / "go").touch()
        _, err = op.communicate(timeout=scaled(60))
    assert op.returncode == 0, err
    row = {r[0]: r for r in _rows(ctl.ckptctl("status", "s1").stdout)}["s1"]
    assert row[1:3] == ["running", "2"] and row[5:7] == ["-", "held-1"]


def test_agent_status_has_the_same_columns(spawn_engine):
    eng = spawn_engine("a1", weights_mib=4, kv_mib=4)
    start = time.monotonic()
    out = ckptctl("agent", "status", "--control", eng.control)
    assert out.returncode == 0, out.stderr
    rows = _rows(out.stdout)
    assert rows[0] == list(STATUS_COLUMNS)
    assert rows[1][:6] == ["a1", "running", "0", "0", str(eng.pid), "-"]
    assert "weights: 4.0 MiB" in out.stdout and out.stderr == ""
    assert time.monotonic() - start < scaled(30)


def test_status_takes_last_op_from_its_reply_and_asks_no_history(ipc_dir):
    """LAST-OP comes in the status reply (``EngineView.last_op``, one journal read): the
    command sends no ``history`` request, whatever the number of engines. A controller whose
    reply does not carry it (one from before the field) is asked per engine, as before."""
    from ckpt_controller.agent import Agent
    from ckpt_controller.controller.client import ControllerClient
    from ckpt_controller.controller.config import parse_config
    from ckpt_controller.controller.server import ControllerServer

    names = ["l0", "l1", "l2"]
    agents = [Agent(n, control=f"ipc://{ipc_dir}/{n}.ctl", heartbeat_interval_s=0.2).start()
              for n in names]
    server = ControllerServer(parse_config(controller_toml(
        ipc_dir, *agents, keys="heartbeat_interval_s = 0.2\nmetrics_port = 0\n",
        defaults="level = 0"))).start()
    history_asked: list[p.HistoryCommand] = []
    answer_history = server.controller.history

    def history(cmd: p.HistoryCommand) -> p.HistoryReply:
        history_asked.append(cmd)
        return answer_history(cmd)

    server.controller.history = history

    def status_rows() -> dict[str, list[str]]:
        """``ckptctl status`` run for real: its rows by engine, LAST-OP checked."""
        out = ckptctl("--controller", server.endpoint, "status")
        assert out.returncode == 0, out.stdout + out.stderr
        rows = {r[0]: r for r in _rows(out.stdout)}
        assert [rows[n][6] for n in names] == ["cy-1", "pr-1", "-"], out.stdout
        return rows

    try:
        with ControllerClient(server.endpoint) as c:
            assert c.cycle(["l0", "l1"], op_id="cy-1").status == "succeeded"
            assert c.prepare(["l1"], op_id="pr-1").status == "succeeded"
        rows = status_rows()
        assert rows["l1"][1] == "prepared"
        assert history_asked == []

        # an older controller: no last_op in its reply, LAST-OP asked engine by engine
        answer_status = server.controller.status

        def old_status(engines: list[str]) -> p.ControllerStatusReply:
            reply = answer_status(engines)
            for v in reply.engines:
                v.last_op = None
            reply.last_ops = False
            return reply

        server.controller.status = old_status
        status_rows()
        assert sorted(cmd.engine for cmd in history_asked) == names

        # a journal that cannot be read leaves LAST-OP empty, not the engines' states
        server.controller.status = answer_status

        def unreadable(engines: list[str]):
            raise sqlite3.OperationalError("disk I/O error")

        server.controller.journal.last_operations = unreadable
        with ControllerClient(server.endpoint) as c:
            reply = c.status()
        assert [(v.reachable, v.last_op) for v in reply.engines] == [(True, None)] * 3
    finally:
        server.close()
        for a in agents:
            a.close()


@pytest.fixture
def stoppable(spawn_controller, ipc_dir):
    """A real controller process (one in-process agent behind it) that a test may SIGSTOP:
    ``(controller, stop)``; it is sent SIGCONT at the end whatever happened."""
    from ckpt_controller.agent import Agent

    agent = Agent("z1", control=f"ipc://{ipc_dir}/z1.ctl", heartbeat_interval_s=0.2).start()
    ctl = spawn_controller(engines_toml(("z1", f"ipc://{ipc_dir}/z1.ctl")))
    out = ctl.ckptctl("status", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    def stop() -> None:  # returns once every thread of it is stopped, not just signalled
        os.kill(ctl.pid, signal.SIGSTOP)
        wait_until(lambda: _stopped(ctl.pid), 10, f"controller {ctl.pid} stopped")

    try:
        yield ctl, stop
    finally:
        os.kill(ctl.pid, signal.SIGCONT)
        agent.close()


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in the stopped state (``T``)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # a thread that ended meanwhile
            continue
    return bool(states) and all(s == "T" for s in states)


def test_status_says_on_stderr_that_a_stopped_controller_has_not_answered_yet(stoppable):
    """SIGSTOPped, the controller accepts the request and answers nothing: after 5 s (its
    engines' probes take up to 2 s: a silent engine must not read as a silent controller)
    ``status`` says so on stderr, naming the controller (stdout stays for the document
    alone), and keeps waiting; resumed, it answers that same request."""
    ctl, stop = stoppable
    stop()
    start = time.monotonic()
    proc = subprocess.Popen([*CKPTCTL, "--controller",
                             ctl.endpoint, "status", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    err = StreamedLines(proc.stderr)
    try:
        wait_until(lambda: err.lines, 15, "a line on stderr")
        said = time.monotonic() - start
        assert err.lines == [f"ckptctl: no answer from the controller at {ctl.endpoint} yet "
                             "(5.0s); still trying (attempt 1 of 3, at most 30s in all)\n"], \
            err.lines
        assert said >= 5.0 and proc.poll() is None
    finally:
        os.kill(ctl.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 0, out + "".join(err.join())
    assert json.loads(out)["engines"][0]["engine"] == "z1" and len(out.splitlines()) == 1


def test_each_resend_to_a_stopped_controller_is_said(stoppable):
    """The transport under it, with short timeouts: the notice, then one line per resend,
    then the error stating the whole wait."""
    from ckpt_controller.controller.client import ControllerClient
    from ckpt_controller.errors import UnreachableError

    ctl, stop = stoppable
    stop()
    said: list[str] = []
    with ControllerClient(ctl.endpoint, timeout_s=0.6, retries=2, on_wait=said.append,
                          notice_after_s=0.2) as c:
        with pytest.raises(UnreachableError) as caught:
            c.history(limit=1)
    e = ctl.endpoint
    e = f"the controller at {e}"
    assert said == [f"no answer from {e} yet (0.2s); still trying (attempt 1 of 3, at most 2s "
                    "in all)",
                    f"no answer from {e} in 0.6s; still trying (attempt 2 of 3)",
                    f"no answer from {e} in 0.6s; still trying (attempt 3 of 3)"]
    assert caught.value.details["attempts"] == 3 and "(3 attempts)" in caught.value.message


@pytest.mark.slow
def test_status_of_a_stopped_controller_gives_up_after_30s(stoppable):
    """The whole documented wait (three attempts of 10 s): three lines on stderr, and with
    ``--json`` only the error document on stdout, exit 4."""
    ctl, stop = stoppable
    stop()
    start = time.monotonic()
    out = ctl.ckptctl("status", "--json", timeout=90)
    took = time.monotonic() - start
    assert out.returncode == 4, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert len(out.stdout.splitlines()) == 1 and doc["kind"] == "error"
    assert doc["error"]["kind"] == "UnreachableError" and doc["error"]["details"]["attempts"] == 3
    lines = out.stderr.splitlines()
    assert [ln.split("still trying ")[1] for ln in lines[:3]] == [
        "(attempt 1 of 3, at most 30s in all)", "(attempt 2 of 3)", "(attempt 3 of 3)"]
    assert 29 < took < scaled(45, below=3 * 30), took  # one 30 s budget, not three
