"""The fleet as ``ckptctl fleet`` reads it: every node and engine etcd holds, in one view.

``read`` takes one consistent snapshot (two ranges, nodes and engines, at one revision) and
joins them: an engine whose node has no live record (its lease expired, or it stopped) is
shown with ``node_up`` false and its last known state. Neighbours: ``keys`` (the records),
``etcd`` (the client), ``cli.fleet_cmd`` (the tables and JSON).
"""

from __future__ import annotations

import msgspec

from ckpt_controller.fleet.etcd import Etcd, prefix_end, _b64
from ckpt_controller.fleet.keys import (
    SCHEMA,
    EngineRecord,
    Keys,
    NodeRecord,
    decode_engine,
    decode_node,
)

#: the version of ``fleet status --json``'s shape
VIEW_VERSION = 1


class EngineRow(msgspec.Struct, kw_only=True):
    engine: EngineRecord
    node_up: bool


class FleetView(msgspec.Struct, kw_only=True):
    version: int = VIEW_VERSION
    #: etcd's revision the view was read at
    revision: int
    nodes: list[NodeRecord]
    engines: list[EngineRow]
    #: records that could not be read (a newer schema, a damaged value): key -> why
    unreadable: dict[str, str] = {}


def read(client: Etcd, keys: Keys) -> FleetView:
    nodes_reply = client.call("kv/range", {"key": _b64(keys.nodes),
                                           "range_end": _b64(prefix_end(keys.nodes))})
    revision = int(nodes_reply.get("header", {}).get("revision", 0))
    engines_reply = client.call("kv/range", {"key": _b64(keys.engines),
                                             "range_end": _b64(prefix_end(keys.engines)),
                                             "revision": revision})
    unreadable: dict[str, str] = {}
    nodes = {rec.node: rec for rec in _readable(client.kvs(nodes_reply), decode_node,
                                                unreadable)}
    rows = [EngineRow(engine=rec, node_up=rec.node in nodes)
            for rec in _readable(client.kvs(engines_reply), decode_engine, unreadable)]
    rows.sort(key=lambda r: (r.engine.node, r.engine.engine))
    return FleetView(revision=revision, nodes=sorted(nodes.values(), key=lambda n: n.node),
                     engines=rows, unreadable=unreadable)


def _readable(kvs, decode, unreadable: dict[str, str]) -> list:
    """The records of ``kvs`` that ``decode`` reads and whose schema this ckptctl knows; the
    others go to ``unreadable`` (key -> why)."""
    out = []
    for kv in kvs:
        try:
            rec = decode(kv.value)
        except msgspec.DecodeError as err:  # policy: damaged: listed as unreadable, shown
            unreadable[kv.key] = str(err)
            continue
        if rec.schema > SCHEMA:
            unreadable[kv.key] = f"schema {rec.schema} is newer than this ckptctl's {SCHEMA}"
            continue
        out.append(rec)
    return out
