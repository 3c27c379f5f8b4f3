"""The fleet as ``ckptctl fleet`` reads it: every node and engine etcd holds, in one view.

``read`` takes one consistent snapshot (two ranges, nodes and engines, at one revision) and
joins them: an engine whose node has no live record (its lease expired, or it stopped) is
shown with ``node_up`` false and its last known state. ``engine_endpoint`` reads one engine's
published endpoint (``EngineClient.for_engine`` follows an engine by name with it).
Neighbours: ``keys`` (the records), ``etcd`` (the client), ``cli.fleet_cmd`` (the tables and
JSON), ``engine.client`` (follows an engine).
"""

from __future__ import annotations

import msgspec

from ckpt_controller.errors import ProtocolError, UsageError
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


def engine_endpoint(client: Etcd, keys: Keys, engine: str, kind: str = "api") -> str:
    """The endpoint of ``kind`` (``api``, ``control``) that ``engines/<engine>`` publishes:
    where the engine is reached now (its owner writes it, the node's ``[fleet] address`` in
    place of a wildcard host). ``UsageError`` when the engine is not in the registry or
    publishes no such endpoint, ``ProtocolError`` for a record this ckptctl cannot read,
    ``UnreachableError`` (exit 4) when etcd is unavailable."""
    key = keys.engine(engine)
    kv = client.get(key)
    if kv is None:
        raise UsageError(f"engine {engine} is not in the fleet's registry ({key} is absent)",
                         engine=engine, key=key)
    try:
        rec = decode_engine(kv.value)
    except msgspec.DecodeError as err:  # policy: damaged: said, with the key to look at
        raise ProtocolError(f"engine {engine}'s record in etcd cannot be read: {err}",
                            engine=engine, key=key) from None
    if rec.schema > SCHEMA:
        raise ProtocolError(f"engine {engine}'s record has schema {rec.schema}, newer than "
                            f"this ckptctl's {SCHEMA}", engine=engine, key=key)
    endpoint = rec.endpoints.get(kind)
    if not endpoint:
        raise UsageError(f"engine {engine} publishes no {kind} endpoint (it publishes: "
                         f"{', '.join(sorted(rec.endpoints)) or 'none'}; its node "
                         f"{rec.node} may run an older ckpt-controller, or the engine has "
                         f"no {kind})", engine=engine, node=rec.node, kind=kind,
                         published=sorted(rec.endpoints))
    return endpoint
