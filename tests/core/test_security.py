"""CURVE on TCP control endpoints: key files, admission by key, refusals logged, no secret in
logs or the journal. Real sockets, a real agent in this process and real engine and
controller processes."""

from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.agent import Agent, AgentClient
from ckpt_controller.errors import ConfigError, UnreachableError
from ckpt_controller.security import CurveClient, CurveServer, generate, load
from support.cli import ckptctl
from support.config import engines_toml
from support.timing import wait_until


@pytest.fixture
def keys(tmp_path):
    """agent, operator and stranger key pairs; the agent admits only the operator."""
    d = tmp_path / "keys"
    out = {n: generate(d, n) for n in ("agent", "operator", "stranger")}
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "operator.key").write_text(out["operator"][0].read_text())
    return out, clients


def test_keys_command_writes_a_private_secret(tmp_path):
    out = ckptctl("keys", "node-a", "--dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert os.stat(info["secret"]).st_mode & 0o777 == 0o600
    public, secret = load(info["secret"], secret=True)
    assert public.decode() == info["public_key"] and len(secret) == 40
    assert load(info["public"], secret=False) == (public, None)
    again = ckptctl("keys", "node-a", "--dir", str(tmp_path))
    assert again.returncode == 2 and "--force" in again.stderr
    os.chmod(info["secret"], 0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        load(info["secret"], secret=True)
    with pytest.raises(ConfigError, match="no CURVE secret key"):
        load(info["public"], secret=True)


def test_only_an_authorized_key_gets_in_and_refusals_are_logged(keys, caplog):
    pairs, clients = keys
    agent_pub, agent_secret = pairs["agent"]
    caplog.set_level(logging.INFO)
    with Agent("secure", control="tcp://127.0.0.1:0", heartbeat_interval_s=0.1,
               curve=CurveServer(agent_secret, clients)) as agent:

        def client(**kw):
            return AgentClient(agent.endpoint, timeout_s=1.0, retries=0, **kw)

        with client(curve=CurveClient(pairs["operator"][1], agent_pub)) as c:
            assert c.status().state == "running"
        with client(curve=CurveClient(pairs["stranger"][1], agent_pub)) as c:
            with pytest.raises(UnreachableError) as info:
                c.status()
            assert "CURVE" in info.value.details["hint"]
        stranger_pub = load(pairs["stranger"][0], secret=False)[0].decode()
        assert any("refused a CURVE client from 127.0.0.1" in r.message
                   and stranger_pub in r.message for r in caplog.records)
        with client() as c:  # no CURVE at all
            with pytest.raises(UnreachableError):
                c.status()
        # read from the server's socket monitor: the handshake that failed, and why. A zmq
        # client may give up and hang up before the server has read its whole greeting (the
        # server then logs "no detail": it cannot know why), so here a whole ZMTP 3.0
        # greeting offering no security (NULL) is sent by hand, and the line kept open
        host, port = agent.endpoint[len("tcp://"):].rsplit(":", 1)
        greeting = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00"
                    + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(greeting)
            wait_until(lambda: any("refused a connection from" in r.message and "without CURVE"
                                   in r.message for r in caplog.records), 10,
                       "the failed handshake logged")
        with client(curve=CurveClient(pairs["operator"][1], pairs["stranger"][0])) as c:
            with pytest.raises(UnreachableError):  # the wrong server key
                c.status()
        # a key added to the directory is admitted without a restart
        (clients / "stranger.key").write_text(pairs["stranger"][0].read_text())
        with client(curve=CurveClient(pairs["stranger"][1], agent_pub)) as c:
            assert c.status().state == "running"
        # and a key removed is refused from the next connection on, without a restart
        (clients / "operator.key").unlink()
        with client(curve=CurveClient(pairs["operator"][1], agent_pub)) as c:
            with pytest.raises(UnreachableError):
                c.status()
        operator_pub = load(pairs["operator"][0], secret=False)[0].decode()
        assert any(operator_pub in r.message for r in caplog.records)
    assert sum("refused" in r.message for r in caplog.records) >= 2
    secrets = [load(s, secret=True)[1].decode() for _, s in pairs.values()]
    assert not any(s in caplog.text for s in secrets)


def test_tcp_without_curve_is_warned_about(caplog):
    caplog.set_level(logging.WARNING)
    with Agent("open", control="tcp://127.0.0.1:0"):
        pass
    assert any("no CURVE keys" in r.message for r in caplog.records)


def test_controller_and_engine_over_curve_tcp(tmp_path, spawn_reference, spawn_controller):
    d = tmp_path / "k"
    names = ("engine", "controller", "operator", "stranger")
    pair = {n: generate(d, n) for n in names}
    engine_clients, ctl_clients = tmp_path / "engine-clients", tmp_path / "ctl-clients"
    for folder, who in ((engine_clients, "controller"), (ctl_clients, "operator")):
        folder.mkdir()
        (folder / f"{who}.key").write_text(pair[who][0].read_text())
    eng = spawn_reference("sec", "--curve-secret-key", str(pair["engine"][1]),
                          "--curve-clients", str(engine_clients),
                          control="tcp://127.0.0.1:0")
    ctl = spawn_controller(
        engines_toml(("sec", eng.info["control"]),
                     extra=f'curve_server_key = "{pair["engine"][0]}"'),
        endpoint="tcp://127.0.0.1:0",
        controller_keys=f'curve_secret_key = "{pair["controller"][1]}"\n'
                        f'curve_clients = "{ctl_clients}"\n')
    ok = ["--curve-key", str(pair["operator"][1]), "--curve-server-key",
          str(pair["controller"][0])]
    out = ctl.ckptctl(*ok, "cycle", "sec", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["status"] == "succeeded"
    bad = ["--curve-key", str(pair["stranger"][1]), "--curve-server-key",
           str(pair["controller"][0])]
    with ThreadPoolExecutor(2) as pool:  # each waits out its retries: together, not in turn
        refused, plain = pool.map(lambda args: ctl.ckptctl(*args, "status"), [bad, []])
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert plain.returncode == 4, plain.stdout + plain.stderr
    ctl.stop()
    eng.stop()
    log = ctl.log_path.read_text()
    assert "refused a CURVE client" in log and \
        load(pair["stranger"][0], secret=False)[0].decode() in log
    secrets = [load(s, secret=True)[1].decode() for _, s in pair.values()]
    texts = [log, eng.log_path.read_text()]
    with sqlite3.connect(ctl.state_dir / "journal.sqlite3") as db:
        texts += [str(row) for row in db.execute("SELECT * FROM records")]
        texts += [str(row) for row in db.execute("SELECT op_id, params FROM operations")]
    for secret in secrets:
        assert not any(secret in t for t in texts)


def test_a_reading_subscriber_over_curve_outlives_zmq_heartbeats(keys, monkeypatch):
    """zmq's own heartbeats (``rpcserver.PEER_PING_S``) go encrypted over CURVE too: a
    subscriber that reads is answered past many silence limits and keeps its subscription."""
    import time

    import zmq

    from ckpt_controller import rpcserver
    from ckpt_controller.zmqutil import monitor_socket

    monkeypatch.setattr(rpcserver, "PEER_PING_S", 0.1)
    monkeypatch.setattr(rpcserver, "PEER_SILENCE_S", 0.5)
    pairs, clients = keys
    agent_pub, agent_secret = pairs["agent"]
    with Agent("pinged", control="tcp://127.0.0.1:0", heartbeat_interval_s=0.1,
               curve=CurveServer(agent_secret, clients)) as agent:
        with AgentClient(agent.endpoint, timeout_s=2.0,
                         curve=CurveClient(pairs["operator"][1], agent_pub)) as c:
            c.subscribe()
            drops = monitor_socket(c._sock, zmq.EVENT_DISCONNECTED)
            beats = 0
            end = time.monotonic() + 3  # six silence limits
            while time.monotonic() < end:
                beats += sum(isinstance(e, p.Heartbeat) for e in c.poll_events(0.2))
            assert not drops.poll(0), "the connection dropped: zmq's heartbeats went unanswered"
            c._sock.disable_monitor()
            drops.close(linger=0)
            assert len(agent._subscribers) == 1
            assert beats >= 15
            assert c.status().state == "running"


def _keyed_agent(pairs, clients, **kw):
    return Agent("secure", control="tcp://127.0.0.1:0", heartbeat_interval_s=0.1,
                 curve=CurveServer(pairs["agent"][1], clients), **kw)


def test_a_handshake_flood_never_keeps_an_admitted_client_out(keys, caplog):
    """3,000 handshakes with random keys at an agent admitting 1,001 keys: the operator is
    answered within a second all along and after, each handshake a set lookup (every key
    file was read for each: 88 s of nothing), and the refusals logged at a bounded rate."""
    import time

    import zmq

    pairs, clients = keys
    for i in range(1000):
        public, _ = zmq.curve_keypair()
        (clients / f"k{i:04d}.key").write_text(
            f"metadata\ncurve\n    public-key = \"{public.decode()}\"\n")
    caplog.set_level(logging.WARNING, logger="ckpt_controller.security")
    with _keyed_agent(pairs, clients) as agent:
        server = load(pairs["agent"][0], secret=False)[0]
        done = []

        def flood() -> None:
            ctx = zmq.Context()
            try:
                for _ in range(30):
                    socks = []
                    for _ in range(100):
                        s = ctx.socket(zmq.DEALER)
                        s.setsockopt(zmq.LINGER, 0)
                        public, secret = zmq.curve_keypair()
                        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = \
                            server, public, secret
                        s.connect(agent.endpoint)
                        socks.append(s)
                    time.sleep(0.05)
                    for s in socks:
                        s.close()
            finally:
                ctx.term()
                done.append(True)

        with ThreadPoolExecutor(1) as pool:
            flooding = pool.submit(flood)
            waits = []
            with AgentClient(agent.endpoint, timeout_s=5.0, retries=0,
                             curve=CurveClient(pairs["operator"][1], pairs["agent"][0])) as c:
                while not done or len(waits) < 5:
                    t0 = time.monotonic()
                    assert c.status().state == "running"
                    waits.append(time.monotonic() - t0)
                    time.sleep(0.05)
                    if len(waits) > 2000:
                        break
            flooding.result()
        # a new connection after the flood is admitted at once too
        with AgentClient(agent.endpoint, timeout_s=5.0, retries=0,
                         curve=CurveClient(pairs["operator"][1], pairs["agent"][0])) as c:
            t0 = time.monotonic()
            assert c.status().state == "running"
            waits.append(time.monotonic() - t0)
    assert max(waits) < 1.0, sorted(waits)[-5:]  # the issue's own bound, not scaled
    lines = [r.message for r in caplog.records if "refused" in r.message]
    assert 0 < len(lines) <= 5 * 10, len(lines)  # at most 5 a 10 s window, then a count


def test_the_allow_list_folder_and_its_files_are_checked(keys, caplog, tmp_path):
    """A folder others may write is refused at start, and found later admits nobody until
    put right; a key file others may write, a FIFO and an empty .key are each skipped and
    said once, never blocking, while the good keys still admit their clients."""
    pairs, clients = keys
    caplog.set_level(logging.WARNING, logger="ckpt_controller.security")
    clients.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        _keyed_agent(pairs, clients).start()
    clients.chmod(0o755)
    os.mkfifo(clients / "x.key")
    (clients / "zz.key").write_text("")
    loose = clients / "loose.key"
    loose.write_text(pairs["stranger"][0].read_text())
    loose.chmod(0o666)
    with _keyed_agent(pairs, clients) as agent:

        def status(who: str):
            with AgentClient(agent.endpoint, timeout_s=1.0, retries=0,
                             curve=CurveClient(pairs[who][1], pairs["agent"][0])) as c:
                return c.status()

        assert status("operator").state == "running"  # the FIFO and the empty file aside
        with pytest.raises(UnreachableError):
            status("stranger")  # its key file is writable by others: skipped
        said = [r.message for r in caplog.records if "skipped" in r.message]
        assert any("x.key" in m and "FIFO" in m for m in said), said
        assert any("zz.key" in m and "no CURVE public key" in m for m in said), said
        assert any("loose.key" in m and "writable by group or others" in m for m in said)
        assert status("operator").state == "running"
        assert len([r for r in caplog.records if "skipped" in r.message]) == len(said)
        clients.chmod(0o777)  # made unsafe while serving: nobody is admitted
        with pytest.raises(UnreachableError):
            status("operator")
        assert any("writable by group or others" in r.message and "refused" in r.message
                   for r in caplog.records)
        clients.chmod(0o755)
        (clients / "x.key").unlink()
        assert status("operator").state == "running"
