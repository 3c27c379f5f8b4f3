"""The agent over real ZMQ sockets, in this process: framing errors, one operation at a
time, repeated operation ids, heartbeats, restore detection, the gate."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
import zmq

from ckpt_controller import protocol as p
from ckpt_controller.agent import Agent, AgentClient, EngineHooks
from ckpt_controller.agent.failpoints import POINTS as FAILPOINTS
from ckpt_controller.agent.incarnation import Fingerprint, IncarnationTracker
from ckpt_controller.agent.operations import PREPARE_STEPS, RESTORE_STEPS
from ckpt_controller.errors import (
    BusyError,
    DeadlineError,
    DrainError,
    EngineError,
    InvalidTransitionError,
    RejectedError,
    UnreachableError,
    UsageError,
)
from ckpt_controller.lifecycle import TRANSITIONS
from ckpt_controller.vocab import PrepareStep, RestoreStep, Trigger
from support.timing import deadline_in, scaled


class SlowPause(EngineHooks):
    """Pausing blocks until the test lets it go: holds an operation open."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def pause_scheduling(self) -> None:
        self.entered.set()
        assert self.release.wait(scaled(10))


@pytest.fixture
def agent(ipc_dir):
    hooks = SlowPause()
    hooks.release.set()
    a = Agent("unit", hooks=hooks, control=f"ipc://{ipc_dir}/unit.ctl", heartbeat_interval_s=0.05)
    a.start()
    yield a
    a.close()


@pytest.fixture
def client(agent):
    c = AgentClient(agent.endpoint, timeout_s=3, heartbeat_interval_s=0.05)
    yield c
    c.close()


def raw(agent, frames: list[bytes], timeout_ms: int = 3000):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(agent.endpoint)
    try:
        s.send_multipart(frames)
        assert s.poll(timeout_ms), "agent did not answer"
        return p.decode_reply(s.recv_multipart())
    finally:
        s.close()


BAD_FRAMES = {
    "one frame": [b"\x01"],
    "three frames": [b"\x01", b"", b""],
    "not msgpack": [p.RequestType.STATUS.value, b"\xc1\xc1"],
    "truncated": [p.RequestType.PREPARE.value,
                  p.encode(p.PrepareCommand(call_id=4, op_id="abc"))[:-3]],
    "unknown type": [b"\x7f", p.encode(p.StatusCommand(call_id=11))],
    "two-byte type": [b"\x01\x01", p.encode(p.StatusCommand(call_id=12))],
    "wrong version": [p.RequestType.STATUS.value, p.encode(p.StatusCommand(call_id=13, version=99))],
    "bad field": [p.RequestType.PREPARE.value,
                  msgspec.msgpack.encode({"call_id": 14, "version": 1, "op_id": 5})],
    "oversized": [p.RequestType.STATUS.value, b"\x00" * (p.MAX_PAYLOAD_BYTES + 10)],
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_bad_frames_get_typed_errors_and_the_agent_keeps_serving(agent, client, case):
    reply = raw(agent, BAD_FRAMES[case])
    assert isinstance(reply, p.ErrorReply)
    assert reply.kind in {"ProtocolError", "VersionMismatchError"}
    if case in {"unknown type", "two-byte type", "wrong version", "bad field"}:
        assert reply.call_id == {"unknown type": 11, "two-byte type": 12, "wrong version": 13,
                                 "bad field": 14}[case]
    assert client.status().state == "running"


def test_frame_over_hard_limit_is_dropped_and_agent_serves(agent, client):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(agent.endpoint)
    s.send_multipart([p.RequestType.STATUS.value, b"\x00" * (p.HARD_MAX_MESSAGE_BYTES + 1)])
    assert not s.poll(300)  # zmq disconnects the sender; no reply is possible
    s.close()
    assert client.status().state == "running"


def test_handshake_status_heartbeat(agent, client):
    hs = client.handshake()
    assert (hs.protocol_version, hs.engine, hs.state) == (p.PROTOCOL_VERSION, "unit", "running")
    st = client.status()
    assert st.state == "running" and st.is_restored and st.generation == 0 and st.in_flight == 0
    assert client.heartbeat().state == "running"


def test_invalid_trigger_over_the_wire_changes_nothing(client):
    with pytest.raises(InvalidTransitionError) as info:
        client.restore()
    assert info.value.details["state"] == "running"
    assert info.value.details["allowed"] == ["prepare", "fail"]
    assert client.status().state == "running"


def test_bad_prepare_arguments_move_nothing(client):
    with pytest.raises(UsageError):
        client.prepare(level=3)
    with pytest.raises(UsageError):
        client.prepare(level=1, tags=["weights"])
    with pytest.raises(UsageError):
        client.prepare(level=None, tags=["nope"])
    assert client.status().state == "running"


def test_heartbeats_flow_during_a_long_operation(ipc_dir):
    hooks = SlowPause()
    with Agent("beats", hooks=hooks, control=f"ipc://{ipc_dir}/b.ctl",
               heartbeat_interval_s=0.05) as a:
        ops = AgentClient(a.endpoint, timeout_s=5)
        watcher = AgentClient(a.endpoint, timeout_s=5)
        watcher.subscribe()
        result = {}
        t = threading.Thread(target=lambda: result.update(r=ops.prepare(op_id="long", level=0)))
        t.start()
        assert hooks.entered.wait(scaled(5))
        watcher.poll_events(0.05)  # drop beats from before the operation
        beats = [e for e in watcher.poll_events(0.5) if isinstance(e, p.Heartbeat)]
        if not (len(beats) >= 4 and all(b.state == "preparing" for b in beats)):
            hooks.release.set()
            pytest.fail(f"expected steady heartbeats while preparing, got {beats}")
        assert [b.seq for b in beats] == sorted(b.seq for b in beats)
        # a second, different operation is refused with the holder's id
        with pytest.raises(BusyError) as info:
            watcher.rollback()
        assert info.value.details["holder"] == "long"
        assert watcher.status().current_op == "long"
        # the same op id again waits for the first run instead of starting another
        again = {}
        t2 = threading.Thread(target=lambda: again.update(r=watcher.prepare(op_id="long", level=0)))
        t2.start()
        time.sleep(0.2)
        hooks.release.set()
        t.join(scaled(5))
        t2.join(scaled(5))
        assert result["r"] == again["r"] and result["r"].state == "prepared"
        # and once done, returns the stored result without running again
        assert watcher.prepare(op_id="long", level=0) == result["r"]
        assert len([h for h in a.lifecycle.history if h.trigger == "prepare"]) == 1
        ops.close()
        watcher.close()


def test_dead_agent_is_unreachable_promptly(ipc_dir):
    a = Agent("dies", control=f"ipc://{ipc_dir}/d.ctl", heartbeat_interval_s=0.05).start()
    c = AgentClient(a.endpoint, timeout_s=0.3, retries=1)
    assert c.status().state == "running"
    a.close()
    start = time.monotonic()
    with pytest.raises(UnreachableError) as info:
        c.status()
    assert time.monotonic() - start < scaled(2)
    assert info.value.details["attempts"] == 2 and info.value.exit_code == 4
    c.close()


def test_a_slow_but_alive_agent_is_a_deadline_not_a_lost_peer(ipc_dir):
    """A client that follows heartbeats tells the two apart: an agent that beats but does
    not answer in time gives DeadlineError (exit 3), not UnreachableError, and is not
    resent to; the operation goes on and ends on its own."""
    hooks = SlowPause()
    with Agent("slow", hooks=hooks, control=f"ipc://{ipc_dir}/slow.ctl",
               heartbeat_interval_s=0.05) as a:
        c = AgentClient(a.endpoint, timeout_s=3, retries=2)
        c.subscribe()
        start = time.monotonic()
        with pytest.raises(DeadlineError) as info:
            c.prepare(op_id="slow", level=0, timeout_s=0.4)
        assert info.value.exit_code == 3 and "alive" in info.value.message
        assert time.monotonic() - start < scaled(1.5, below=3)  # one timeout, not the client's
        assert hooks.entered.is_set()
        hooks.release.set()
        end = deadline_in(5)
        while c.status().state != "prepared" and time.monotonic() < end:
            time.sleep(0.02)
        assert c.status().state == "prepared"
        assert len([h for h in a.lifecycle.history if h.trigger == "prepare"]) == 1
        c.close()


def test_a_late_reply_to_an_earlier_call_is_not_taken_for_the_next_one(agent):
    """After a call timed out, its reply may still arrive; the next call must get its own."""
    c = AgentClient(agent.endpoint, timeout_s=2)
    c._sock.send_multipart(p.command_frames(p.RequestType.HEARTBEAT,
                                            p.HeartbeatCommand(call_id=10_000)))
    time.sleep(0.2)  # that reply is now waiting on the socket, with an older call id
    hs = c.handshake()
    assert isinstance(hs, p.HandshakeReply) and hs.engine == "unit"
    c.close()


def _changes(events: list) -> list[tuple[str, str | None]]:
    return [(e.transition.dest, e.op_id) for e in events if isinstance(e, p.StateChanged)]


def test_state_events_carry_the_operation(agent, client):
    watcher = AgentClient(agent.endpoint, timeout_s=3, heartbeat_interval_s=0.05)
    watcher.subscribe()
    client.subscribe()
    prepared = client.prepare(op_id="op-7", level=0)
    restored = client.restore(op_id="op-8")
    # the replies list every transition of their operation
    assert [t.dest for t in prepared.transitions] == ["preparing", "prepared"]
    assert [t.dest for t in restored.transitions] == ["restoring", "running"]
    # operations this quick sent their caller none as events: their replies list them all
    # (the transition that begins one goes to its callers only once it runs LIVE_HOLD_S)
    events = client.poll_events(0.3)
    assert _changes(events) == []
    # so did the release's memory report
    assert prepared.memory.action == "release"
    assert not any(isinstance(e, p.MemoryReported) for e in events)
    # every other subscriber gets all of them as events
    seen = watcher.poll_events(0.3)
    assert _changes(seen) == [("preparing", "op-7"), ("prepared", "op-7"),
                              ("restoring", "op-8"), ("running", "op-8")]
    assert any(isinstance(e, p.MemoryReported) and e.op_id == "op-7" for e in seen)
    watcher.close()


class GoldenDiffers(EngineHooks):
    def verify(self) -> None:
        raise EngineError("golden prompt differs")


def test_an_operation_that_fails_sends_its_final_transition_as_an_event(ipc_dir):
    """An error reply lists no transitions: the caller gets the one that ended the failed
    operation as an event, before the error."""
    import torch

    from ckpt_controller.memory import MemoryRegistry

    memory = MemoryRegistry()
    memory.register("weights", {"w": torch.ones(4096)})
    with Agent("fv", hooks=GoldenDiffers(), memory=memory, control=f"ipc://{ipc_dir}/fv.ctl",
               heartbeat_interval_s=0.05) as a, \
            AgentClient(a.endpoint, timeout_s=3, heartbeat_interval_s=0.05) as c:
        c.subscribe()
        prepared = c.prepare(op_id="fv-1", level=1)
        with pytest.raises(EngineError, match="golden prompt differs"):
            c.restore(op_id="fv-2")  # the weights came back, then the engine's check failed
        events = c.poll_events(0.3)
        got = _changes(events)
        # the prepare's transitions came in its reply; the one that ended it never as an
        # event, the one that began it also as an event when the prepare still ran
        # LIVE_HOLD_S (20 ms) after it (docs/agent.md): a few ms here, but on a loaded
        # machine its thread can wait longer than that for a CPU
        assert [t.dest for t in prepared.transitions] == ["preparing", "prepared"]
        assert got[:-2] in ([], [("preparing", "fv-1")])
        # the failed restore's both as events (the one that began it too, held for the reply
        # until then), before the error
        assert got[-2:] == [("restoring", "fv-2"), ("failed", "fv-2")]
        assert c.status().state == "failed"
        reports = [e for e in events if isinstance(e, p.MemoryReported)]
        assert [(r.op_id, r.report.action) for r in reports] == [("fv-2", "rewake")]


def test_restore_detection_from_fingerprint(ipc_dir):
    prints = iter([Fingerprint("boot", 10, 100)] * 3 + [Fingerprint("boot", 10, 999)] * 100)
    tracker = IncarnationTracker(lambda: next(prints))
    with Agent("inc", control=f"ipc://{ipc_dir}/i.ctl", heartbeat_interval_s=0.02,
               incarnation=tracker) as a:
        c = AgentClient(a.endpoint)
        deadline = deadline_in(5)
        while not c.status().restored_from_image and time.monotonic() < deadline:
            time.sleep(0.02)
        st = c.status()
        assert st.restored_from_image and st.incarnation == 1
        assert c.handshake().incarnation == 1
        c.close()


def test_a_fingerprint_that_cannot_be_read_is_no_restore(ipc_dir):
    """Out of descriptors (thousands of connections held), /proc/self/stat cannot be opened:
    that is "unknown", never a new incarnation (the agent counted 8 and 18 restores that never
    happened); the real fingerprint read in a process out of descriptors says so too."""
    import errno
    import resource

    from ckpt_controller.agent import incarnation

    good = Fingerprint("boot", 10, 100)
    prints = iter([good, None, good, None, None, good] + [good] * 100)
    tracker = IncarnationTracker(lambda: next(prints))
    for _ in range(6):
        assert tracker.check() is False
    assert tracker.incarnation == 0
    starts_unknown = IncarnationTracker(iter([None, good, good]).__next__)
    assert starts_unknown.check() is False and starts_unknown.incarnation == 0
    # the real reader, with no descriptor left: None, not a fingerprint of zeros
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as err:
            assert err.errno == errno.EMFILE
        assert incarnation.current_fingerprint() is None
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert incarnation.current_fingerprint() is not None
    with Agent("fd", control=f"ipc://{ipc_dir}/fd.ctl", heartbeat_interval_s=0.02,
               incarnation=IncarnationTracker(iter([good] + [None, good] * 500).__next__)) as a:
        with AgentClient(a.endpoint) as c:
            time.sleep(0.3)  # ticks that read nothing, and the same fingerprint between
            st = c.status()
    assert not st.restored_from_image and st.incarnation == 0


def test_status_reports_the_endpoints_and_the_host_pid_again_after_a_restore(
        ipc_dir, monkeypatch):
    """``status`` names the agent's control endpoint and the engine's others; ``pid`` is read
    again when the process finds itself restored from an image (a restore gives another PID)."""
    import ckpt_controller.agent.server as agent_server

    restored = threading.Event()  # the image is "restored" only once host_pid is patched
    tracker = IncarnationTracker(
        lambda: Fingerprint("boot", 10, 999 if restored.is_set() else 100))
    with Agent("eps", control=f"ipc://{ipc_dir}/eps.ctl", heartbeat_interval_s=0.02,
               incarnation=tracker, endpoints={"api": "tcp://0.0.0.0:5999"}) as a, \
            AgentClient(a.endpoint) as c:
        st = c.status()
        assert st.endpoints == {"api": "tcp://0.0.0.0:5999", "control": a.endpoint}
        assert st.pid == os.getpid()  # no PID namespace of its own here: the same
        assert not st.restored_from_image
        monkeypatch.setattr(agent_server, "host_pid", lambda: 4242)  # what a restore gives
        restored.set()
        deadline = deadline_in(5)
        while not c.status().restored_from_image and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.status().pid == 4242 and c.handshake().pid == 4242


def test_the_status_of_an_old_agent_without_endpoints_still_decodes():
    """The wire stays compatible: a ``StatusReply`` from an agent before ``endpoints``."""
    old = {"type": "StatusReply", "engine": "e", "pid": 7, "state": "running",
           "is_restored": True, "generation": 0, "in_flight": 0, "kept": 0,
           "released_tags": [], "registered_bytes": {}, "incarnation": 0,
           "restored_from_image": False}
    frames = [p.ReplyType.REPLY.value, msgspec.msgpack.encode({"call_id": 1, "result": old})]
    reply = p.decode_reply(frames)
    assert reply.result.pid == 7 and reply.result.endpoints == {}


def test_host_pid_in_a_pid_namespace_of_its_own(tmp_path):
    """Under ``unshare --pid --fork`` a process is PID 1 to itself; ``host_pid`` gives the PID
    the host knows it by (``NSpid``'s first field, /proc being the host's)."""
    import shutil
    import subprocess
    import sys

    import psutil

    from ckpt_controller.agent.incarnation import host_pid, parse_nspid

    assert parse_nspid(b"Name:\tx\nNSpid:\t812\t1\n") == 812
    assert parse_nspid(b"Name:\tx\n") is None
    assert host_pid() == os.getpid()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a PID namespace needs root and unshare")
    marker = str(tmp_path / "nspid-marker")
    code = ("import os, sys; from ckpt_controller.agent.incarnation import host_pid; "
            "print(os.getpid(), host_pid(), flush=True); sys.stdin.read()")
    with subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", code, marker],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            inside, host = map(int, proc.stdout.readline().split())
            assert inside == 1
            assert marker in " ".join(psutil.Process(host).cmdline())
        finally:
            proc.stdin.close()
            proc.wait(timeout=scaled(10))


def test_real_fingerprint_is_stable_in_one_process():
    t = IncarnationTracker()
    assert not t.check() and not t.restored_from_image


def test_engine_without_abort_support_rolls_back(agent, client):
    agent.gate.admit("r1")
    with pytest.raises(EngineError) as info:
        client.prepare(drain="abort", level=0)
    assert info.value.details["state"] == "running" and info.value.details["rolled_back"]
    agent.gate.finish("r1", "stop")


def test_wait_with_fail_escalation_rolls_back_and_requests_go_on(agent, client):
    agent.gate.admit("slow")
    with pytest.raises(DrainError) as info:
        client.prepare(drain="wait", drain_timeout_s=0.1, on_deadline="fail", level=0)
    assert info.value.details["rolled_back"] and info.value.details["in_flight"] == 1
    assert client.status().state == "running"
    agent.gate.finish("slow", "stop")  # the request was never disturbed
    assert agent.gate.totals.ended["stop"] == 1


def test_a_wait_drain_past_the_operations_deadline_fails_and_does_not_escalate(agent, client):
    """The operation's deadline (0.2 s) comes before the drain's (30 s): exit 3, rolled back,
    and the request is not aborted although the caller chose ``abort`` at the drain's."""
    agent.gate.admit("slow")
    with pytest.raises(DeadlineError) as info:
        client.prepare(drain="wait", drain_timeout_s=30, on_deadline="abort", deadline_s=0.2,
                       level=0)
    assert info.value.exit_code == 3 and info.value.details["rolled_back"]
    assert info.value.details["step"] == "drain" and info.value.details["engine"] == "unit"
    assert client.status().state == "running"
    agent.gate.finish("slow", "stop")
    assert agent.gate.totals.ended["stop"] == 1 and agent.gate.totals.ended["abort"] == 0


def test_gate_rejects_unless_running(agent, client):
    hooks = agent.operations.hooks
    hooks.release.clear()
    hooks.entered.clear()
    t = threading.Thread(target=lambda: client.prepare(op_id="g", level=0))
    t.start()
    assert hooks.entered.wait(scaled(5))
    start = time.monotonic()
    with pytest.raises(RejectedError) as info:
        agent.gate.admit("late")
    # at once: it waits neither for the operation (held until release is set) nor for the
    # 1 s it hints at (0.05 s, the bound before, is within a busy machine's pause of a thread)
    assert time.monotonic() - start < scaled(0.5, below=1.0)
    assert info.value.details == {"engine": "unit", "state": "preparing", "retry_after_s": 1.0}
    assert info.value.retryable
    hooks.release.set()
    t.join(scaled(5))
    with pytest.raises(RejectedError, match="prepared"):
        agent.gate.admit("late")
    with pytest.raises(UsageError):
        agent.gate.finish("never-admitted", "stop")
    with pytest.raises(UsageError):
        agent.gate.finish("x", "exploded")


def test_tcp_endpoint_with_an_ephemeral_port(ipc_dir):
    with Agent("tcp", control="tcp://127.0.0.1:0") as a:
        assert a.endpoint.startswith("tcp://127.0.0.1:") and not a.endpoint.endswith(":0")
        with AgentClient(a.endpoint) as c:
            assert c.status().engine == "tcp"


def test_ipc_socket_file_is_private(ipc_dir):
    import os
    import stat

    with Agent("priv", control=f"ipc://{ipc_dir}/priv.ctl") as a:
        mode = stat.S_IMODE(os.stat(a.endpoint[len("ipc://"):]).st_mode)
        assert mode == 0o600


def test_default_endpoint_lives_in_a_private_runtime_dir(tmp_path, monkeypatch):
    import os
    import stat

    from ckpt_controller.endpoints import default_endpoint
    from ckpt_controller.errors import ConfigError

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    ep = default_endpoint("engine-a")
    assert ep == f"ipc://{tmp_path}/ckpt-controller/engine-a.sock"
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt-controller").st_mode) == 0o700
    with pytest.raises(ConfigError):
        default_endpoint("../escape")
    os.chmod(tmp_path / "ckpt-controller", 0o755)
    with pytest.raises(ConfigError, match="not private"):
        default_endpoint("engine-a")
    with pytest.raises(ConfigError):
        Agent("x", control="http://nope")


def test_subscribers_that_vanish_are_forgotten(ipc_dir):
    from ckpt_controller.rpc import RpcClient

    with Agent("subs", control=f"ipc://{ipc_dir}/s.ctl", heartbeat_interval_s=0.05) as a:
        polite = AgentClient(a.endpoint)
        polite.subscribe()
        crashed = RpcClient(a.endpoint)
        crashed.subscribe()
        assert len(a._subscribers) == 2
        polite.close()  # says UNSUBSCRIBE
        crashed._sock.close(linger=0)  # vanishes without a word
        crashed._sock = None
        deadline = deadline_in(5)
        while a._subscribers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not a._subscribers


def test_subscribers_beyond_the_bound_are_refused_typed(ipc_dir, monkeypatch):
    """At most ``MAX_SUBSCRIBERS`` at once (each event is a message to each): one more is
    refused with the retryable ``OverloadedError``; a subscriber that leaves makes room, and
    one subscribed already subscribes again freely."""
    from ckpt_controller import rpcserver
    from ckpt_controller.errors import OverloadedError
    from ckpt_controller.rpc import RpcClient

    monkeypatch.setattr(rpcserver, "MAX_SUBSCRIBERS", 3)
    with Agent("subs", control=f"ipc://{ipc_dir}/s.ctl", heartbeat_interval_s=0.05) as a:
        clients = [AgentClient(a.endpoint) for _ in range(3)]
        try:
            for c in clients:
                c.subscribe()
            clients[0].subscribe()  # again: no second place taken
            extra = RpcClient(a.endpoint)
            try:
                with pytest.raises(OverloadedError, match="3 subscribers already") as info:
                    extra.subscribe()
                assert info.value.details["retry_after_s"] > 0 and len(a._subscribers) == 3
                clients.pop().close()  # says UNSUBSCRIBE: its place is free
                extra.subscribe()
                assert len(a._subscribers) == 3
            finally:
                extra.close()
        finally:
            for c in clients:
                c.close()


def test_stepwise_prepare_and_restore(agent, client):
    """Steps let a controller run hooks inside PREPARING and RESTORING."""
    agent.gate.admit("r")
    agent.gate.finish("r", "stop")
    r = client.prepare(op_id="s1", level=0, step="drain")
    assert r.state == "preparing" and client.status().state == "preparing"
    with pytest.raises(InvalidTransitionError) as info:
        client.prepare(op_id="s-bad", level=0, step="seal")
    assert info.value.details["allowed"] == ["release"]
    assert client.prepare(op_id="s2", level=0, step="release").state == "preparing"
    with pytest.raises(RejectedError):
        agent.gate.admit("late")  # admission stays closed between steps
    assert client.prepare(op_id="s3", level=0, step="seal").state == "prepared"
    assert client.restore(op_id="s4", step="rewake").state == "restoring"
    with pytest.raises(RejectedError):
        agent.gate.admit("late")
    r = client.restore(op_id="s5", step="resume")
    assert r.state == "running" and r.generation == 1
    # a rollback between steps brings the engine back
    client.prepare(op_id="s6", level=0, step="drain")
    assert client.rollback(op_id="s7").state == "running"
    with pytest.raises(InvalidTransitionError):
        client.restore(op_id="s8", step="resume")


def test_the_step_tables_order_rule():
    """The agent's sub-steps are one table per operation: each step names the one before it,
    the first fires the trigger that begins the operation and the last the one that ends it,
    both as the lifecycle's table has them, and every failpoint belongs to a step."""
    moves = {trig: (srcs, dst) for trig, srcs, dst in TRANSITIONS}
    for table, kind in ((PREPARE_STEPS, PrepareStep), (RESTORE_STEPS, RestoreStep)):
        assert [s.name for s in table] == [k for k in kind if k is not kind.ALL]
        assert [s.after for s in table] == [None, *(s.name for s in table[:-1])]
        first, last = table[0], table[-1]
        assert first.enters is not None and all(s.enters is None for s in table[1:])
        assert last.leaves is not None and all(s.leaves is None for s in table[:-1])
        assert len({s.during for s in table}) == 1
        assert moves[first.enters][1] is first.during  # it begins the state the chain runs in
        assert moves[last.leaves][0] == (first.during,)  # and the last one leaves it
    assert (PREPARE_STEPS[-1].leaves, RESTORE_STEPS[-1].leaves) == (Trigger.SEAL, Trigger.RESUME)
    assert PREPARE_STEPS[-1].leaves.value == PREPARE_STEPS[-1].name.value  # one name, seal
    assert RESTORE_STEPS[-1].leaves.value == RESTORE_STEPS[-1].name.value  # one name, resume
    assert [s.failpoint for s in (*PREPARE_STEPS, *RESTORE_STEPS) if s.failpoint] \
        == list(FAILPOINTS)


def test_a_step_out_of_order_names_the_one_that_may_follow(agent, client):
    """Each refusal moves nothing and says which step may come now."""
    def refused(call, allowed: str, state: str, words: str) -> None:
        with pytest.raises(InvalidTransitionError, match=words) as info:
            call()
        assert info.value.details["allowed"] == [allowed]
        assert info.value.details["state"] == state == client.status().state

    refused(lambda: client.prepare(op_id="o1", level=0, step="release"), "drain", "running",
            "prepare step release does not follow")
    refused(lambda: client.restore(op_id="o2", step="resume"), "rewake", "running",
            "restore step resume needs a rewake before it")
    client.prepare(op_id="o3", level=0, step="drain")
    refused(lambda: client.prepare(op_id="o4", level=0, step="seal"), "release", "preparing",
            "does not follow")
    refused(lambda: client.restore(op_id="o5", step="resume"), "rewake", "preparing",
            "needs a rewake")
    client.prepare(op_id="o6", level=0, step="release")
    refused(lambda: client.prepare(op_id="o7", level=0, step="release"), "seal", "preparing",
            "does not follow")
    client.prepare(op_id="o8", level=0, step="seal")
    client.restore(op_id="o9", step="rewake")
    refused(lambda: client.prepare(op_id="o10", level=0, step="seal"), "drain", "restoring",
            "does not follow")
    r = client.restore(op_id="o11", step="resume")
    assert r.state == "running" and r.memory is None
    refused(lambda: client.restore(op_id="o12", step="resume"), "rewake", "running",
            "needs a rewake")


class FailingVerify(EngineHooks):
    """An engine whose check after re-wake fails: a rollback cannot bring it back."""

    def abort_requests(self, request_ids: list[str]) -> None:
        raise RuntimeError("abort broke")

    def verify(self) -> None:
        raise RuntimeError("golden mismatch")


def test_a_prepare_whose_rollback_fails_leaves_failed_with_both_reasons(ipc_dir):
    with Agent("unfit", hooks=FailingVerify(), control=f"ipc://{ipc_dir}/unfit.ctl") as a, \
            AgentClient(a.endpoint, timeout_s=5) as c:
        a.gate.admit("r1")
        with pytest.raises(EngineError, match="abort broke") as info:
            c.prepare(op_id="p1", drain="abort", level=0)
        details = info.value.details
        assert details["state"] == "failed" and "rolled_back" not in details
        assert "golden mismatch" in details["rollback_error"] and details["step"] == "drain"
        assert c.status().state == "failed"
        assert [t.trigger for t in a.lifecycle.history] == [
            Trigger.PREPARE, Trigger.ROLLBACK, Trigger.FAIL]


def test_a_server_of_another_protocol_version_is_refused_at_the_handshake(ipc_dir):
    """A stand-in server (a bare ROUTER on this thread's side) that answers the handshake as
    a newer agent would: the client says so instead of going on."""
    from ckpt_controller.errors import VersionMismatchError

    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{ipc_dir}/newer.ctl"
    server.bind(endpoint)

    def answer() -> None:
        if server.poll(5000):
            ident, *frames = server.recv_multipart()
            _, cmd = p.decode_command(frames)
            reply = p.HandshakeReply(protocol_version=p.PROTOCOL_VERSION + 1, engine="newer",
                                     pid=1, incarnation=0, state="running")
            server.send_multipart([ident, *p.reply_frames(cmd.call_id, reply)])

    t = threading.Thread(target=answer)
    t.start()
    try:
        with AgentClient(endpoint, timeout_s=3, retries=0) as c:
            with pytest.raises(VersionMismatchError) as info:
                c.handshake()
        assert info.value.details["got"] == p.PROTOCOL_VERSION + 1
        assert endpoint in info.value.message
    finally:
        t.join(scaled(10))
        server.close()


def test_one_operation_thread_runs_every_operation(agent, client):
    """Operations run on one thread kept for the agent's life, not on a thread each."""
    seen = []

    class Recording(EngineHooks):
        def resume_scheduling(self) -> None:
            seen.append(threading.get_ident())

    agent.operations.hooks = Recording()
    for n in range(3):
        client.prepare(op_id=f"p{n}", level=0, drain="abort")
        client.restore(op_id=f"r{n}")
    assert len(seen) == 3 and len(set(seen)) == 1
    (op_thread,) = [t for t in threading.enumerate() if t.name == "ckpt-op-unit"]
    assert op_thread.ident == seen[0] and op_thread.is_alive()


def test_an_operation_logs_one_line_at_its_end_and_a_warning_when_it_fails(agent, client,
                                                                          caplog):
    caplog.set_level("DEBUG", logger="ckpt_controller.agent")
    client.prepare(op_id="ok-1", level=0, drain="abort")
    with pytest.raises(InvalidTransitionError):
        client.prepare(op_id="bad-1", level=0, drain="abort")  # already PREPARED
    mine = [r for r in caplog.records if "ends:" in r.getMessage()]
    assert [(r.levelname, r.getMessage().split(" ends: ")[0]) for r in mine] == [
        ("DEBUG", "agent unit: prepare ok-1"), ("WARNING", "agent unit: prepare bad-1")]
    assert "ends: InvalidTransitionError: cannot prepare an engine that is prepared" \
        in mine[1].getMessage()


def test_events_are_not_built_for_nobody(agent):
    """With no subscriber an event is not even encoded (one that could not be is no error)."""
    agent.publish(object())  # not an event at all: never reaches the encoder
    agent._subscribers.add(b"someone")
    try:
        with pytest.raises(TypeError):
            agent.publish(object())
    finally:
        agent._subscribers.discard(b"someone")


def test_an_operation_that_runs_on_sends_its_callers_the_transition_that_began_it(ipc_dir):
    """Once an operation still runs ``LIVE_HOLD_S`` after its first transition, its caller
    gets that transition as an event, while it runs and before any other event of it."""
    from ckpt_controller.agent import server as agent_server

    hooks = SlowPause()
    with Agent("lv", hooks=hooks, control=f"ipc://{ipc_dir}/lv.ctl",
               heartbeat_interval_s=1.0) as a, \
            AgentClient(a.endpoint, timeout_s=3, heartbeat_interval_s=1.0) as c:
        c.subscribe()
        seen: list[tuple[float, object]] = []
        c.on_event = lambda ev: seen.append((time.monotonic(), ev))
        threading.Timer(0.3, hooks.release.set).start()  # a prepare that takes 0.3 s
        start = time.monotonic()
        reply = c.prepare(op_id="lv-1", level=0)
        ended = time.monotonic()
        assert [t.dest for t in reply.transitions] == ["preparing", "prepared"]
        changes = [(at, ev) for at, ev in seen if isinstance(ev, p.StateChanged)]
        assert [ev.transition.dest for _, ev in changes] == ["preparing"]
        at = changes[0][0]
        # about LIVE_HOLD_S in, long before the reply (the control thread idles up to 1 s)
        assert at - start < agent_server.LIVE_HOLD_S + 0.15 < ended - start, (at - start)
