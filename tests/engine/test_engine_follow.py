"""Clients follow an engine: the reference engine answers a resend with the request's whole
output so far (or its end again), never a second run; ``EngineClient.move_to`` carries every
request without an end to another endpoint; a node publishes its engines' endpoints at its
``[fleet] address``; ``EngineClient.for_engine`` (and ``ckptctl generate|load --engine``)
finds an engine in etcd's registry and follows it when the registry names another endpoint.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import zmq

from ckpt_controller.agent import Agent, AgentClient
from ckpt_controller.engine import api
from ckpt_controller.engine.client import EngineClient
from ckpt_controller.endpoints import free_port
from ckpt_controller.engine.server import RecentEnds
from ckpt_controller.errors import (
    DamagedRecordError,
    ProtocolError,
    UnreachableError,
    UsageError,
)
from ckpt_controller.fleet.registry import published_endpoints, reachable_at
from ckpt_controller.fleet.registry import Resolver
from support.cli import ckptctl
from support.config import node_toml
from support.net import TcpCut
from support.processes import ControllerProcess
from support.timing import deadline_in, scaled, wait_until


@pytest.fixture
def engine(shared_engines):
    """The tiny model (seed 0), shared by this module's tests; each leaves it RUNNING."""
    return shared_engines("reference", "follow").get()


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _dealer(ctx: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
    """A client socket with a given identity: the same one again is a client reconnecting."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(endpoint)
    return sock


def _add(sock: zmq.Socket, rid: str, prompt: list[int], max_tokens: int,
         arrival_time: float = 0.0) -> None:
    """Send a request; the same arguments again are a resend of it (``arrival_time`` too)."""
    sock.send_multipart(api.encode(api.EngineRequestType.ADD.value, api.EngineRequest(
        request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
        arrival_time=arrival_time)))


def _read(sock: zmq.Socket, outs: dict[str, list], until, timeout_s: float = 60.0) -> None:
    """Take outputs into ``outs`` (request id -> outputs in order) until ``until(outs)``."""
    deadline = deadline_in(timeout_s)
    while not until(outs):
        assert time.monotonic() < deadline, "the outputs waited for never came"
        if sock.poll(100):
            msg = api.decode_reply(sock.recv_multipart())
            outs.setdefault(msg.request_id, []).append(msg)


def _ended(rid: str):
    return lambda outs: any(isinstance(o, api.RequestRejected) or o.finished
                            for o in outs.get(rid, ()))


def _tokens(rid: str, n: int):
    return lambda outs: sum(len(o.new_token_ids) for o in outs.get(rid, ())) >= n


def _streamed_after(outs: list[api.RequestOutput]) -> list[int]:
    """What a client has after a resend: the whole output the engine answered with (the first
    output carrying ``token_ids`` that is not the end), then every delta after it."""
    first = next(i for i, o in enumerate(outs) if o.token_ids is not None)
    got = list(outs[first].token_ids)
    for o in outs[first + 1:]:
        got.extend(o.new_token_ids)
    return got


def test_a_resend_gets_the_whole_output_or_the_end_and_never_a_second_run(engine, zctx):
    """One client reconnects with its identity and sends three requests again: one running,
    one kept by a PREPARED engine, one that ended. Each is answered with its whole output so
    far (the first two) or its end (the third), continues to its end with exactly the tokens
    of an uninterrupted run, and none is queued a second time."""
    ident = b"client-reattach-test"
    want = {}
    with EngineClient(engine.api) as ref:  # greedy decoding: the same prompt, the same tokens
        for rid, prompt, n in (("run", [5, 6, 7], 1000), ("kept", [8, 9], 1000),
                               ("ended", [4, 4], 10)):
            want[rid] = ref.generate(prompt, n).token_ids
    ctl = AgentClient(engine.control, timeout_s=30)
    try:
        first = _dealer(zctx, engine.api, ident)
        outs: dict[str, list] = {}
        _add(first, "ended", [4, 4], 10)
        _read(first, outs, _ended("ended"))
        _add(first, "run", [5, 6, 7], 1000)
        _read(first, outs, _tokens("run", 3))
        first.close()

        # running: the resend takes the stream over with the whole output so far
        again = _dealer(zctx, engine.api, ident)
        after: dict[str, list] = {}
        _add(again, "run", [5, 6, 7], 1000)
        _add(again, "ended", [4, 4], 10)
        _read(again, after, lambda o: _ended("run")(o) and _ended("ended")(o))
        whole = next(o for o in after["run"] if o.token_ids is not None)
        assert not whole.finished and 3 <= len(whole.token_ids) < 1000, \
            "the request ended before its resend reached the engine"
        end = after["run"][-1]
        assert end.token_ids == want["run"] and _streamed_after(after["run"]) == want["run"]
        # ended: its end again, the same as the first time
        assert [o.finished for o in after["ended"]] == [True]
        assert after["ended"][0].token_ids == outs["ended"][-1].token_ids == want["ended"]
        assert after["ended"][0].finish_reason == "length"
        # not a resend: another request under a held id is refused, under an ended one it is
        # new (``ckptctl load`` names its requests after its seed, run after run)
        other: dict[str, list] = {}
        _add(again, "x-held", [1, 2], 1000)
        _read(again, other, _tokens("x-held", 1))
        _add(again, "x-held", [1, 3], 1000)
        _read(again, other, lambda o: any(isinstance(m, api.RequestRejected)
                                          for m in o["x-held"]))
        refused = next(m for m in other["x-held"] if isinstance(m, api.RequestRejected))
        assert refused.kind == "UsageError" and "in use" in refused.message
        again.send_multipart(api.encode(api.EngineRequestType.ABORT.value,
                                        api.AbortRequest(request_ids=["x-held"])))
        _read(again, other, lambda o: any(isinstance(m, api.RequestOutput) and m.finished
                                          for m in o["x-held"]))
        _add(again, "ended", [4, 4], 10, arrival_time=1.0)
        _read(again, other, _ended("ended"))
        assert any(e.type == "queued" for o in other["ended"] for e in o.events)
        assert other["ended"][-1].token_ids == want["ended"]
        again.close()

        # kept: answered while the engine is PREPARED, then resumed by the restore
        third = _dealer(zctx, engine.api, ident)
        kept: dict[str, list] = {}
        _add(third, "kept", [8, 9], 1000)
        _read(third, kept, _tokens("kept", 3))
        assert ctl.prepare(drain="keep", level=2).drain.kept == 1
        third.close()
        fourth = _dealer(zctx, engine.api, ident)
        back: dict[str, list] = {}
        _add(fourth, "kept", [8, 9], 1000)
        # a token streamed just before the pause may still reach the new connection (the same
        # identity) ahead of the answer to the resend, which is the whole output
        _read(fourth, back, lambda o: any(m.token_ids is not None for m in o.get("kept", [])),
              timeout_s=10)
        held = next(m for m in back["kept"] if m.token_ids is not None)
        assert held.token_ids is not None and not held.finished and 3 <= len(held.token_ids)
        st = ctl.status()
        assert st.state == "prepared" and (st.in_flight, st.kept) == (0, 1)  # not admitted again
        ctl.restore()
        _read(fourth, back, _ended("kept"))
        assert back["kept"][-1].token_ids == want["kept"] == _streamed_after(back["kept"])
        fourth.close()
        for got in (after["run"], after["ended"], back["kept"]):  # no second run anywhere
            assert all(e.type != "queued" for o in got for e in o.events)
        assert ctl.status().in_flight == 0
    finally:
        ctl.close()


def test_a_client_that_came_back_is_answered_in_the_middle_of_a_step(tmp_path, ipc_dir,
                                                                     zctx):
    """The API thread answers a resend of a held request itself, at once, while the
    scheduler is busy (a long prefill after a restore, say: here a command holding it), with
    the whole output so far, even while the engine is full; the tokens after it follow in
    order, none twice, none missed."""
    import threading

    from ckpt_controller.engine.server import EngineOptions, ReferenceEngine

    eng = ReferenceEngine(EngineOptions(name="back", api=f"ipc://{ipc_dir}/back.api",
                                        control=f"ipc://{ipc_dir}/back.ctl",
                                        model_dir=tmp_path, max_batch=1,
                                        max_waiting=1)).start()
    busy, release = threading.Event(), threading.Event()
    socks: list[zmq.Socket] = []
    try:
        want = eng.model.reference_tokens([5, 6, 7], 60)
        ident = b"client-back-mid-step"
        first = _dealer(zctx, eng.api_endpoint, ident)
        socks.append(first)
        outs: dict[str, list] = {}
        _add(first, "r", [5, 6, 7], 60)
        _read(first, outs, _tokens("r", 5))
        eng.scheduler.submit(lambda: (busy.set(), release.wait(scaled(60))))
        assert busy.wait(scaled(10))
        _add(first, "w", [3, 3], 1)  # on its way in: the engine holds 2 of its 2 now
        _add(first, "full", [3, 4], 1)
        _read(first, outs, lambda o: any(isinstance(m, api.RequestRejected)
                                         for m in o.get("full", [])))
        assert next(m for m in outs["full"] if isinstance(m, api.RequestRejected)).kind \
            == "OverloadedError"
        first.close()
        again = _dealer(zctx, eng.api_endpoint, ident)
        socks.append(again)
        after: dict[str, list] = {}
        _add(again, "r", [5, 6, 7], 60)
        _read(again, after, lambda o: any(m.token_ids is not None for m in o.get("r", [])),
              timeout_s=10)
        assert not release.is_set()  # answered while the scheduler was still held
        whole = next(m for m in after["r"] if m.token_ids is not None)
        assert 5 <= len(whole.token_ids) < 60 and not whole.finished
        assert whole.token_ids == want[:len(whole.token_ids)]
        release.set()
        _read(again, after, _ended("r"))
        assert after["r"][-1].token_ids == want == _streamed_after(after["r"])
        # another request under the held id is still refused, at once
        _add(again, "s", [1, 2], 1000)
        _read(again, after, _tokens("s", 1))
        _add(again, "s", [1, 3], 1000)
        _read(again, after, lambda o: any(isinstance(m, api.RequestRejected) for m in o["s"]))
    finally:
        for sock in socks:
            sock.close(linger=0)
        release.set()
        eng.stop()


def test_recent_ends_are_bounded_in_count_and_age():
    now = [0.0]
    ends = RecentEnds(max_count=3, max_age_s=10.0, clock=lambda: now[0])
    for i in range(5):
        ends.put(f"r{i}", i, [b"x", str(i).encode()])
    assert len(ends) == 3 and ends.get("r0", 0) is None and ends.get("r4", 4) == [b"x", b"4"]
    assert ends.get("r4", 5) is None  # another request under that id: not its end
    now[0] = 10.5
    assert ends.get("r4", 4) is None  # too old to answer
    ends.put("r5", 5, [b"x", b"5"])
    assert len(ends) == 1 and ends.get("r5", 5) == [b"x", b"5"]


def test_move_to_follows_an_engine_restarted_on_another_port(spawn_reference, engine):
    """The engine stops with requests in flight and starts again on another port; the client
    moves there with the same identity and sends them again: each ends with exactly the
    tokens of an uninterrupted run (the new process runs them from the start)."""
    prompts = [[i, 3, 5] for i in range(4)]
    with EngineClient(engine.api) as ref:
        want = [ref.generate(pr, 600).token_ids for pr in prompts]
    before = spawn_reference("mv1", api="tcp://127.0.0.1:0")
    c = EngineClient(before.info["api"])
    try:
        identity = c.identity
        ids = [c.submit(pr, 600) for pr in prompts]
        while not all(c.requests[i].token_ids for i in ids):
            c.poll(0.1)
        before.stop()
        after = spawn_reference("mv2", api="tcp://127.0.0.1:0")
        assert after.info["api"] != before.info["api"]
        assert sorted(c.move_to(after.info["api"])) == sorted(ids)
        assert c.identity == identity and c.endpoint == after.info["api"]
        deadline = deadline_in(120)
        while not all(c.requests[i].ended for i in ids):
            assert time.monotonic() < deadline, "requests never ended after the move"
            c.poll(0.2)
        assert [c.requests[i].token_ids for i in ids] == want
        assert all(c.requests[i].finish_reason == "length" and not c.requests[i].repaired
                   for i in ids)
    finally:
        c.close()


def test_a_request_that_ended_while_its_client_was_cut_off_is_asked_for_again(
        spawn_reference):
    """An engine kept a heard request (a prepare, ``keep``), its client's link was reset
    (as a CRIU dump that stops the engine resets it), and the engine, resumed, ended the
    request while the client was still away: the end went with the old connection. Once the
    client is connected again it asks for every request without an end, heard or not, and
    gets the end (``RecentEnds``) with exactly the tokens of an uninterrupted run."""
    port = free_port()
    eng = spawn_reference("cutoff", api=f"tcp://127.0.0.1:{port}")
    prompt = [5, 8, 13, 2]
    with EngineClient(eng.api) as ref:  # long enough to be in flight at the prepare on a
        want = ref.generate(prompt, 1500).token_ids  # busy host (300 once ended before it)
    link = TcpCut(("127.0.0.1", port))
    ctl = AgentClient(eng.control, timeout_s=30)
    try:
        with EngineClient(link.endpoint) as client:
            c = client.requests[client.submit(prompt, 1500)]
            while not c.token_ids:
                client.poll(0.1)
            assert ctl.prepare(drain="keep", level=0).drain.kept == 1
            link.cut()
            ctl.restore()
            wait_until(lambda: not ctl.status().in_flight, 30, "the request ended unheard")
            assert not c.ended
            link.mend()
            deadline = deadline_in(30)
            while not c.ended:
                assert time.monotonic() < deadline, "the end never reached the client"
                client.poll(0.1)
            assert c.finish_reason == "length" and c.token_ids == want
            assert client.reconnects == 1
    finally:
        ctl.close()
        link.close()


def test_wildcard_hosts_are_published_at_the_node_address():
    assert reachable_at("tcp://0.0.0.0:5557", "169.254.77.2") == "tcp://169.254.77.2:5557"
    assert reachable_at("tcp://*:5557", "gpu-node-17") == "tcp://gpu-node-17:5557"
    assert reachable_at("tcp://[::]:5557", "fd00::2") == "tcp://[fd00::2]:5557"
    assert reachable_at("tcp://10.0.0.3:5557", "x") == "tcp://10.0.0.3:5557"
    assert reachable_at("ipc:///run/ckpt/a.api", "x") == "ipc:///run/ckpt/a.api"
    # a vLLM sidecar's http endpoint too, its path kept
    assert reachable_at("http://0.0.0.0:8000", "169.254.77.2") == "http://169.254.77.2:8000"
    assert reachable_at("https://[::]:8443/v1", "fd00::2") == "https://[fd00::2]:8443/v1"
    assert reachable_at("http://10.0.0.3:8000", "x") == "http://10.0.0.3:8000"
    assert published_endpoints({"api": "tcp://0.0.0.0:1"}, "ipc:///c", "n1") == {
        "api": "tcp://n1:1", "control": "ipc:///c"}
    assert published_endpoints({"control": "tcp://*:2"}, "ipc:///c", "n1") == {
        "control": "tcp://n1:2"}


# ---------------------------------------------------------------- through etcd (fleet)


def _record(etcd, name: str, endpoints: dict[str, str], node: str = "n1") -> None:
    from ckpt_controller.fleet.etcd import Etcd
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.records import EngineRecord, encode

    with Etcd(etcd.urls) as store:
        store.put(Keys("/ckpt").engine(name), encode(EngineRecord(
            engine=name, node=node, state="running", endpoints=endpoints)))


@pytest.mark.fleet
def test_a_node_publishes_its_engines_endpoints_at_its_address(etcd, ipc_dir):
    """An agent that reports an api endpoint bound to 0.0.0.0: its record in etcd names the
    node's ``[fleet] address`` instead, and the control endpoint as the agent has it."""
    from ckpt_controller.fleet.etcd import Etcd
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.records import EngineRecord, decode

    agent = Agent("pub", control=f"ipc://{ipc_dir}/pub.ctl", heartbeat_interval_s=0.2,
                  endpoints={"api": "tcp://0.0.0.0:5599"}).start()
    d = ipc_dir / "n1"
    d.mkdir()
    # an address of this host's (a node's address must be its own), not the agent's
    ctl = ControllerProcess(d, node_toml(etcd, "n1", [agent], address="127.0.0.2"))
    try:
        with Etcd(etcd.urls) as store:
            rec = wait_until(lambda: (kv := store.get(Keys("/ckpt").engine("pub")))
                             and decode(EngineRecord, kv.value, kv.key), what="the engine's record")
        assert rec.endpoints == {"api": "tcp://127.0.0.2:5599", "control": agent.endpoint}
        assert rec.pid == os.getpid()
    finally:
        ctl.stop()
        agent.close()


@pytest.mark.fleet
def test_a_client_follows_an_engine_through_the_registry(etcd, engine, spawn_reference):
    """``for_engine`` reads the engine's api endpoint from etcd; the engine goes silent (kept
    by a prepare) and the registry names another endpoint: the client moves there and its
    requests end with exactly the tokens of an uninterrupted run."""
    other = spawn_reference("fl2")
    prompts = [[i, 11, 2] for i in range(3)]
    with EngineClient(engine.api) as ref:
        want = [ref.generate(pr, 500).token_ids for pr in prompts]
    _record(etcd, "llama-f", {"api": engine.api, "control": engine.control})
    c = EngineClient.for_engine("llama-f", Resolver(",".join(etcd.urls)), follow_after_s=0.5)
    ctl = AgentClient(engine.control, timeout_s=30)
    try:
        assert c.endpoint == engine.api and c.engine == "llama-f"
        ids = [c.submit(pr, 500) for pr in prompts]
        while not all(c.requests[i].token_ids for i in ids):
            c.poll(0.1)
        assert ctl.prepare(drain="keep", level=2).drain.kept == len(ids)
        _record(etcd, "llama-f", {"api": other.api, "control": other.control}, node="n2")
        deadline = deadline_in(120)
        while not all(c.requests[i].ended for i in ids):
            assert time.monotonic() < deadline, "requests never ended after the move"
            c.poll(0.2)
        assert c.moves == [other.api]
        assert [c.requests[i].token_ids for i in ids] == want
    finally:
        c.close()
        ctl.restore()  # the kept requests end there, unheard: the shared engine goes on
        ctl.close()


@pytest.mark.fleet
def test_a_client_moves_when_the_watched_record_changes_not_after_a_silence(
        etcd, engine, spawn_reference):
    """The resolver's watch wakes the client: with a silence of ten minutes needed to look
    again, an idle client moves as soon as the record names another endpoint, and one blocked
    in a long ``poll`` on a silent engine (kept by a prepare) moves within that same call and
    hears from the new engine before the call ends (without the watch: ten minutes)."""
    other = spawn_reference("fl3")
    _record(etcd, "llama-w", {"api": other.api, "control": other.control}, node="n2")
    c = EngineClient.for_engine("llama-w", Resolver(",".join(etcd.urls)), follow_after_s=600)
    ctl = AgentClient(engine.control, timeout_s=30)
    prepared = None
    try:
        assert c.endpoint == other.api
        _record(etcd, "llama-w", {"api": engine.api, "control": engine.control})
        wait_until(lambda: c.poll(0.05) is not None and c.moves == [engine.api],
                   what="the idle client on the endpoint the record names now")
        with EngineClient(engine.api) as ref:
            want = ref.generate([3, 1, 4], 300).token_ids
        rid = c.submit([3, 1, 4], 300)
        while not c.requests[rid].token_ids:
            c.poll(0.1)
        prepared = ctl.prepare(drain="keep", level=2)
        assert prepared.drain.kept == 1  # silent from now on
        _record(etcd, "llama-w", {"api": other.api, "control": other.control}, node="n2")
        c.poll(600)  # one call: woken by the watch, moved, answered there (it ran anew)
        assert c.moves == [engine.api, other.api]
        assert c.requests[rid].heard
        deadline = deadline_in(120)
        while not c.requests[rid].ended:
            assert time.monotonic() < deadline, "the request never ended after the move"
            c.poll(0.2)
        assert c.requests[rid].token_ids == want
    finally:
        c.close()
        if prepared is not None:  # the kept request ends there, unheard: it goes on
            ctl.restore()
        ctl.close()


@pytest.mark.fleet
def test_following_an_engine_says_what_is_wrong_and_the_cli_follows_too(etcd, engine):
    """Typed errors for an engine not in the registry, one without an api endpoint, a
    damaged record and etcd unavailable (exit 2, 2, 2 and 4 from ckptctl); ``generate`` and
    ``load`` reach an engine by name."""
    from support import etcd_cluster

    from ckpt_controller.fleet.etcd import Etcd
    from ckpt_controller.fleet.keys import Keys

    urls = ",".join(etcd.urls)
    with pytest.raises(UsageError, match="not in the fleet's registry"):
        EngineClient.for_engine("nobody", Resolver(urls))
    _record(etcd, "ctl-only", {"control": "ipc:///x.ctl"})
    with pytest.raises(UsageError, match="publishes no api endpoint") as info:
        EngineClient.for_engine("ctl-only", Resolver(urls))
    assert info.value.details["published"] == ["control"]
    with Etcd(etcd.urls) as store:
        store.put(Keys("/ckpt").engine("damaged"), b"{not json")
    with pytest.raises(ProtocolError, match="cannot be read") as info:
        EngineClient.for_engine("damaged", Resolver(urls))
    assert isinstance(info.value, DamagedRecordError)
    assert info.value.details["key"] == "/ckpt/engines/damaged"
    away = f"http://127.0.0.1:{etcd_cluster.free_port()}"
    with pytest.raises(UnreachableError):
        EngineClient.for_engine("nobody", Resolver(away, timeout_s=0.5))

    _record(etcd, "by-name", {"api": engine.api, "control": engine.control})
    with EngineClient(engine.api) as ref:
        want = ref.generate([1, 2, 3], 20).token_ids
    r = ckptctl("generate", "--engine", "by-name", "--etcd", urls, "--prompt-ids", "1,2,3",
                "--max-tokens", "20", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == want
    r = ckptctl("--etcd", urls, "load", "--engine", "by-name", "--rate", "20", "--duration",
                "0.5", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["completed"] == 10
    for name, code in (("nobody", 2), ("ctl-only", 2), ("damaged", 2)):
        r = ckptctl("generate", "--engine", name, "--etcd", urls, "--prompt-ids", "1",
                    "--max-tokens", "2")
        assert r.returncode == code and name in r.stderr, (name, r.returncode, r.stderr)
    r = ckptctl("generate", "--engine", "by-name", "--etcd", away, "--prompt-ids", "1",
                "--max-tokens", "2")
    assert r.returncode == 4 and "UnreachableError" in r.stderr
