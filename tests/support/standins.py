"""Stand-ins for what a node's migration code talks to, for tests of its rules without etcd
or CRIU (``test_migration_settle.py``, ``test_migration_fence.py``)."""

from __future__ import annotations

from ckpt_controller.fleet.etcd import KeyValue


class StandInEtcd:
    """``get_prefix`` in key order, as etcd answers a range; ``get`` one key; ``put`` one
    (the test's own writes: a record that changed meanwhile)."""

    def __init__(self, kvs: list[KeyValue]) -> None:
        self.kvs = sorted(kvs, key=lambda kv: kv.key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return [kv for kv in self.kvs if kv.key.startswith(prefix)]

    def get(self, key: str) -> KeyValue | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def put(self, key: str, value: bytes) -> None:
        rev = max((kv.mod_revision for kv in self.kvs), default=0) + 1
        old = self.get(key)
        self.kvs = sorted([kv for kv in self.kvs if kv.key != key]
                          + [KeyValue(key, value, rev, old.create_revision if old else rev, 0)],
                          key=lambda kv: kv.key)
