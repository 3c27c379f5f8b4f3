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
