"""The fleet as its readers see it: every node and engine etcd holds in one view, and where
one engine is reached now.

``published_endpoints`` is what a node publishes of an engine's endpoints (a wildcard host
given the node's address). ``read`` takes one consistent snapshot (two ranges, nodes and
engines, at one revision) and joins them: an engine whose node has no live record (its lease
expired, or it stopped) is shown with ``node_up`` false and its last known state.
``engine_endpoint`` reads one engine's published endpoint. ``Resolver`` is what the fleet
gives the clients that follow an engine by name (``engine.client.EngineClient.for_engine``,
``adapters.vllm.follow.FollowingVllm``): they ask it where the engine is, and know nothing
of etcd.
Neighbours: ``records`` (the records), ``etcd`` (the client), ``cli.fleet_cmd`` (the tables
and JSON), ``engine.client`` and ``adapters.vllm.follow`` (resolver users).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from ckpt_controller.errors import DamagedRecordError, UsageError
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.etcd import Etcd, _b64, prefix_end
from ckpt_controller.fleet.keys import Keys

#: the version of ``fleet status --json``'s shape
VIEW_VERSION = 1


#: hosts an endpoint binds to for every address: clients cannot reach the engine there
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]"})


def published_endpoints(endpoints: dict[str, str], control: str, address: str) -> dict[str, str]:
    """What an engine record publishes: the agent's endpoints (``StatusReply.endpoints``),
    each tcp:// one bound to a wildcard host given this node's ``[fleet] address`` instead;
    ``control`` (the configured one) when the agent names none (an older agent, or none
    reached)."""
    out = {kind: reachable_at(endpoint, address) for kind, endpoint in endpoints.items()}
    out.setdefault("control", control)
    return out


def reachable_at(endpoint: str, address: str) -> str:
    """``endpoint`` (``tcp://``, ``http://`` or ``https://``) with a wildcard host (0.0.0.0,
    *, ::) replaced by ``address`` (an IPv6 address in brackets); any other endpoint as it
    is. An http URL keeps its path."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "http", "https"):
        return endpoint
    authority, slash, path = rest.partition("/")
    host, sep, port = authority.rpartition(":")
    if not sep or host not in WILDCARD_HOSTS:
        return endpoint
    return f"{scheme}://{f'[{address}]' if ':' in address else address}:{port}{slash}{path}"


class EngineRow(msgspec.Struct, kw_only=True):
    engine: r.EngineRecord
    node_up: bool


class FleetView(msgspec.Struct, kw_only=True):
    version: int = VIEW_VERSION
    #: etcd's revision the view was read at
    revision: int
    nodes: list[r.NodeRecord]
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
    nodes = {rec.node: rec for rec in _readable(client.kvs(nodes_reply), r.NodeRecord,
                                                unreadable)}
    rows = [EngineRow(engine=rec, node_up=rec.node in nodes)
            for rec in _readable(client.kvs(engines_reply), r.EngineRecord, unreadable)]
    rows.sort(key=lambda row: (row.engine.node, row.engine.engine))
    return FleetView(revision=revision, nodes=sorted(nodes.values(), key=lambda n: n.node),
                     engines=rows, unreadable=unreadable)


def _readable(kvs, kind: type, unreadable: dict[str, str]) -> list:
    """The records of ``kvs`` that read as ``kind``; the others go to ``unreadable``."""
    out = []
    for kv in kvs:
        try:
            out.append(r.decode(kind, kv.value, kv.key))
        except DamagedRecordError as err:  # policy: damaged: listed as unreadable, shown
            unreadable[kv.key] = err.message
    return out


def engine_endpoint(client: Etcd, keys: Keys, engine: str, kind: str = "api") -> str:
    """The endpoint of ``kind`` (``api``, ``control``, ``http``) that ``engines/<engine>``
    publishes: where the engine is reached now (its owner writes it, the node's ``[fleet]
    address`` in place of a wildcard host). ``UsageError`` when the engine is not in the
    registry or publishes no such endpoint, ``DamagedRecordError`` (a ``ProtocolError``) for
    a record this version cannot read, ``UnreachableError`` (exit 4) when etcd is
    unavailable."""
    key = keys.engine(engine)
    rec = r.read(client, key, r.EngineRecord)
    if rec is None:
        raise UsageError(f"engine {engine} is not in the fleet's registry ({key} is absent)",
                         engine=engine, key=key)
    endpoint = rec.endpoints.get(kind)
    if not endpoint:
        raise UsageError(f"engine {engine} publishes no {kind} endpoint (it publishes: "
                         f"{', '.join(sorted(rec.endpoints)) or 'none'}; its node "
                         f"{rec.node} may run an older ckpt-controller, or the engine has "
                         f"no {kind})", engine=engine, node=rec.node, kind=kind,
                         published=sorted(rec.endpoints))
    return endpoint


class Resolver:
    """Where an engine is reached now, by name, from the fleet's registry: a client that
    follows an engine across migrations calls it (``resolver(engine, kind)``: the endpoint
    of ``kind``, ``api`` or ``http``) and ``close``s it with itself. ``watch(engine, wake)``
    calls ``wake()`` (on a thread of its own) whenever the engine's record changes, so the
    client looks it up again at once: a migration's target publishes the record as soon as
    the engine runs there.

    ``etcd``: client URLs (a comma-separated string or a list), or an ``Etcd`` (closed with
    the resolver); ``prefix``: the fleet's keys (``[fleet] prefix``); ``ca_cert``, ``cert``,
    ``key``: TLS; ``timeout_s``: each member's time to answer one read. Errors as
    ``engine_endpoint``."""

    def __init__(self, etcd: str | Sequence[str] | Etcd, *, prefix: str = "/ckpt",
                 ca_cert: Path | None = None, cert: Path | None = None,
                 key: Path | None = None, timeout_s: float | None = None) -> None:
        if isinstance(etcd, Etcd):
            self.etcd = etcd
        else:
            urls = [u.strip() for u in etcd.split(",")] if isinstance(etcd, str) else list(etcd)
            extra = {} if timeout_s is None else {"timeout_s": timeout_s}
            self.etcd = Etcd([u for u in urls if u], ca_cert=ca_cert, cert=cert, key=key,
                             **extra)
        self.keys = Keys(prefix)
        self._stop = threading.Event()

    def __call__(self, engine: str, kind: str) -> str:
        return engine_endpoint(self.etcd, self.keys, engine, kind)

    def watch(self, engine: str, wake: Callable[[], None]) -> None:
        """``wake()`` at each change of ``engine``'s record (and when the watch is made
        again after etcd was away), until ``close``."""
        key = self.keys.engine(engine)
        threading.Thread(target=self.etcd.watch, args=(key, key + "\x00", wake, self._stop),
                         name=f"registry-watch-{engine}", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self.etcd.close()
