"""NaN, infinite, zero and absurd values are refused everywhere they can come in: on the command
line (exit 2, naming the flag and the value), by the Python clients (``UsageError`` naming the
field, before anything is sent) and on the wire (a hand-built frame gets a typed error reply
naming the field). Real sockets, a real agent in this process and a real controller process."""

from __future__ import annotations

import math

import msgspec
import pytest
import zmq

from ckpt_controller import protocol as p
from ckpt_controller import values
from ckpt_controller.agent import Agent, AgentClient
from ckpt_controller.cli import main
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.engine.client import EngineClient
from ckpt_controller.engine.load import run_load
from ckpt_controller.errors import UsageError
from support.cli import ckptctl
from support.config import engines_toml

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------- the command line

ABSURD_ARGS = [
    (["prepare", "e", "--deadline", "nan"], "--deadline", "'nan'"),
    (["prepare", "e", "--deadline", "0"], "--deadline", "'0'"),
    (["prepare", "e", "--deadline", "100000"], "--deadline", "'100000'"),
    (["cycle", "e", "--drain-timeout", "nan"], "--drain-timeout", "'nan'"),
    (["prepare", "e", "--op-id", ""], "--op-id", "''"),
    (["prepare", "e", "--op-id", "x" * 129], "--op-id", "129 characters"),
    (["capture", "e", "--op-id", "../../etc"], "--op-id", "'../../etc'"),
    (["prepare", "e", "--budget", "99999999999999999999999TiB"], "--budget",
     "'99999999999999999999999TiB'"),
    (["cycle", "e", "--max-unavailable", "0"], "--max-unavailable", "'0'"),
    (["history", "--limit", "-1"], "--limit", "'-1'"),
    (["watch", "--duration", "inf"], "--duration", "'inf'"),
    (["agent", "prepare", "--control", "ipc:///x", "--deadline", "inf"], "--deadline", "'inf'"),
    (["agent", "prepare", "--control", "ipc:///x", "--drain-timeout", "nan"], "--drain-timeout",
     "'nan'"),
    (["agent", "prepare", "--control", "ipc:///x", "--op-id", ""], "--op-id", "''"),
    (["agent", "status", "--control", "ipc:///x", "--timeout", "nan"], "--timeout", "'nan'"),
    (["generate", "--api", "ipc:///x", "--prompt-ids", "1", "--max-tokens", "2", "--timeout",
      "nan"], "--timeout", "'nan'"),
    (["generate", "--api", "ipc:///x", "--prompt-ids", "1", "--max-tokens",
      "99999999999999999999"], "--max-tokens", "'99999999999999999999'"),
    (["generate", "--api", "ipc:///x", "--prompt-ids", "1,99999999999999999999",
      "--max-tokens", "2"], "--prompt-ids", "99999999999999999999"),
    (["load", "--api", "ipc:///x", "--rate", "nan", "--duration", "1"], "--rate", "'nan'"),
    (["load", "--api", "ipc:///x", "--rate", "inf", "--duration", "1"], "--rate", "'inf'"),
    (["load", "--api", "ipc:///x", "--rate", "5", "--duration", "nan"], "--duration", "'nan'"),
]


@pytest.mark.parametrize("argv,flag,shown", ABSURD_ARGS,
                         ids=[f"{a[0]} {flag} {a[a.index(flag) + 1][:12]}"
                              for a, flag, _ in ABSURD_ARGS])
def test_the_command_line_refuses_absurd_values(argv, flag, shown, capsys, tmp_path,
                                                monkeypatch):
    # nothing may be reached: were the value taken, the command would fail otherwise
    monkeypatch.setenv("CKPT_CONTROLLER", f"ipc://{tmp_path}/none.sock")
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert f"argument {flag}" in err and shown in err, err
    assert "Traceback" not in err


def test_the_installed_command_exits_2_naming_the_flag_and_value(tmp_path):
    out = ckptctl("--controller", f"ipc://{tmp_path}/none.sock", "prepare", "e", "--deadline",
                  "nan", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--deadline" in out.stderr and "'nan'" in out.stderr and "usage:" in out.stderr


def test_valid_values_still_pass():
    assert values.check(values.DURATION, 0.25, "s") == 0.25
    assert values.DURATION.parse("0.25") == 0.25  # the command line's text
    assert values.check(values.DURATION, values.MAX_DURATION_S, "s") == values.MAX_DURATION_S
    assert values.check(values.DURATION_OR_ZERO, 0, "s") == 0
    assert values.check(values.BYTES, "512MiB", "b") == 512 << 20
    assert values.check(values.OP_ID, "drill-1764600000-3", "op_id") == "drill-1764600000-3"
    assert values.check(values.STEP_OP_ID, "op1/e1/prepare", "op_id") == "op1/e1/prepare"
    assert values.check(values.RATE, 30, "rate") == 30.0
    with pytest.raises(UsageError) as info:
        values.check(values.OP_ID, "op1/e1", "op_id")  # a controller op id names one folder
    assert info.value.details["field"] == "op_id"


# ---------------------------------------------------------------- the Python clients


def _refused(call, field: str, shown: str) -> None:
    with pytest.raises(UsageError) as info:
        call()
    assert info.value.exit_code == 2
    assert info.value.details["field"] == field, info.value
    assert shown in str(info.value), info.value


CLIENT_CASES = [
    ("controller", lambda c: c.prepare(["e"], deadline=NAN), "deadline", "nan"),
    ("controller", lambda c: c.cycle(["e"], drain_timeout=INF), "drain_timeout", "inf"),
    ("controller", lambda c: c.prepare(["e"], deadline=0.0), "deadline", "0.0"),
    ("controller", lambda c: c.operation("prepare", ["e"], deadline_s=NAN), "deadline_s",
     "nan"),
    ("controller", lambda c: c.prepare(["e"], op_id=""), "op_id", "''"),
    ("controller", lambda c: c.prepare(["e"], op_id="x" * 900_000), "op_id", "900000 characters"),
    ("controller", lambda c: c.prepare(["e"], budget=10**30), "budget", str(10**30)),
    ("controller", lambda c: c.cycle(["e"], max_unavailable=0), "max_unavailable", "0"),
    ("agent", lambda c: c.prepare(drain_timeout_s=NAN), "drain_timeout_s", "nan"),
    ("agent", lambda c: c.prepare(deadline_s=INF), "deadline_s", "inf"),
    ("agent", lambda c: c.restore(op_id=""), "op_id", "''"),
    ("agent", lambda c: c.rollback(deadline_s=-1.0), "deadline_s", "-1.0"),
    ("agent", lambda c: c.prepare(level=0, timeout_s=NAN), "timeout_s", "nan"),
]


@pytest.mark.parametrize("kind,call,field,shown", CLIENT_CASES,
                         ids=[f"{k}-{f}-{s[:12]}" for k, _, f, s in CLIENT_CASES])
def test_python_clients_refuse_before_sending(silent_server, kind, call, field, shown):
    endpoint, received = silent_server
    cls = ControllerClient if kind == "controller" else AgentClient
    with cls(endpoint, timeout_s=0.5, retries=0) as client:
        _refused(lambda: call(client), field, shown)
    assert received() == 0  # nothing reached the server


def test_engine_clients_refuse_before_sending(silent_server):
    endpoint, received = silent_server
    with EngineClient(endpoint) as client:
        _refused(lambda: client.generate([1, 2], 3, timeout_s=NAN), "timeout_s", "nan")
        _refused(lambda: client.generate([1, 2], 0), "max_tokens", "0")
        _refused(lambda: client.generate([1, 2**70], 3), "prompt_token_ids", str(2**70))
    for rate in (NAN, INF, 0.0):
        _refused(lambda: run_load(endpoint, rate=rate, duration_s=1), "rate", repr(rate))
    _refused(lambda: run_load(endpoint, rate=5, duration_s=NAN), "duration_s", "nan")
    _refused(lambda: run_load(endpoint, rate=5, duration_s=1, settle_s=INF), "settle_s", "inf")
    assert received() == 0
    with pytest.raises(UsageError):  # a client that could never time out is refused too
        AgentClient(endpoint, timeout_s=NAN)


# ---------------------------------------------------------------- the wire


def _send_raw(endpoint: str, rtype: p.RequestType, fields: dict) -> p.ErrorReply | p.Reply:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        body = {"call_id": 77, "version": p.PROTOCOL_VERSION, **fields}
        sock.send_multipart([rtype.value, msgspec.msgpack.encode(body)])
        assert sock.poll(10_000, zmq.POLLIN), "no reply"
        return p.decode_reply(sock.recv_multipart())
    finally:
        sock.close(linger=0)


AGENT_FRAMES = [
    ({"op_id": "w", "deadline_s": NAN}, "deadline_s"),
    ({"op_id": "w", "drain_timeout_s": INF}, "drain_timeout_s"),
    ({"op_id": "w", "release_deadline_s": -1.0}, "release_deadline_s"),
    ({"op_id": ""}, "op_id"),
    ({"op_id": "x" * 900_000}, "op_id"),
    ({"op_id": "a b"}, "op_id"),
    ({"op_id": "w", "residual_budget_bytes": 2**63}, "residual_budget_bytes"),
    ({"op_id": "w", "level": 7}, "level"),
]


def test_the_agent_answers_absurd_values_with_a_typed_error(ipc_dir):
    with Agent("wire", control=f"ipc://{ipc_dir}/wire.ctl") as agent:
        for fields, field in AGENT_FRAMES:
            reply = _send_raw(agent.endpoint, p.RequestType.PREPARE, fields)
            assert isinstance(reply, p.ErrorReply), (fields.keys(), reply)
            assert reply.call_id == 77 and reply.kind == "ProtocolError"
            assert f"$.{field}" in reply.message, reply.message
        for fields, field in (({"op_id": "w", "deadline_s": NAN}, "deadline_s"),
                              ({"op_id": ""}, "op_id")):
            reply = _send_raw(agent.endpoint, p.RequestType.RESTORE, fields)
            assert isinstance(reply, p.ErrorReply) and f"$.{field}" in reply.message
        assert agent.lifecycle.state.value == "running"  # nothing was started


def test_the_controller_answers_absurd_values_with_a_typed_error(ipc_dir, spawn_controller):
    ctl = spawn_controller(engines_toml(("ghost", f"ipc://{ipc_dir}/ghost.ctl")))
    base = {"kind": "prepare", "engines": ["ghost"]}
    cases = [({**base, "op_id": ""}, "op_id"),
             ({**base, "op_id": "x" * 900_000}, "op_id"),
             ({**base, "op_id": "../up"}, "op_id"),
             ({**base, "op_id": "a", "deadline_s": NAN}, "deadline_s"),
             ({**base, "op_id": "b", "drain_timeout_s": 0.0}, "drain_timeout_s"),
             ({**base, "op_id": "c", "residual_budget_bytes": 2**64 - 1}, "residual_budget_bytes"),
             ({**base, "op_id": "d", "kind": "cycle", "max_unavailable": 0}, "max_unavailable"),
             ({**base, "op_id": "e", "kind": "restore", "image": "../../etc"}, "image"),
             ({**base, "op_id": "f", "kind": "restore", "image": ""}, "image")]
    for fields, field in cases:
        reply = _send_raw(ctl.endpoint, p.RequestType.OPERATION, fields)
        assert isinstance(reply, p.ErrorReply), (field, reply)
        assert reply.kind == "ProtocolError" and f"$.{field}" in reply.message, reply.message
        assert reply.to_exception().exit_code == 2
    reply = _send_raw(ctl.endpoint, p.RequestType.HISTORY, {"limit": -1})
    assert isinstance(reply, p.ErrorReply) and "$.limit" in reply.message
    # the wire's own bound is the only one: a limit the CLI lets through is answered
    reply = _send_raw(ctl.endpoint, p.RequestType.HISTORY, {"limit": p.MAX_HISTORY_LIMIT})
    assert isinstance(reply, p.Reply), reply
    with ControllerClient(ctl.endpoint, timeout_s=10) as c:  # nothing was journaled
        assert c.history().operations == []


def test_msgspec_constraints_refuse_nan_and_infinity():
    """The reason the wire types carry both bounds: an unconstrained float takes NaN."""
    for bad in (NAN, INF, -INF):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, values.Duration)
    assert math.isnan(msgspec.convert(NAN, float))


def test_a_long_reason_is_cut_not_refused(ipc_dir):
    """The controller builds rollback and fail reasons from error messages: one past the wire's
    limit must never keep an engine from being rolled back."""
    with Agent("why", control=f"ipc://{ipc_dir}/why.ctl") as agent:
        with AgentClient(agent.endpoint) as c:
            c.prepare(level=0)
            reply = c.rollback(reason="x" * 100_000)
            status = c.status()
    assert status.state == "running"
    (reason,) = [t.reason for t in reply.transitions if t.trigger == "rollback"]
    assert reason.endswith("(cut)") and len(reason) < values.MAX_TEXT_LENGTH + 200


@pytest.mark.parametrize("typ,rule", [(values.OpId, values.OP_ID),
                                      (values.StepOpId, values.STEP_OP_ID),
                                      (values.Name, None)], ids=["op-id", "step-op-id", "name"])
@pytest.mark.parametrize("bad", ["op1\n", "op1\r\n", "\nop1"],
                         ids=["lf-after", "crlf-after", "lf-before"])
def test_a_trailing_or_leading_newline_is_refused_on_the_wire_and_by_the_rules(typ, rule, bad):
    # msgspec matches a pattern with re.search: a "$" would let "op1\n" through, and an
    # operation id names an image folder
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, typ)
    if rule is not None:
        with pytest.raises(UsageError):
            values.check(rule, bad, "op id")
