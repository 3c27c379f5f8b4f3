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

ENGINES = 40


@pytest.mark.parametrize("split", [False, True], ids=["gathered", "split-small"])
def test_a_subscriber_gets_every_record_once_in_order(ipc_dir, monkeypatch, split):
    if split:  # a few records per event at most: the halving path
        monkeypatch.setattr(rpcserver, "GATHERED_BYTES", 1500)
    names = [f"r{i}" for i in range(ENGINES)]
    agents = [Agent(n, control=f"ipc://{ipc_dir}/{n}.ctl", heartbeat_interval_s=0.5).start()
              for n in names]
    toml = (f'[controller]\nendpoint = "ipc://{ipc_dir}/ctl.sock"\n'
            f'state_dir = "{ipc_dir}/state"\n[defaults]\nlevel = 0\ndrain = "abort"\n'
            + "".join(f'[[engine]]\nname = "{n}"\ncontrol = "ipc://{ipc_dir}/{n}.ctl"\n'
                      for n in names))
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
