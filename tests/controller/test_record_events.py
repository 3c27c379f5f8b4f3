"""Journal records on their way to subscribers: a fan-out's round of records goes out as one
event (``JournaledMany``, split when large), and a subscriber still gets every record of an
operation exactly once, in the journal's order. In-process agents with nothing registered
and an in-process ``ControllerServer``; the client as ``watch`` and the CLI use it."""

from __future__ import annotations

import pytest

from ckpt_controller import protocol as p
from ckpt_controller import rpcserver
from ckpt_controller.agent import Agent
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.controller.config import parse_config
from ckpt_controller.controller.server import ControllerServer
from support.config import controller_toml
from support.timing import deadline_in, scaled

ENGINES = 40


@pytest.mark.parametrize("split", [False, True], ids=["gathered", "split-small"])
def test_a_subscriber_gets_every_record_once_in_order(ipc_dir, monkeypatch, split):
    if split:  # a few records per event at most: the halving path
        monkeypatch.setattr(rpcserver, "GATHERED_BYTES", 1500)
    names = [f"r{i}" for i in range(ENGINES)]
    agents = [Agent(n, control=f"ipc://{ipc_dir}/{n}.ctl", heartbeat_interval_s=0.5).start()
              for n in names]
    toml = controller_toml(ipc_dir, *agents, defaults='level = 0\ndrain = "abort"')
    server = ControllerServer(parse_config(toml))
    server.on_thread_death = lambda name, exc: None
    server.start()
    bodies: list[type] = []
    try:
        with ControllerClient(server.endpoint, timeout_s=60) as c:
            c.subscribe()
            receive = c._receive

            def seen():  # each message as it came, before the client hands records on
                msg = receive()
                if isinstance(msg, p.Event):
                    bodies.append(type(msg.body))
                return msg

            c._receive = seen
            results = [c.cycle(names, max_unavailable=ENGINES, op_id=f"ev-{k}")
                       for k in range(2)]
            assert all(r.status == "succeeded" for r in results)
            history = c.history(limit=100_000)
            got: list[p.JournalRecord] = []
            while True:  # everything queued since the subscribe; the last may trail the reply
                events = [e for e in c.poll_events(0.3) if isinstance(e, p.Journaled)]
                got += [e.record for e in events]
                if not events:
                    break
    finally:
        server.close()
        for a in agents:
            a.close()
    ours = [r for r in history.records if r.op_id in ("ev-0", "ev-1")]
    assert len(ours) >= ENGINES * 2 * 8, len(ours)  # about ten records per engine and cycle
    mine = [r.seq for r in got if r.op_id in ("ev-0", "ev-1")]
    assert mine == [r.seq for r in ours]  # every one, once, in the journal's order
    many = bodies.count(p.JournaledMany)
    assert many >= 1 and many + bodies.count(p.Journaled) < len(ours) / 2, (
        many, bodies.count(p.Journaled), len(ours))


def test_records_ride_with_the_reply_and_still_flow_while_an_operation_runs(ipc_dir,
                                                                             monkeypatch):
    """While operations run, records do not each wake the controller's control thread: a
    quick operation's records reach a subscriber as one event, with its reply; a long one's
    arrive while it runs, at most about ``RECORDS_DELAY_S`` after they were journaled."""
    import threading
    import time

    from ckpt_controller.agent.engine import EngineHooks
    from ckpt_controller.controller import server as server_mod

    class SlowPause(EngineHooks):
        def __init__(self) -> None:
            self.release = threading.Event()

        def pause_scheduling(self) -> None:
            assert self.release.wait(scaled(10))

    slow = SlowPause()
    agents = [Agent("q", control=f"ipc://{ipc_dir}/q.ctl", heartbeat_interval_s=0.5).start(),
              Agent("s", hooks=slow, control=f"ipc://{ipc_dir}/s.ctl",
                    heartbeat_interval_s=0.5).start()]
    toml = controller_toml(ipc_dir, *agents, defaults='level = 0\ndrain = "abort"')
    server = ControllerServer(parse_config(toml))
    server.on_thread_death = lambda name, exc: None
    server.start()
    try:
        with ControllerClient(server.endpoint, timeout_s=30) as c:
            c.subscribe()
            c.cycle(["q"], op_id="warm")
            c.poll_events(0.3)
            messages: list[tuple[float, p.Event]] = []
            receive = c._receive

            def seen():
                msg = receive()
                if isinstance(msg, p.Event) and isinstance(msg.body, (p.Journaled,
                                                                      p.JournaledMany)):
                    messages.append((time.monotonic(), msg))
                return msg

            c._receive = seen
            delay = server_mod.RECORDS_DELAY_S
            # long enough that no look of the control thread's own falls within the cycle,
            # however slow this machine is now: only the reply wakes it
            monkeypatch.setattr(server_mod, "RECORDS_DELAY_S", 10.0)
            assert c.cycle(["q"], op_id="quick").status == "succeeded"
            c.poll_events(0.3)
            quick = [m for _, m in messages]
            records = [r for m in quick for r in (m.body.records if isinstance(
                m.body, p.JournaledMany) else [m.body.record])]
            assert len(records) >= 10 and {r.op_id for r in records} == {"quick"}
            assert len(quick) == 1, [type(m.body).__name__ for m in quick]
            # a long prepare: its first records arrive while it still runs
            monkeypatch.setattr(server_mod, "RECORDS_DELAY_S", delay)
            messages.clear()
            with ControllerClient(server.endpoint, timeout_s=30) as op:
                start = time.monotonic()
                op._sock.send_multipart(p.command_frames(  # sent, its reply not awaited
                    p.RequestType.OPERATION, p.OperationCommand(
                        call_id=1, op_id="long", kind="prepare", engines=["s"])))
                deadline = deadline_in(10)
                while not messages and time.monotonic() < deadline:
                    c.poll_events(0.01)
                assert messages, "no record while the operation ran"
                first = messages[0][0] - start
                assert first < server_mod.RECORDS_DELAY_S + 0.5, first
                slow.release.set()
                reply = op._await(1, 30)
                assert reply.status == "succeeded"
    finally:
        slow.release.set()
        server.close()
        for a in agents:
            a.close()


# ---------------------------------------------------------------- subscribers that stop reading

_SUBSCRIBE_AND = """
import os, signal, sys, time
from ckpt_controller import protocol as p
from ckpt_controller.rpc import RpcClient
c = RpcClient(sys.argv[1])
c.call(p.RequestType.SUBSCRIBE, p.SubscribeCommand(call_id=0))
print("subscribed", flush=True)
if sys.argv[2] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
elif sys.argv[2] == "read":
    end = time.monotonic() + 30
    while time.monotonic() < end:
        c.poll_events(0.2)
else:
    time.sleep(30)  # subscribed, and never reads
"""


def _big_record(i: int) -> p.JournalRecord:
    return p.JournalRecord(seq=i, op_id="op-big", engine="e", type="hook", wall=0.0,
                           monotonic=0.0, data={"stderr_tail": "x" * 2000})


@pytest.mark.parametrize("how", ["stop", "never-read", "read"])
def test_a_subscriber_that_stops_reading_is_let_go(ipc_dir, monkeypatch, how):
    """zmq bounds what is queued for a peer in messages, and a gathered event can be
    megabytes: a subscriber that stops reading (stopped, or never reading what it subscribed
    to) is disconnected after ``PEER_SILENCE_S`` and forgotten, while one that reads keeps
    its subscription however long the server publishes."""
    import subprocess
    import sys
    import time

    monkeypatch.setattr(rpcserver, "PEER_PING_S", 0.2)
    monkeypatch.setattr(rpcserver, "PEER_SILENCE_S", 1.0)
    server = rpcserver.RpcServer(f"ipc://{ipc_dir}/pub.sock", name="pub",
                                 heartbeat_interval_s=0.2)
    server.on_thread_death = lambda name, exc: None
    server.start()
    child = subprocess.Popen([sys.executable, "-c", _SUBSCRIBE_AND, server.endpoint, how],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "subscribed"
        assert len(server._subscribers) == 1
        # about 60 MB in 1,500 events of 20 records each, for 6 s: far beyond what the
        # subscriber's zmq takes in (1,000 messages) and what the kernel buffers
        start, window = time.monotonic(), scaled(6)
        sent = 0
        while time.monotonic() - start < window:
            if sent < 1500:
                server.publish_gathered([_big_record(i) for i in range(20)],
                                        lambda recs: p.JournaledMany(records=recs))
                sent += 1
            time.sleep(0.002)
            if how != "read" and not server._subscribers:
                break
        if how == "read":
            assert len(server._subscribers) == 1, "a subscriber that reads was let go"
        else:
            assert not server._subscribers, "a subscriber that stopped reading is still kept"
            assert time.monotonic() - start < window - 0.5
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        server.close()
