"""The fleet's records as etcd holds them, decoded without etcd: what a damaged or hostile
value does to the decoders the coordinator and the nodes use."""

from __future__ import annotations

import msgspec
import pytest

from ckpt_controller.fleet import ops
from ckpt_controller.fleet.keys import FleetOp, encode


@pytest.mark.parametrize("decoder", [ops._op_dec, ops.task_dec], ids=["op", "task"])
def test_parameters_nested_without_end_are_a_decode_error_not_a_recursion(decoder):
    deep = b'{"params":{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(deep)


def test_every_parameter_the_cli_sends_round_trips():
    params = {"deadline_s": 30.0, "drain": "keep", "drain_timeout_s": None, "level": 2,
              "tags": ["kv_cache", "weights"], "all_or_nothing": True, "reason": "drill",
              "residual_budget_bytes": 1 << 30, "image": "op-1"}
    op = FleetOp(op_id="x", kind="prepare", engines=["a"], params=params, max_unavailable=1,
                 created=1.0)
    assert ops._op_dec.decode(encode(op)).params == params


class _OneKey:
    """Stands in for ``fleet.etcd.Etcd``: ``get`` answers one value for every key."""

    def __init__(self, value: bytes) -> None:
        self.value = value

    def get(self, key: str):
        from ckpt_controller.fleet.etcd import KeyValue

        return KeyValue(key=key, value=self.value, mod_revision=7, create_revision=1, lease=0)


@pytest.mark.parametrize("value", [b"{not json", b"[]", b'{"a": 1}',
                                   b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
                         ids=["garbage", "a-list", "not-a-name", "nested"])
def test_a_damaged_unavailable_record_is_said_and_nothing_counts_on_it(value):
    from ckpt_controller.fleet.keys import Keys

    with pytest.raises(ops.DamagedRecord) as info:
        ops.read_unavailable(_OneKey(value), Keys("/ckpt"))
    assert "etcdctl put /ckpt/unavailable '{}'" in info.value.message
    assert ops.read_unavailable(_OneKey(b'{"a": "op-1"}'), Keys("/ckpt")) == ({"a": "op-1"}, 7)


class _StderrInterruptedOnce:
    """stderr whose first write is where Ctrl-C lands: the moment after the submit."""

    def __init__(self) -> None:
        self.text, self.hit = "", False

    def write(self, text: str) -> int:
        if not self.hit:
            self.hit = True
            raise KeyboardInterrupt
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("when", ["submitting", "announcing", "following"])
def test_ctrl_c_at_any_moment_says_what_became_of_the_operation(when, monkeypatch, capsys):
    """Ctrl-C ends ``fleet cycle``, never the operation; the command says so whether the
    interrupt comes during the submit or any moment after it (CI once caught the moment
    between the submit and the first line of progress answering 130 with nothing said)."""
    import contextlib

    from ckpt_controller.cli import fleet_cmd, main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def submitted(client, keys, **kw):
        return FleetOp(op_id=kw["op_id"], kind=kw["kind"], engines=kw["engines"],
                       params=kw["params"], max_unavailable=1, created=1.0)

    monkeypatch.setattr(fleet_cmd, "client", lambda args: contextlib.nullcontext(None))
    monkeypatch.setattr(ops, "submit", interrupted if when == "submitting" else submitted)
    monkeypatch.setattr(fleet_cmd, "follow", interrupted)
    stderr = _StderrInterruptedOnce()
    if when == "announcing":
        monkeypatch.setattr("sys.stderr", stderr)
    assert main(["--etcd", "http://127.0.0.1:1", "fleet", "cycle", "e0", "--op-id",
                 "op-7"]) == 130
    err = stderr.text if when == "announcing" else capsys.readouterr().err
    if when == "submitting":
        assert "may be recorded" in err and "--op-id op-7" in err
    else:
        assert "fleet operation op-7 goes on" in err
