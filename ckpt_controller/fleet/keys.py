"""Where the fleet lives in etcd, and what is stored there (JSON, msgspec Structs).

Under the configured prefix (default ``/ckpt``):

- ``nodes/<node>``: a ``NodeRecord``, under the node controller's lease: present while the
  node is alive (it keeps the lease alive), gone within the lease's TTL after it dies, at once
  when it stops cleanly (the lease is revoked).
- ``owners/<engine>``: the name of the node that owns the engine; engine names are unique in
  the fleet. Written only by a transaction that finds it absent (or the node's own), so two
  nodes configured with one name do not both publish it.
- ``engines/<engine>``: an ``EngineRecord``, written by its owner only (a transaction that
  checks ``owners/<engine>``). Not under the lease: when a node dies its engines stay listed,
  with their last state, and ``fleet status`` shows their node as down.
- ``locks/<engine>``: the id of the (node-local) operation running on the engine, under its
  node's lease: one operation per engine across the fleet.
- ``unavailable``: the engines out of service, fleet-wide, each with the operation that took
  it out (``{"engine": "op id"}``), changed only by transactions that check its revision:
  what ``--max-unavailable`` counts.
- ``ops/<op>``: a fleet operation (``FleetOp``); ``parts/<op>/<engine>``: its part on one
  engine (``Part``); ``todo/<node>/<op>/<engine>``: a started part, in its node's inbox until
  the node has written its result.
- ``coordinator``: the node that drives the fleet operations, under that node's lease.

The shapes are kept plain (strings, numbers, string maps), so that an operator on the same
data (kopf, say) can read them. Neighbours: ``node`` (writes), ``registry`` (reads).
"""

from __future__ import annotations

import msgspec

#: the version of the records' shape; a reader refuses a newer one
SCHEMA = 1


class NodeRecord(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    node: str
    #: the node controller's endpoint (its own clients, e.g. ``ckptctl --controller``)
    controller: str
    pid: int
    host: str
    #: wall time the controller registered (this lease)
    started: float
    version: str
    lease: int


class EngineRecord(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    engine: str
    node: str
    #: the agent's state; None when the node could not reach the agent (``reachable``)
    state: str | None
    generation: int | None = None
    #: the operation that holds the engine now, if any
    holder: str | None = None
    #: the last operation that held it (this one while it runs)
    last_op: str | None = None
    labels: dict[str, str] = {}
    #: where the engine is reached: ``control`` (its agent)
    endpoints: dict[str, str] = {}
    reachable: bool = True
    pid: int | None = None
    #: wall time the engine entered its state (its agent's last transition), if known
    since: float | None = None
    #: wall time the node wrote this record
    updated: float = 0.0

    def content(self) -> tuple:
        """What a change is: everything but ``updated``."""
        return (self.state, self.generation, self.holder, self.last_op,
                tuple(sorted(self.labels.items())), tuple(sorted(self.endpoints.items())),
                self.reachable, self.pid, self.since, self.node)


#: a node-local operation's parameter as etcd holds it: a scalar, or a list of tags. Typed so
#: that a value nested without end is refused at its second level (an untyped one was decoded
#: to Python's recursion limit and stopped every fleet operation)
Param = str | int | float | bool | None | list[str]


class FleetOp(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    op_id: str
    kind: str
    engines: list[str]
    #: the node-local operation's parameters (``OperationCommand`` fields)
    params: dict[str, Param] = {}
    max_unavailable: int
    created: float
    #: running, succeeded or failed
    status: str = "running"
    error: str | None = None
    ended: float | None = None


class Part(msgspec.Struct, kw_only=True):
    """One engine's part of a fleet operation: pending, started (in its node's inbox), then
    succeeded, failed, lost (its node died while it ran) or skipped (never started: the
    operation stopped at a failure)."""

    engine: str
    node: str
    status: str = "pending"
    #: the node-local operation's id: the same on every try, so it runs at most once
    local_op: str
    state: str | None = None
    error: str | None = None
    started: float | None = None
    ended: float | None = None
    #: whether ``unavailable`` has been brought up to date after the part ended
    settled: bool = False


_node_dec = msgspec.json.Decoder(NodeRecord)
_engine_dec = msgspec.json.Decoder(EngineRecord)
encode = msgspec.json.encode


def decode_node(raw: bytes) -> NodeRecord:
    return _node_dec.decode(raw)


def decode_engine(raw: bytes) -> EngineRecord:
    return _engine_dec.decode(raw)


class Keys:
    """The keys under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/")
        self.nodes = f"{self.prefix}/nodes/"
        self.owners = f"{self.prefix}/owners/"
        self.engines = f"{self.prefix}/engines/"

    def node(self, name: str) -> str:
        return self.nodes + name

    def owner(self, engine: str) -> str:
        return self.owners + engine

    def engine(self, engine: str) -> str:
        return self.engines + engine

    @property
    def unavailable(self) -> str:
        return f"{self.prefix}/unavailable"

    @property
    def coordinator(self) -> str:
        return f"{self.prefix}/coordinator"

    def lock(self, engine: str) -> str:
        return f"{self.prefix}/locks/{engine}"

    def op(self, op_id: str) -> str:
        return f"{self.prefix}/ops/{op_id}"

    @property
    def ops(self) -> str:
        return f"{self.prefix}/ops/"

    def parts(self, op_id: str) -> str:
        return f"{self.prefix}/parts/{op_id}/"

    def part(self, op_id: str, engine: str) -> str:
        return f"{self.prefix}/parts/{op_id}/{engine}"

    def inbox(self, node: str) -> str:
        return f"{self.prefix}/todo/{node}/"

    def todo(self, node: str, op_id: str, engine: str) -> str:
        return f"{self.prefix}/todo/{node}/{op_id}/{engine}"
