"""The controller keeps one subscribed connection per agent between operations, and uses it
again only while it is surely the same: a restarted agent, a dead one, or a link idle too
long gets a fresh connection, and an operation on it behaves as on a new controller (its
waits still bounded by heartbeats, a dead agent refused at once). Real step engine processes,
an in-process ``Controller``."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.agent.client import AgentClient
from ckpt_controller.controller import links as links_mod
from ckpt_controller.controller import session as session_mod
from ckpt_controller.controller.config import parse_config
from ckpt_controller.controller.service import Controller
from ckpt_controller.errors import UnreachableError
from ckpt_controller.rpc import new_op_id
from support.config import controller_toml, engines_toml
from support.hooks import write_hook
from support.timing import deadline_in, scaled, wait_until


def _controller(tmp_path, *engines) -> Controller:
    return Controller(parse_config(controller_toml(
        tmp_path, *engines, keys="heartbeat_interval_s = 0.2\nmissed_beats = 3\n",
        defaults='level = 0\ndrain = "wait"')))


def _op(kind: str, *engines: str, **kw) -> p.OperationCommand:
    return p.OperationCommand(call_id=0, op_id=new_op_id(), kind=kind, engines=list(engines),
                              **kw)


def test_operations_of_one_engine_share_one_connection(tmp_path, spawn_engine):
    eng = spawn_engine("ln1", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    try:
        for _ in range(3):
            assert ctl.run(_op("cycle", "ln1"), 60).status == "succeeded"
        assert (ctl.links.opened, ctl.links.reused) == (1, 2)
        # every transition still journaled once, from the events or the replies
        trans = [r for r in ctl.journal.records(engine="ln1", limit=1000)
                 if r.type == "transition"]
        assert len(trans) == 3 * 4, [r.data["trigger"] for r in trans]
    finally:
        ctl.close()


def test_a_restarted_agent_gets_a_fresh_subscription(tmp_path, spawn_engine):
    """The new process does not know the old subscriber: an operation that reused the old
    link would hear no heartbeats and call a drain longer than their silence a lost
    contact."""
    eng = spawn_engine("ln2", weights_mib=4, kv_mib=1, step_s=0.05)
    ctl = _controller(tmp_path, eng)
    try:
        assert ctl.run(_op("cycle", "ln2"), 60).status == "succeeded"
        eng.proc.kill()
        eng.proc.wait(scaled(10))
        eng2 = spawn_engine("ln2", weights_mib=4, kv_mib=1, step_s=0.05)
        eng2.submit("r", 30)  # 1.5 s of steps: longer than heartbeats may be missed (0.6 s)
        with AgentClient(eng2.control) as agent:  # admitted before the prepare goes out
            deadline = deadline_in(30)
            while agent.status().in_flight < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        result = ctl.run(_op("prepare", "ln2"), 60)
        assert result.status == "succeeded", result.error
        assert result.engines[0].drain.completed == 1
        assert ctl.links.opened == 2
        assert ctl.run(_op("restore", "ln2"), 60).status == "succeeded"
    finally:
        ctl.close()


def test_a_dead_agents_parked_link_is_not_waited_on(tmp_path, spawn_engine):
    eng = spawn_engine("ln3", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    try:
        assert ctl.run(_op("cycle", "ln3"), 60).status == "succeeded"
        eng.proc.kill()
        eng.proc.wait(scaled(10))
        # the drop reaches the link's socket monitor a moment after the kill; an operation
        # taken before it starts from what the link knew, and finds the agent gone only
        # after its heartbeats' silence (an operation that fails in 1.2 s, not this refusal)
        wait_until(lambda: ctl.links.parked_dropped("ln3"), 10, "the drop seen")
        start = time.monotonic()
        with pytest.raises(UnreachableError, match="no socket file|refused"):
            ctl.run(_op("cycle", "ln3"), 60)
        # refused at once, not after the probe's 2 s timeout
        assert time.monotonic() - start < scaled(1.9, below=2.0)
    finally:
        ctl.close()


def test_a_link_idle_too_long_is_replaced(tmp_path, spawn_engine, monkeypatch):
    eng = spawn_engine("ln4", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    try:
        assert ctl.run(_op("cycle", "ln4"), 60).status == "succeeded"
        assert ctl.run(_op("cycle", "ln4"), 60).status == "succeeded"
        assert (ctl.links.opened, ctl.links.reused) == (1, 1)
        # a short limit only now: between two operations on a busy machine (the first one's
        # end journaled, the next one's preflight) a link can be idle longer than 0.3 s
        monkeypatch.setattr(links_mod, "IDLE_REFRESH_S", 0.3)
        time.sleep(0.5)
        assert ctl.run(_op("cycle", "ln4"), 60).status == "succeeded"
        assert (ctl.links.opened, ctl.links.reused) == (2, 1)
    finally:
        ctl.close()


def test_a_refused_operation_gives_its_links_back(tmp_path, spawn_engine):
    eng = spawn_engine("ln5", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    try:
        with pytest.raises(Exception, match="needs PREPARED"):
            ctl.run(_op("capture", "ln5"), 60)  # refused by the preflight: RUNNING
        assert ctl.run(_op("cycle", "ln5"), 60).status == "succeeded"
        assert (ctl.links.opened, ctl.links.reused) == (1, 1)
    finally:
        ctl.close()


def test_the_controller_raises_its_open_files_limit_for_its_engines():
    """A thousand engines need thousands of descriptors; the usual soft limit is 1,024. The
    soft limit is raised to the hard limit; a roster the hard limit cannot hold is a
    ``ConfigError`` saying how many fit."""
    import subprocess
    import sys

    code = ("import resource\n"
            "from ckpt_controller.controller import openfiles\n"
            "from ckpt_controller.errors import ConfigError\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (512, 8192))\n"
            "print(openfiles.ensure(100), openfiles.ensure(600))\n"
            "try:\n"
            "    openfiles.ensure(700)\n"
            "except ConfigError as err:\n"
            "    print(err.details['fits'], err.details['needed'], err.exit_code, err.message)\n"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=scaled(60))
    assert out.returncode == 0, out.stderr
    raised, refused, soft = out.stdout.splitlines()
    assert raised.split() == ["8192", "8192"]  # all the hard limit allows: room for clients
    assert refused.split()[:3] == ["661", str(12 * 700 + 256), "2"]
    assert "room for 661 engines: raise LimitNOFILE=" in refused
    assert soft == "8192"


def _serve_config(ipc_dir, engines: list[str]):
    """A config for ``ckptctl serve`` in ``ipc_dir`` (its hooks folder made) with an
    engine on ``ipc://<ipc_dir>/<name>.ctl`` for each of ``engines``: (its path, the
    controller's endpoint)."""
    (ipc_dir / "hooks").mkdir()
    config = ipc_dir / "controller.toml"
    endpoint = f"ipc://{ipc_dir}/c.sock"
    config.write_text(f'[controller]\nendpoint = "{endpoint}"\n'
                      f'state_dir = "{ipc_dir}/state"\nhooks_dir = "{ipc_dir}/hooks"\n'
                      + engines_toml(*[(n, f"ipc://{ipc_dir}/{n}.ctl") for n in engines]))
    return config, endpoint


def _open_files(soft: int, hard: int):
    """A ``preexec_fn`` that gives the child these open-files limits."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_roster_the_hard_limit_cannot_hold_is_refused_at_start(ipc_dir):
    """``ckptctl serve`` with 40 engines and a hard limit of 512 open files exits 2 at once,
    saying what to raise: it once started, warned, and died of EMFILE (libzmq's abort) in
    the middle of a cycle of all its engines."""
    import subprocess

    from support.cli import CKPTCTL

    config, _ = _serve_config(ipc_dir, [f"e{i}" for i in range(40)])
    out = subprocess.run([*CKPTCTL, "serve", "--config", str(config)], capture_output=True,
                         text=True, timeout=scaled(60), preexec_fn=_open_files(256, 512))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "40 engines need about 736 open files" in out.stderr
    assert "room for 21 engines: raise LimitNOFILE=" in out.stderr


def test_a_burst_of_client_connections_does_not_kill_the_controller(ipc_dir):
    """600 connections opened at once to the controller's ipc socket, its soft open-files
    limit 300 (hard 4096): it once died of it (libzmq aborts the process when its ipc
    listener cannot accept, "Too many open files (src/ipc_listener.cpp:297)"). It raises the
    soft limit to the hard one at start, serves a cycle during the burst and after it."""
    import socket
    import subprocess

    from ckpt_controller.agent import Agent
    from support.cli import CKPTCTL, ckptctl

    agents = [Agent(f"b{i}", control=f"ipc://{ipc_dir}/b{i}.ctl",
                    heartbeat_interval_s=0.2).start() for i in range(2)]
    config, endpoint = _serve_config(ipc_dir, ["b0", "b1"])
    ctl = subprocess.Popen([*CKPTCTL, "serve", "--config", str(config)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=_open_files(300, 4096))
    burst: list[socket.socket] = []
    try:
        wait_until(lambda: ckptctl("status", endpoint=endpoint).returncode == 0,
                   what="the controller serving")
        for _ in range(600):
            s = socket.socket(socket.AF_UNIX)
            burst.append(s)
            s.connect(str(ipc_dir / "c.sock"))
        wait_until(lambda: len(os.listdir(f"/proc/{ctl.pid}/fd")) > 600 or ctl.poll(),
                   what="the burst accepted")
        assert ctl.poll() is None
        assert ckptctl("cycle", "b0", endpoint=endpoint).returncode == 0
        for s in burst:
            s.close()
        burst.clear()
        assert ckptctl("cycle", "b1", endpoint=endpoint).returncode == 0
        assert ctl.poll() is None
    finally:
        for s in burst:
            s.close()
        ctl.terminate()
        ctl.communicate(timeout=scaled(30))
        for a in agents:
            a.close()


def test_a_link_that_cannot_be_made_refuses_the_operation(tmp_path, spawn_engine,
                                                         monkeypatch):
    """Making a link may fail (CURVE keys unreadable by now): the request is refused with
    that error and its engines are free, never held by an operation that never ran."""
    from ckpt_controller.errors import ConfigError

    eng = spawn_engine("ln6", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    real = ctl.links._new

    def broken(engine):
        raise ConfigError("cannot read the agent's CURVE keys", engine=engine)
    monkeypatch.setattr(ctl.links, "_new", broken)
    try:
        with pytest.raises(ConfigError, match="CURVE keys"):
            ctl.run(_op("cycle", "ln6"), 30)
        monkeypatch.setattr(ctl.links, "_new", real)
        assert ctl.run(_op("cycle", "ln6"), 60).status == "succeeded"  # not left held
    finally:
        ctl.close()


def _count_status_requests(monkeypatch) -> list[str]:
    """Each status request a link sends, by the link's name (``controller/<engine>``)."""
    asked: list[str] = []
    real = links_mod.AgentLink.status

    def status(self, **kw):
        asked.append(self.name)
        return real(self, **kw)
    monkeypatch.setattr(links_mod.AgentLink, "status", status)
    return asked


def test_a_restore_of_an_engine_found_gone_runs_its_hooks_without_asking_again(
        tmp_path, spawn_engine, monkeypatch):
    """The preflight asked the engine (prepared, then its process gone, as a stop-mode dump
    leaves it) and had no answer: the restore runs its pre-restore hooks at once. It once
    asked again on opening, and waited out the link's timeout and a resend (4 s on a dead
    TCP port) while a client held by tcp-hold waited too."""
    opened: list[str] = []
    real_open = session_mod.EngineSession.open

    def open_(self):
        opened.append(self.name)
        return real_open(self)
    monkeypatch.setattr(session_mod.EngineSession, "open", open_)
    eng = spawn_engine("ln8", weights_mib=4, kv_mib=1)
    write_hook(tmp_path / "hooks", "pre-restore", "10-revive",
               'echo "no image to bring it back from" >&2; exit 1')
    ctl = Controller(parse_config(controller_toml(
        tmp_path, eng, keys=f'hooks_dir = "{tmp_path}/hooks"\nheartbeat_interval_s = 0.2\n',
        defaults='level = 0\ndrain = "wait"')))
    try:
        assert ctl.run(_op("prepare", "ln8"), 60).status == "succeeded"
        eng.proc.kill()
        eng.proc.wait(scaled(10))
        wait_until(lambda: ctl.links.parked_dropped("ln8"), 10, "the drop seen")
        del opened[:]
        result = ctl.run(_op("restore", "ln8"), 60)
        (o,) = result.engines
        assert o.status == "failed" and "no image to bring it back from" in \
            result.error.message, result
        assert [h.point for h in o.hooks] == ["pre-restore"]
        assert opened == []  # the preflight asked; the restore did not ask again
    finally:
        ctl.close()


def test_a_link_that_heard_its_agent_just_now_asks_no_status(tmp_path, spawn_engine,
                                                             monkeypatch):
    """An operation starts from what the engine's link knows (the last reply, the
    heartbeats read when it is taken) while it heard from the agent within KNOWN_FRESH_S;
    the state it knows is the agent's own."""
    asked = _count_status_requests(monkeypatch)
    eng = spawn_engine("ln7", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    try:
        assert ctl.run(_op("cycle", "ln7"), 60).status == "succeeded"
        assert asked == ["controller/ln7"]  # the first operation asks: the link knew nothing
        assert ctl.run(_op("prepare", "ln7"), 60).status == "succeeded"
        time.sleep(2 * links_mod.KNOWN_FRESH_S)  # idle: only the heartbeats tell it is alive
        assert ctl.run(_op("restore", "ln7"), 60).status == "succeeded"
        assert asked == ["controller/ln7"]
        assert ctl.links.parked_knows("ln7").generation == 2
        # an operator's own prepare, straight at the agent: the link hears of it
        with AgentClient(eng.control) as operator:
            operator.prepare(drain="wait", level=0)
        time.sleep(0.3)  # the event on its way to the parked link
        with pytest.raises(Exception, match="needs RUNNING engines; ln7 is prepared"):
            ctl.run(_op("prepare", "ln7"), 60)
        assert asked == ["controller/ln7"]
        # with no heartbeats placed in time (a limit nothing can meet), it asks again
        monkeypatch.setattr(links_mod, "KNOWN_FRESH_S", 0.0)
        monkeypatch.setattr("ckpt_controller.controller.preflight.KNOWN_FRESH_S", 0.0)
        monkeypatch.setattr("ckpt_controller.controller.session.KNOWN_FRESH_S", 0.0)
        assert ctl.run(_op("restore", "ln7"), 60).status == "succeeded"
        assert asked == ["controller/ln7"] * 3  # the preflight's, and the session's own
    finally:
        ctl.close()


def test_a_stopped_agent_is_asked_once_its_link_heard_nothing_for_a_while(tmp_path,
                                                                          spawn_engine,
                                                                          monkeypatch):
    """A hung agent sends no heartbeats: past KNOWN_FRESH_S its link knows nothing current,
    the preflight asks, and the operation is refused (nothing taken out of service)."""
    asked = _count_status_requests(monkeypatch)
    eng = spawn_engine("ln8", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    try:
        assert ctl.run(_op("cycle", "ln8"), 60).status == "succeeded"
        os.kill(eng.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(links_mod.KNOWN_FRESH_S + 0.2)
            with pytest.raises(UnreachableError, match="ln8 did not answer"):
                ctl.run(_op("cycle", "ln8"), 60)
            assert asked == ["controller/ln8"] * 2
        finally:
            os.kill(eng.proc.pid, signal.SIGCONT)
        assert ctl.run(_op("cycle", "ln8"), 60).status == "succeeded"
        with AgentClient(eng.control) as agent:
            assert agent.status().state == "running"
    finally:
        ctl.close()


def test_a_repeated_op_ids_old_reply_does_not_make_the_link_know_a_stale_state(
        tmp_path, spawn_engine):
    """An agent answers a repeated op id with the reply it kept: its state and its
    transitions are from then, not now. The link must not take that state as current, nor
    learn a clock offset from transitions made long ago (heartbeats would then be placed in
    the future, and a silent agent would look heard-from)."""
    eng = spawn_engine("rv1", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    try:
        assert ctl.run(_op("cycle", "rv1"), 60).status == "succeeded"
        link = ctl.links.take("rv1")
        link.status()
        link.prepare(op_id="dup-prepare", drain="wait", level=0)
        link.restore(op_id="dup-restore")
        time.sleep(3.0)
        again = link.prepare(op_id="dup-prepare", drain="wait", level=0)  # the kept reply
        assert again.state == "prepared"
        with AgentClient(eng.control) as agent:
            assert agent.status().state == "running"
        known = link.knows(links_mod.KNOWN_FRESH_S)
        assert known is None or known.state == "running", known
        # the clock: heartbeats read now, then the agent goes silent
        link.poll_events(0.5)
        os.kill(eng.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(links_mod.KNOWN_FRESH_S + 0.5)
            assert link.knows(links_mod.KNOWN_FRESH_S) is None, "a silent agent looks fresh"
        finally:
            os.kill(eng.proc.pid, signal.SIGCONT)
        link.close()
    finally:
        ctl.close()


@pytest.mark.parametrize("sent", [float("inf"), float("nan"), 1e300])
def test_a_heartbeat_from_the_future_does_not_make_a_link_fresh(ipc_dir, sent):
    """A heartbeat whose clock reading is absurd (a broken or hostile agent) is not placed
    after now: the link still asks once it heard nothing real for KNOWN_FRESH_S."""
    link = links_mod.AgentLink(f"ipc://{ipc_dir}/none.ctl", timeout_s=0.2, retries=0)
    try:
        link.known = p.StatusReply(engine="x", pid=1, state="running", is_restored=False,
                                   generation=0, in_flight=0, kept=0, released_tags=[],
                                   registered_bytes={}, incarnation=0,
                                   restored_from_image=False)
        link._offset = 0.0
        link._heard_at = time.monotonic() - 10
        link._on_event(p.Heartbeat(engine="x", state="running", seq=1, monotonic=sent,
                                   incarnation=0))
        assert link.knows(links_mod.KNOWN_FRESH_S) is None
    finally:
        link.close()
