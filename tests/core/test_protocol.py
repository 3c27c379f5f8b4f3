"""The codec: round trips, and every malformed frame becomes a ProtocolError (never a crash)."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_controller import errors
from ckpt_controller import protocol as p
from ckpt_controller import values
from ckpt_controller.vocab import (
    CheckpointState,
    DrainMode,
    Escalation,
    OperationKind,
    OperationStatus,
    OutcomeStatus,
    PrepareStep,
    ReleaseLevel,
    RestoreStep,
    Trigger,
)

ints = st.integers(min_value=0, max_value=2**63 - 1)
text = st.text(max_size=40)
# values within the limits the command Structs declare (``values``)
op_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._/-]{0,40}\Z")
finite = st.floats(min_value=0, max_value=values.MAX_DURATION_S, allow_nan=False)
seconds = st.floats(min_value=1e-6, max_value=values.MAX_DURATION_S, allow_nan=False)
sizes = st.integers(min_value=0, max_value=values.MAX_BYTES)

prepare_cmds = st.builds(
    p.PrepareCommand,
    call_id=ints, op_id=op_ids, drain=st.sampled_from(["wait", "abort", "keep"]),
    drain_timeout_s=finite, on_deadline=st.sampled_from(["abort", "keep", "fail"]),
    level=st.none() | st.integers(0, 2),
    tags=st.none() | st.lists(st.text(min_size=1, max_size=40), max_size=4),
    residual_budget_bytes=st.none() | sizes, deadline_s=st.none() | seconds,
)
commands = st.one_of(
    prepare_cmds.map(lambda c: (p.RequestType.PREPARE, c)),
    st.builds(p.RestoreCommand, call_id=ints, op_id=op_ids, deadline_s=st.none() | seconds)
    .map(lambda c: (p.RequestType.RESTORE, c)),
    st.builds(p.RollbackCommand, call_id=ints, op_id=op_ids, reason=text)
    .map(lambda c: (p.RequestType.ROLLBACK, c)),
    st.builds(p.StatusCommand, call_id=ints).map(lambda c: (p.RequestType.STATUS, c)),
    st.builds(p.Handshake, call_id=ints, client=text).map(lambda c: (p.RequestType.HANDSHAKE, c)),
    st.builds(p.HeartbeatCommand, call_id=ints).map(lambda c: (p.RequestType.HEARTBEAT, c)),
    st.builds(p.FailCommand, call_id=ints, op_id=op_ids, reason=text)
    .map(lambda c: (p.RequestType.FAIL, c)),
)


@given(commands)
def test_commands_round_trip(pair):
    rtype, cmd = pair
    frames = p.command_frames(rtype, cmd)
    assert len(frames[0]) == 1
    assert p.decode_command(frames) == (rtype, cmd)


@given(st.lists(st.binary(max_size=64), max_size=4))
@settings(max_examples=500)
def test_arbitrary_frames_never_crash_the_decoder(frames):
    try:
        p.decode_command(frames)
    except errors.ProtocolError as err:
        assert isinstance(err.details.get("call_id"), int)


@given(commands, st.data())
def test_truncated_payloads_are_protocol_errors(pair, data):
    rtype, cmd = pair
    tframe, payload = p.command_frames(rtype, cmd)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(errors.ProtocolError):
        p.decode_command([tframe, payload[:cut]])


@given(commands, st.integers(0, 255).filter(lambda b: b not in {t.value[0] for t in p.RequestType}))
def test_unknown_type_keeps_the_call_id(pair, byte):
    _, cmd = pair
    with pytest.raises(errors.ProtocolError, match="unknown request type") as info:
        p.decode_command([bytes([byte]), p.encode(cmd)])
    assert info.value.details["call_id"] == cmd.call_id


@given(commands, st.integers(0, 1000).filter(lambda v: v != p.PROTOCOL_VERSION))
def test_wrong_version_is_a_version_error(pair, version):
    rtype, cmd = pair
    cmd = msgspec.structs.replace(cmd, version=version)
    with pytest.raises(errors.VersionMismatchError) as info:
        p.decode_command(p.command_frames(rtype, cmd))
    assert info.value.details["got"] == version
    assert info.value.details["call_id"] == cmd.call_id


def test_oversized_and_bad_fields():
    big = p.PrepareCommand(call_id=7, op_id="x" * (p.MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(errors.ProtocolError, match="too large"):
        p.decode_command(p.command_frames(p.RequestType.PREPARE, big))
    bad = msgspec.msgpack.encode({"call_id": 9, "version": p.PROTOCOL_VERSION, "op_id": "a",
                                  "drain": "sideways"})
    with pytest.raises(errors.ProtocolError, match="invalid PREPARE") as info:
        p.decode_command([p.RequestType.PREPARE.value, bad])
    assert info.value.details["call_id"] == 9
    with pytest.raises(errors.ProtocolError, match="2 frames"):
        p.decode_command([p.RequestType.STATUS.value])


def _leaf_errors():
    return [c for c in errors._BY_KIND.values()]


@pytest.mark.parametrize("cls", _leaf_errors())
def test_every_error_crosses_the_wire_as_itself(cls):
    err = cls("something happened", engine="e1", state="prepared", allowed=["a"], obj=object())
    msg = p.decode_reply(p.error_frames(5, err))
    assert isinstance(msg, p.ErrorReply) and msg.call_id == 5
    back = msg.to_exception()
    assert type(back) is cls and back.message == "something happened"
    assert back.details["engine"] == "e1" and back.details["allowed"] == ["a"]
    assert isinstance(back.details["obj"], str)
    assert back.exit_code == cls.exit_code


def test_unknown_remote_error_kind_is_an_operation_error():
    back = p.ErrorReply(call_id=1, kind="Martian", message="?").to_exception()
    assert type(back) is errors.OperationError and back.details["remote_kind"] == "Martian"


def test_replies_and_events_round_trip():
    report = p.MemoryReport(action="release", level=2, tags=["weights"], freed_bytes=10,
                            devices=[p.DeviceMemory(device="cpu", before_bytes=20, after_bytes=10,
                                                    freed_bytes=10, residual_bytes=10)])
    result = p.PrepareReply(op_id="o", state="prepared", memory=report, duration_s=0.5,
                            drain=p.DrainReport(mode="keep", kept=3))
    assert p.decode_reply(p.reply_frames(3, result)) == p.Reply(call_id=3, result=result)
    ev = p.MemoryReported(engine="e", op_id="o", report=report)
    assert p.decode_reply(p.event_frames(ev)) == p.Event(body=ev)
    with pytest.raises(errors.ProtocolError):
        p.decode_reply([b"\x99", b""])
    with pytest.raises(errors.ProtocolError):
        p.decode_reply([p.ReplyType.REPLY.value, b"\xc1"])


# ---------------------------------------------------------------- the vocabulary on the wire


def _raw_event(body: dict) -> list[bytes]:
    return [p.ReplyType.EVENT.value, msgspec.msgpack.encode({"body": body})]


def _transition(trigger: str) -> dict:
    return {"trigger": trigger, "source": "preparing", "dest": "prepared", "generation": 0,
            "monotonic": 1.0, "wall": 2.0}


def test_old_trigger_names_still_decode(tmp_path):
    """Peers and journals written before the triggers took the step names say ``prepared`` and
    ``restored``: they read as ``seal`` and ``resume``."""
    for old, new in (("prepared", Trigger.SEAL), ("restored", Trigger.RESUME)):
        ev = p.decode_reply(_raw_event({"type": "StateChanged", "engine": "e",
                                        "transition": _transition(old)}))
        assert isinstance(ev, p.Event) and ev.body.transition.trigger is new
        reply = p.decode_reply([p.ReplyType.REPLY.value, msgspec.msgpack.encode(
            {"call_id": 1, "result": {"type": "PrepareReply", "op_id": "o", "state": "prepared",
                                      "drain": {"mode": "wait"}, "memory": {"action": "release"},
                                      "duration_s": 0.1, "transitions": [_transition(old)]}})])
        assert reply.result.transitions[0].trigger is new
    # a journal's transition record, as the controller wrote it before the rename
    from ckpt_controller.controller.journal import Journal
    journal = Journal(tmp_path / "journal.db")
    try:
        journal.record("transition", {"trigger": "restored", "source": "restoring",
                                      "dest": "running", "generation": 1, "reason": "op c1"},
                       op_id="c1", engine="e", wall=5.0, monotonic=6.0)
        (rec,) = journal.records(op_id="c1")
    finally:
        journal.close()
    back = msgspec.convert({**rec.data, "wall": rec.wall, "monotonic": rec.monotonic},
                           p.TransitionRecord)
    assert back.trigger is Trigger.RESUME and back.dest is CheckpointState.RUNNING
    written = p.encode(p.TransitionRecord(**{**_transition("x"), "trigger": Trigger.SEAL}))
    assert msgspec.msgpack.decode(written)["trigger"] == "seal"  # what is written: the new name


def _command(rtype: p.RequestType, **fields) -> list[bytes]:
    body = {"call_id": 3, "version": p.PROTOCOL_VERSION, "op_id": "o", **fields}
    return [rtype.value, msgspec.msgpack.encode(body)]


MISSPELT_COMMANDS = [
    (p.RequestType.PREPARE, {"drain": "wiat"}, "drain"),
    (p.RequestType.PREPARE, {"on_deadline": "stop"}, "on_deadline"),
    (p.RequestType.PREPARE, {"level": 3}, "level"),
    (p.RequestType.PREPARE, {"step": "rewake"}, "step"),
    (p.RequestType.RESTORE, {"step": "seal"}, "step"),
    (p.RequestType.OPERATION, {"kind": "snapshot"}, "kind"),
    (p.RequestType.OPERATION, {"kind": "prepare", "drain": "Wait"}, "drain"),
]


@pytest.mark.parametrize("rtype, fields, field", MISSPELT_COMMANDS)
def test_a_misspelt_word_in_a_command_is_refused(rtype, fields, field):
    with pytest.raises(errors.ProtocolError, match=rf"\$\.{field}") as info:
        p.decode_command(_command(rtype, **fields))
    assert info.value.details["call_id"] == 3


def test_command_words_decode_as_vocabulary_members():
    _, cmd = p.decode_command(_command(p.RequestType.PREPARE, drain="keep", on_deadline="fail",
                                       level=2, step="seal"))
    assert (cmd.drain, cmd.on_deadline, cmd.level, cmd.step) == \
        (DrainMode.KEEP, Escalation.FAIL, ReleaseLevel.DISCARD, PrepareStep.SEAL)
    assert type(cmd.level) is ReleaseLevel and type(cmd.step) is PrepareStep
    _, cmd = p.decode_command(_command(p.RequestType.RESTORE, step="rewake"))
    assert cmd.step is RestoreStep.REWAKE
    _, cmd = p.decode_command(_command(p.RequestType.OPERATION, kind="cycle"))
    assert cmd.kind is OperationKind.CYCLE and cmd.drain is None
    default = p.PrepareCommand(call_id=1, op_id="o")
    assert (default.drain, default.on_deadline, default.level, default.step) == \
        ("wait", "abort", 1, "all")  # the wire defaults did not change


def _result(**over) -> dict:
    outcome = {"engine": "e", "status": "succeeded", "state": "running"}
    outcome.update(over.pop("outcome", {}))
    return {"type": "OperationResult", "op_id": "o", "kind": "cycle", "status": "succeeded",
            "engines": [outcome], "wall": 1.0, "duration_s": 1.0, **over}


def _decode_result(result: dict):
    return p.decode_reply([p.ReplyType.REPLY.value,
                           msgspec.msgpack.encode({"call_id": 1, "result": result})]).result


@pytest.mark.parametrize("over, field", [
    ({"status": "done"}, "status"),
    ({"kind": "snapshot"}, "kind"),
    ({"outcome": {"status": "ok"}}, "engines[0].status"),
    ({"outcome": {"state": "paused"}}, "engines[0].state"),
])
def test_a_misspelt_word_in_a_result_is_refused(over, field):
    with pytest.raises(errors.ProtocolError, match=re.escape(f"$.result.{field}")):
        _decode_result(_result(**over))


def test_every_status_the_controller_stores_reads_back():
    """A stored result says what the controller wrote, ``recovered`` included; a history
    entry of an operation in progress says ``running``."""
    for status in OutcomeStatus:
        back = _decode_result(_result(status="interrupted", outcome={"status": status.value}))
        assert back.engines[0].status is status and back.status is OperationStatus.INTERRUPTED
    history = p.HistoryReply(operations=[p.OperationSummary(
        op_id="o", kind="prepare", engines=["e"], status="running", wall=1.0)], records=[])
    back = p.decode_reply(p.reply_frames(2, history)).result
    assert back.operations[0].status is OperationStatus.RUNNING
    assert back.operations[0].kind is OperationKind.PREPARE


@pytest.mark.parametrize("body, field", [
    ({"type": "StateChanged", "engine": "e",
      "transition": {**_transition("seal"), "dest": "sleeping"}}, "transition.dest"),
    ({"type": "StateChanged", "engine": "e", "transition": _transition("jump")},
     "transition.trigger"),
    ({"type": "MemoryReported", "engine": "e", "op_id": "o",
      "report": {"action": "sleep"}}, "report.action"),
    ({"type": "MemoryReported", "engine": "e", "op_id": "o",
      "report": {"action": "release", "level": 5}}, "report.level"),
])
def test_a_misspelt_word_in_an_event_is_refused(body, field):
    with pytest.raises(errors.ProtocolError, match=re.escape(f"$.body.{field}")):
        p.decode_reply(_raw_event(body))


def test_a_heartbeat_names_a_state_or_serving():
    """An agent's heartbeat carries its engine's state; the controller's says ``serving``."""
    for state in (CheckpointState.PREPARED, "serving"):
        ev = p.decode_reply(_raw_event({"type": "Heartbeat", "engine": "e", "state": state,
                                        "seq": 1, "monotonic": 1.0, "incarnation": 0}))
        assert ev.body.state == state
