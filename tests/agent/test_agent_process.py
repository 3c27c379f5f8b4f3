"""The agent embedded in a real engine process, driven over real ZMQ sockets: every drain
mode with work in flight, memory released and re-woken for real (RSS measured from outside),
budgets, corruption and bad frames. The engine is ``tests/engines/step_engine.py``."""

from __future__ import annotations

import struct
import threading
import time
import uuid

import psutil
import pytest
import zmq

from ckpt_controller import protocol as p
from ckpt_controller.agent import AgentClient
from ckpt_controller.errors import (
    DrainError,
    InvalidTransitionError,
    ResidualOverBudgetError,
    UnreachableError,
    VerificationError,
)
from support.timing import deadline_in, scaled, wait_until

MIB = 1 << 20


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


_clients: list[AgentClient] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _clients:
        _clients.pop().close()


def client_for(eng, **kw) -> AgentClient:
    c = AgentClient(eng.control, timeout_s=10, heartbeat_interval_s=0.2, **kw)
    _clients.append(c)
    return c


def in_flight(ctl: AgentClient, n: int) -> None:
    """Wait until the engine has admitted ``n`` requests (instead of sleeping a while)."""
    wait_until(lambda: ctl.status().in_flight == n, what=f"{n} requests in flight")


def in_background(fn):
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def wait_for_state(client: AgentClient, state: str, timeout_s: float = 10) -> None:
    deadline = deadline_in(timeout_s)
    while time.monotonic() < deadline:
        for ev in client.poll_events(0.05):
            if isinstance(ev, p.StateChanged) and ev.transition.dest == state:
                return
    raise TimeoutError(f"engine never reached {state}")


def assert_turned_away_at_once(eng, state: str) -> None:
    """A request sent now is rejected within a second, typed, with ``state`` and a hint."""
    start = time.monotonic()
    eng.submit("late", 5)
    late = eng.collect(["late"])["late"]
    assert time.monotonic() - start < scaled(1.0)
    assert late["status"] == "rejected" and late["state"] == state
    assert late["retry_after_s"] > 0
    del eng.results["late"]


def reference_outputs(eng, jobs: dict[str, tuple[int, int]]) -> dict[str, list[float]]:
    """Outputs of the same requests run straight through on the same engine."""
    for rid, (steps, seed) in jobs.items():
        eng.submit("ref-" + rid, steps, seed)
    got = eng.collect(["ref-" + r for r in jobs])
    return {rid: got["ref-" + rid]["output"] for rid in jobs}


SMALL = {"weights_mib": 8, "kv_mib": 4, "step_s": 0.01}


@pytest.fixture
def small(shared_engines):
    """A small step engine, one process for this module's tests that leave it RUNNING and
    idle (replaced when one does not)."""
    return shared_engines("step", "small", **SMALL).get()


@pytest.fixture
def fresh_small(spawn_engine):
    """A small step engine of this test's own: for a test that corrupts or kills it."""
    return spawn_engine("small", **SMALL)


def test_wait_drain_finishes_in_flight_and_rejects_newcomers(small):
    ctl = client_for(small)
    watcher = client_for(small)
    watcher.subscribe()
    jobs = {f"r{i}": (60, i) for i in range(5)}
    for rid, (steps, seed) in jobs.items():
        small.submit(rid, steps, seed)
    in_flight(ctl, 5)
    t, out = in_background(lambda: ctl.prepare(drain="wait", drain_timeout_s=20, level=1))
    wait_for_state(watcher, "preparing")
    assert_turned_away_at_once(small, "preparing")
    t.join(scaled(30))
    report = out["result"].drain
    assert (report.mode, report.completed, report.aborted, report.kept) == ("wait", 5, 0, 0)
    assert report.in_flight_at_start == 5 and report.escalated_to is None
    done = small.collect(list(jobs))
    assert all(r["reason"] == "length" and len(r["output"]) == 60 for r in done.values())
    progress = [e for e in watcher.poll_events(0.1) if isinstance(e, p.DrainProgress)]
    assert progress and progress[0].in_flight > 0  # the drain took > 1 progress tick
    # in PREPARED a request is rejected too, with the new state
    small.submit("late2", 5)
    assert small.collect(["late2"])["late2"]["state"] == "prepared"
    ctl.restore()
    small.submit("after", 5)
    assert small.collect(["after"])["after"]["reason"] == "length"


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_a_request_arriving_mid_prepare_is_rejected_at_once_in_every_mode(small, mode):
    """The drain step alone leaves the engine PREPARING (as between a controller's hooks):
    a newcomer then is turned away at once, typed and retryable, whatever the drain mode;
    the requests in flight end as the mode says."""
    ctl = client_for(small)
    jobs = [f"{mode}{i}" for i in range(3)]
    # keep: 2 s of steps at least, so all three are still in flight when the prepare comes
    # (0.4 s could pass on a busy machine between the status that counted them and it)
    steps = {"wait": 40, "abort": 100_000, "keep": 200}[mode]
    for i, rid in enumerate(jobs):
        small.submit(rid, steps, i)
    in_flight(ctl, 3)
    reply = ctl.prepare(drain=mode, level=1, step="drain", op_id=f"mid-{mode}")
    assert reply.state == "preparing"
    assert_turned_away_at_once(small, "preparing")
    counts = (reply.drain.completed, reply.drain.aborted, reply.drain.kept)
    assert counts == {"wait": (3, 0, 0), "abort": (0, 3, 0), "keep": (0, 0, 3)}[mode]
    ctl.rollback(reason="test done")
    got = small.collect(jobs, timeout_s=30)
    # wait: finished before PREPARING ended; abort: ended at once; keep: resumed by the
    # rollback, they run to their end
    want = {"wait": "length", "abort": "abort", "keep": "length"}[mode]
    assert all(r["reason"] == want for r in got.values())
    if mode != "abort":
        assert all(len(r["output"]) == steps for r in got.values())
    small.submit("after", 5)
    assert small.collect(["after"])["after"]["reason"] == "length"


def test_abort_drain_ends_requests_with_partial_output(small):
    ctl = client_for(small)
    jobs = [f"a{i}" for i in range(6)]
    for i, rid in enumerate(jobs):
        small.submit(rid, 100_000, i)
    # a one-step request sent after them ends with the first step that takes them all: once
    # it has, each has some output to be aborted with (instead of sleeping a while)
    small.submit("a-first-step", 1)
    assert small.collect(["a-first-step"])["a-first-step"]["reason"] == "length"
    in_flight(ctl, 6)
    reply = ctl.prepare(drain="abort", level=0)
    assert (reply.drain.aborted, reply.drain.completed, reply.drain.kept) == (6, 0, 0)
    got = small.collect(jobs, timeout_s=5)
    for r in got.values():
        assert r["reason"] == "abort" and 0 < len(r["output"]) < 100_000
    assert ctl.status().in_flight == 0
    ctl.restore()


@pytest.mark.parametrize("level", [1, 2])
def test_keep_drain_finishes_after_restore_with_identical_output(small, level):
    jobs = {f"k{i}": (60, i) for i in range(4)}
    want = reference_outputs(small, jobs)
    ctl = client_for(small)
    generation = ctl.status().generation
    for rid, (steps, seed) in jobs.items():
        small.submit(rid, steps, seed)
    in_flight(ctl, 4)
    reply = ctl.prepare(drain="keep", level=level)
    assert reply.drain.kept + reply.drain.completed == 4 and reply.drain.kept >= 1
    status = ctl.status()
    assert status.state == "prepared" and status.kept == reply.drain.kept
    assert sorted(status.released_tags) == ["kv_cache", "weights"]
    time.sleep(0.2)
    restored = ctl.restore()
    assert restored.resumed_kept == reply.drain.kept
    assert restored.generation == generation + 1
    got = small.collect(list(jobs))
    assert {rid: r["output"] for rid, r in got.items()} == want
    assert all(r["reason"] == "length" for r in got.values())


@pytest.mark.parametrize("escalation", ["abort", "keep"])
def test_wait_drain_escalates_at_its_deadline(small, escalation):
    jobs = {f"e{i}": (300, i) for i in range(3)}
    want = reference_outputs(small, {"e0": (300, 0)}) if escalation == "keep" else None
    ctl = client_for(small)
    for rid, (steps, seed) in jobs.items():
        small.submit(rid, steps, seed)
    in_flight(ctl, 3)
    reply = ctl.prepare(drain="wait", drain_timeout_s=0.3, on_deadline=escalation, level=1)
    d = reply.drain
    assert d.escalated_to == escalation and 0.3 <= d.drain_s < scaled(3)
    if escalation == "abort":
        assert d.aborted == 3
        assert {r["reason"] for r in small.collect(list(jobs)).values()} == {"abort"}
        ctl.restore()
    else:
        assert d.kept == 3
        ctl.restore()
        got = small.collect(list(jobs))
        assert got["e0"]["output"] == want["e0"]


def test_nothing_is_lost_under_load_through_cycles(small):
    """A steady stream of requests through prepare/restore with every drain mode: each
    request gets exactly one end (finished with a reason, or rejected at once)."""
    ctl = client_for(small)
    sent: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def load():
        i = 0
        while not stop.is_set():
            rid = f"L{i}"
            with lock:
                small.submit(rid, 5 + i % 30, i)
                sent.append(rid)
            i += 1
            time.sleep(0.005)

    t = threading.Thread(target=load)
    t.start()
    try:
        for mode in ("wait", "abort", "keep"):
            time.sleep(0.2)
            ctl.prepare(drain=mode, level=1, drain_timeout_s=10)
            time.sleep(0.1)
            ctl.restore()
        time.sleep(0.2)
    finally:
        stop.set()
        t.join()
    with lock:  # the load thread is done with the socket; collect on this thread
        got = small.collect(sent, timeout_s=30)
    statuses = {(r["status"], r.get("reason")) for r in got.values()}
    assert statuses <= {("finished", "length"), ("finished", "abort"), ("rejected", None)}
    assert ("rejected", None) in statuses and ("finished", "length") in statuses
    assert ctl.status().in_flight == 0


def test_level2_releases_384mib_and_rewakes_bit_identical_same_objects(spawn_engine):
    eng = spawn_engine("big", weights_mib=320, kv_mib=64, step_s=0.01)
    ctl = client_for(eng)
    before = eng.introspect()
    rss_before = rss(eng.pid)
    reply = ctl.prepare(drain="wait", level=2)
    released = reply.memory.tensor_bytes
    assert released >= 384 * MIB
    dropped = rss_before - rss(eng.pid)
    assert dropped >= 0.9 * released, (dropped, released)
    assert reply.memory.freed_bytes >= 0.9 * released
    assert sorted(ctl.status().released_tags) == ["kv_cache", "weights"]
    restored = ctl.restore()
    assert restored.memory.verified_tensors >= 4
    after = eng.introspect()
    assert after["param_ids"] == before["param_ids"]  # the engine's Parameters survive
    assert after["weights_sha256"] == before["weights_sha256"]  # bit-identical
    assert rss(eng.pid) >= rss_before - 0.1 * released  # memory really came back
    eng.submit("x", 5)
    assert eng.collect(["x"])["x"]["reason"] == "length"


def test_level1_on_cpu_frees_the_kv_cache(spawn_engine):
    eng = spawn_engine("lvl1", weights_mib=64, kv_mib=256, step_s=0.01)
    ctl = client_for(eng)
    before = eng.introspect()
    rss_before = rss(eng.pid)
    reply = ctl.prepare(level=1)
    kv_bytes = ctl.status().registered_bytes["kv_cache"]
    assert kv_bytes == 256 * MIB
    assert rss_before - rss(eng.pid) >= 0.9 * kv_bytes
    assert reply.memory.discarded_bytes == kv_bytes
    ctl.restore()
    assert eng.introspect()["weights_sha256"] == before["weights_sha256"]


def test_residual_over_budget_rolls_back_to_running(small):
    ctl = client_for(small)
    before = small.introspect()
    generation = ctl.status().generation
    with pytest.raises(ResidualOverBudgetError) as info:
        ctl.prepare(level=2, residual_budget_bytes=MIB)
    err = info.value
    assert err.details["state"] == "running" and err.details["rolled_back"]
    assert err.details["step"] == "release" and err.exit_code == 1
    st = ctl.status()
    assert st.state == "running" and st.released_tags == [] and st.generation == generation
    # the budget is held against the measured residual: one just above it is met
    residual = err.details["residual_bytes"]
    assert residual > MIB
    reply = ctl.prepare(level=2, residual_budget_bytes=residual + 64 * MIB)
    assert reply.state == "prepared" and reply.memory.residual_bytes <= residual + 64 * MIB
    ctl.restore()
    assert small.introspect()["weights_sha256"] == before["weights_sha256"]
    assert small.introspect()["weights_sha256"] == before["weights_sha256"]
    small.submit("ok", 3)
    assert small.collect(["ok"])["ok"]["reason"] == "length"


def test_corrupted_weight_is_caught_at_rewake(fresh_small, ipc_dir):
    small = fresh_small
    ctl = client_for(small)
    ctl.prepare(level=2)
    path = ipc_dir / "weights.safetensors"
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    data[8 + header_len + 12345] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(data))
    with pytest.raises(VerificationError) as info:
        ctl.restore()
    assert info.value.details["state"] == "failed" and info.value.details["tag"] == "weights"
    assert ctl.status().state == "failed"
    small.submit("no", 3)
    assert small.collect(["no"])["no"]["state"] == "failed"


def test_drain_failure_rolls_back_and_requests_finish(small):
    ctl = client_for(small)
    small.submit("long", 200)
    in_flight(ctl, 1)
    with pytest.raises(DrainError):
        ctl.prepare(drain="wait", drain_timeout_s=0.1, on_deadline="fail", level=2)
    assert ctl.status().state == "running"
    got = small.collect(["long"], timeout_s=20)["long"]
    assert got["reason"] == "length" and len(got["output"]) == 200


def test_bad_frames_to_a_real_engine_are_answered(small):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(small.control)
    for frames in ([b"\x02", b"garbage"], [b"\xff", b"\x80"], [b"x"] * 5):
        s.send_multipart(frames)
        assert s.poll(3000)
        assert isinstance(p.decode_reply(s.recv_multipart()), p.ErrorReply)
    s.close()
    assert client_for(small).status().state == "running"


def test_engine_death_during_an_operation_is_noticed_from_heartbeats(fresh_small):
    """A long keep-nothing wait drain; the engine is killed -9 mid-way. The client, which
    follows heartbeats, gives up within a few heartbeat intervals, not at the op timeout."""
    small = fresh_small
    ctl = client_for(small)
    ctl.subscribe()
    small.submit("forever", 1_000_000)
    in_flight(ctl, 1)
    t, out = in_background(lambda: ctl.prepare(drain="wait", drain_timeout_s=300, level=0))
    wait_until(lambda: client_for(small).status().state == "preparing", what="PREPARING")
    killed_at = time.monotonic()
    small.proc.kill()
    t.join(scaled(30))
    assert isinstance(out.get("error"), UnreachableError), out
    # heartbeats, not the drain's 300 s
    assert time.monotonic() - killed_at < scaled(ctl.liveness_s * (ctl.retries + 1) + 2, below=300)


#: the product's lifecycle, written out independently of the table in ``lifecycle.py``:
#: the triggers each state allows, and what each wire command leads to from it
ALLOWED = {
    "running": ["prepare", "fail"],
    "preparing": ["seal", "rollback", "fail"],
    "prepared": ["restore", "rollback", "fail"],
    "restoring": ["resume", "fail"],
    "failed": ["restore", "fail"],
}
LEADS_TO = {  # (state, command) -> final state of a legal command
    ("running", "prepare"): "prepared",
    ("preparing", "rollback"): "running",
    ("prepared", "restore"): "running",
    ("prepared", "rollback"): "running",
    ("failed", "restore"): "running",
}


def _bring_to(ctl: AgentClient, state: str) -> None:
    """RUNNING first (from wherever the last command left it), then ``state``; every
    operation has its own id (a repeated id would return the stored result)."""
    op = f"to-{state}-{uuid.uuid4().hex[:8]}"
    back = {"preparing": ctl.rollback, "prepared": ctl.rollback, "failed": ctl.restore,
            "restoring": lambda op_id: ctl.restore(op_id=op_id, step="resume")}
    current = ctl.status().state
    if current in back:
        back[current](op_id=op + "-back")
    if state == "preparing":
        ctl.prepare(op_id=op, level=0, step="drain")  # stops between steps
    elif state in ("prepared", "restoring"):
        ctl.prepare(op_id=op, level=0)
        if state == "restoring":
            ctl.restore(op_id=op + "-rewake", step="rewake")  # stops before resume
    elif state == "failed":
        ctl.fail(op_id=op, reason="test")
    assert ctl.status().state == state


@pytest.mark.parametrize("state", list(ALLOWED))
def test_every_command_in_every_state_over_the_wire(shared_engines, state):
    """Each wire command sent to a real engine process in each state: an illegal one gets
    InvalidTransitionError naming the state and the allowed triggers and moves nothing; a
    legal one moves the engine where the lifecycle says. One engine for every state (each
    test leaves it RUNNING; ``_bring_to`` starts from wherever it is)."""
    eng = shared_engines("step", "machine", weights_mib=1, kv_mib=1, step_s=0.01).get()
    ctl = client_for(eng)
    commands = {
        "prepare": lambda op: ctl.prepare(op_id=op, level=0),
        "restore": lambda op: ctl.restore(op_id=op),
        "rollback": lambda op: ctl.rollback(op_id=op),
    }
    _bring_to(ctl, state)
    generation = ctl.status().generation
    for name, send in commands.items():
        if (state, name) in LEADS_TO:
            continue
        with pytest.raises(InvalidTransitionError) as info:
            send(f"{state}-bad-{name}")  # op ids of this test's own: the engine is shared
        assert info.value.details["state"] == state, (name, info.value.details)
        assert info.value.details["allowed"] == ALLOWED[state], name
        assert info.value.exit_code == 2
        st = ctl.status()
        assert (st.state, st.generation) == (state, generation), name
    for (source, name), dest in LEADS_TO.items():
        if source == state:
            commands[name](f"{state}-ok-{name}")
            assert ctl.status().state == dest, name
            _bring_to(ctl, state)
    ctl.fail(op_id=f"{state}-ok-fail", reason="from " + state)  # fail is allowed from every state
    assert ctl.status().state == "failed"
    ctl.restore(op_id=f"{state}-recover")  # and FAILED recovers through RESTORING
    st = ctl.status()
    assert st.state == "running" and st.in_flight == 0


def test_a_burst_of_connections_does_not_end_the_engine(ipc_dir):
    """600 connections opened at once to an agent's ipc socket, the engine's soft
    open-files limit 300 (hard 4096): libzmq aborted the engine's process at 389 of them
    (its ipc listener cannot accept: "Too many open files"). The server raises the soft
    limit to the hard one before it binds; the agent answers during the burst."""
    import socket
    import subprocess
    import sys

    control = f"ipc://{ipc_dir}/burst.ctl"
    code = ("import resource, sys, time\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 4096))\n"
            "from ckpt_controller.agent import Agent\n"
            f"a = Agent('burst', control={control!r}, heartbeat_interval_s=0.2).start()\n"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    burst: list[socket.socket] = []
    try:
        assert proc.stdout.readline().strip() == "4096"
        for _ in range(600):
            s = socket.socket(socket.AF_UNIX)
            burst.append(s)
            s.connect(str(ipc_dir / "burst.ctl"))
        client = AgentClient(control, timeout_s=scaled(10))
        _clients.append(client)
        assert client.status().engine == "burst"
        assert proc.poll() is None
    finally:
        for s in burst:
            s.close()
        proc.stdin.close()
        proc.wait(timeout=scaled(30))
        proc.stdout.close()
