"""Protocol fuzzing of live endpoints: the agent's and the controller's control sockets get
arbitrary frames (random bytes, known and unknown request types with random or truncated
payloads, wrong versions, values nested deeper than the decoder goes) over real ZMQ sockets.
Each must be answered with a typed error or dropped, and the server must go on answering a
handshake after every one."""

from __future__ import annotations

import uuid

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_controller import protocol as p
from ckpt_controller.agent import Agent, AgentClient
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.controller.config import parse_config
from ckpt_controller.controller.server import ControllerServer
from support.config import controller_toml

VALID_COMMANDS = [
    (p.RequestType.HANDSHAKE, p.Handshake(call_id=1, client="fuzz")),
    (p.RequestType.STATUS, p.StatusCommand(call_id=2)),
    (p.RequestType.PREPARE, p.PrepareCommand(call_id=3, op_id="fuzz-op", level=0)),
    (p.RequestType.RESTORE, p.RestoreCommand(call_id=4, op_id="fuzz-op2")),
    (p.RequestType.OPERATION, p.OperationCommand(call_id=5, op_id="fuzz-op3", kind="prepare",
                                                 engines=["nobody"])),
    (p.RequestType.HISTORY, p.HistoryCommand(call_id=6)),
]
TYPE_BYTES = [t.value for t in p.RequestType] + [b"\x7f", b"\xff", b"", b"\x01\x02"]


@st.composite
def frames(draw) -> list[bytes]:
    kind = draw(st.sampled_from(["random", "typed-random", "truncated", "mutated", "version",
                                 "deep"]))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
    if kind == "typed-random":
        return [draw(st.sampled_from(TYPE_BYTES)), draw(st.binary(max_size=128))]
    rtype, cmd = draw(st.sampled_from(VALID_COMMANDS))
    payload = p.encode(cmd)
    if kind == "truncated":
        return [rtype.value, payload[:draw(st.integers(0, max(0, len(payload) - 1)))]]
    if kind == "mutated":
        i = draw(st.integers(0, len(payload) - 1))
        return [draw(st.sampled_from(TYPE_BYTES)),
                payload[:i] + bytes([draw(st.integers(0, 255))]) + payload[i + 1:]]
    fields = msgspec.to_builtins(cmd)
    if kind == "deep":  # a valid command with one more field: an array nested N deep
        payload = msgspec.msgpack.encode({**fields, "deep": None})  # ends with nil (0xc0)
        return [rtype.value, payload[:-1] + b"\x91" * draw(st.integers(500, 5_000)) + b"\xc0"]
    fields["version"] = draw(st.integers(-2**31, 2**31).filter(lambda v: v != p.PROTOCOL_VERSION))
    return [rtype.value, msgspec.msgpack.encode(fields)]


class Poker:
    """Sends raw frames from a fresh DEALER; returns the answer if one comes."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context.instance()

    def send(self, frames: list[bytes], wait_ms: int = 300):
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        try:
            s.send_multipart(frames)
            if s.poll(wait_ms):
                return p.decode_reply(s.recv_multipart())  # whatever comes back decodes
            return None
        finally:
            s.close()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-agent")
    a = Agent("fuzzed", control=f"ipc://{d}/a.ctl", heartbeat_interval_s=0.2).start()
    yield a
    a.close()


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-ctl")
    cfg = parse_config(controller_toml(d, ("nobody", f"ipc://{d}/nobody.ctl")))
    server = ControllerServer(cfg).start()
    yield server
    server.close()


SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _answers_or_drops_and_keeps_serving(endpoint: str, client_cls, name: str,
                                        fr: list[bytes]) -> None:
    reply = Poker(endpoint).send(fr)
    assert reply is None or isinstance(reply, (p.Reply, p.ErrorReply))
    with client_cls(endpoint, timeout_s=3, retries=0) as c:
        assert c.handshake().engine == name


@SETTINGS
@given(fr=frames())
def test_the_agent_answers_or_drops_any_frame_and_keeps_serving(agent, fr):
    _answers_or_drops_and_keeps_serving(agent.endpoint, AgentClient, "fuzzed", fr)


@SETTINGS
@given(fr=frames())
def test_the_controller_answers_or_drops_any_frame_and_keeps_serving(controller, fr):
    _answers_or_drops_and_keeps_serving(controller.endpoint, ControllerClient, "controller", fr)


# ---------------------------------------------------------------- out-of-order commands

AGENT_STEPS = ["prepare", "drain", "release", "seal", "restore", "rewake", "resume",
               "rollback", "fail", "status"]


def _agent_step(c: AgentClient, step: str, n: int) -> None:
    op = f"ooo-{uuid.uuid4().hex[:8]}-{step}"  # a new id: a repeated one returns its result
    if step == "prepare":
        c.prepare(op_id=op, level=0, drain="abort")
    elif step in ("drain", "release", "seal"):
        c.prepare(op_id=op, level=0, drain="abort", step=step)
    elif step == "restore":
        c.restore(op_id=op)
    elif step in ("rewake", "resume"):
        c.restore(op_id=op, step=step)
    elif step == "rollback":
        c.rollback(op_id=op, reason="fuzz")
    elif step == "fail":
        c.fail(op_id=op, reason="fuzz")
    else:
        c.status()


def _back_to_running(c: AgentClient, n: int) -> None:
    """Whatever order the commands came in, the agent is never wedged: this brings it back."""
    state = c.status().state
    op = f"ooo-{uuid.uuid4().hex[:8]}-back"
    if state in ("preparing", "prepared"):
        c.rollback(op_id=op, reason="fuzz")
    elif state == "restoring":
        c.restore(op_id=op, step="resume")
    elif state == "failed":
        c.restore(op_id=op)
    assert c.status().state == "running"


@SETTINGS
@given(steps=st.lists(st.sampled_from(AGENT_STEPS), min_size=1, max_size=10))
def test_the_agent_answers_commands_in_any_order(agent, steps):
    from ckpt_controller.errors import CkptError

    with AgentClient(agent.endpoint, timeout_s=5, retries=0) as c:
        for n, step in enumerate(steps):
            try:
                _agent_step(c, step, n)
            except CkptError as err:  # a typed refusal is a right answer
                assert err.kind != "OperationError" or "crashed" not in err.message
            status = c.status()
            assert status.current_op is None  # every step ended before its answer
        _back_to_running(c, len(steps))


@pytest.fixture(scope="module")
def controller_with_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-ooo")
    eng = Agent("ooo", control=f"ipc://{d}/ooo.ctl", heartbeat_interval_s=0.2).start()
    cfg = parse_config(controller_toml(d, eng, defaults='level = 0\ndrain = "abort"'))
    server = ControllerServer(cfg).start()
    yield server, eng
    server.close()
    eng.close()


@SETTINGS
@given(kinds=st.lists(st.sampled_from(["prepare", "capture", "restore", "rollback", "cycle"]),
                      min_size=1, max_size=8))
def test_the_controller_answers_operations_in_any_order(controller_with_engine, kinds):
    from ckpt_controller.errors import CkptError

    server, eng = controller_with_engine
    with ControllerClient(server.endpoint, timeout_s=10, retries=0) as c:
        for kind in kinds:
            try:
                result = c.operation(kind, ["ooo"])
            except CkptError:  # policy: refused at once, typed
                continue
            assert result.status in ("succeeded", "failed", "rolled_back")
            (o,) = result.engines
            assert o.state in ("running", "prepared", "failed"), (kind, o)
            if o.status != "succeeded":
                assert o.error is not None and o.error.kind != "OperationError"
    with AgentClient(eng.endpoint, timeout_s=5) as a:
        _back_to_running(a, len(kinds))
