"""What the fleet stores in etcd (JSON, msgspec Structs typed with the vocabulary), and the one
way every record is read back.

The shapes are kept plain (strings, numbers, string maps), so that an operator on the same
data (kopf, say) can read them; the words in them are ``vocab``'s values (``running``,
``pending``, ``moved``, ...), so a record written by an earlier version reads the same.
Every read of a record goes through ``decode`` (or ``read``/``read_all``): a value that is not
JSON, not the shape its key holds, or of a newer ``schema`` is a ``DamagedRecordError`` naming
the key, never a decoder's traceback. Where the key layout is: ``keys``.
Neighbours: ``keys``, ``etcd`` (``KeyValue``), ``vocab`` (the words), every fleet module that
reads or writes a record.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from ckpt_controller.errors import DamagedRecordError
from ckpt_controller.vocab import (
    CheckpointState,
    FleetKind,
    ImageTransport,
    MigrationOutcome,
    MigrationStep,
    NodeRole,
    OperationStatus,
    PartStatus,
)

#: the version of the records' shape; a reader refuses a newer one
SCHEMA = 1

#: a node-local operation's parameter as etcd holds it: a scalar, or a list of tags. Typed so
#: that a value nested without end is refused at its second level (an untyped one was decoded
#: to Python's recursion limit and stopped every fleet operation)
Param = str | int | float | bool | None | list[str]


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
    #: the node's network namespace (``BOOT_ID/INODE``), so a migration between two nodes
    #: that share one is refused up front; None from a node that does not say
    netns: str | None = None


class EngineRecord(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    engine: str
    node: str
    #: the agent's state; None when the node could not reach the agent (``reachable``)
    state: CheckpointState | None
    generation: int | None = None
    #: the operation that holds the engine now, if any
    holder: str | None = None
    #: the last operation that held it (this one while it runs)
    last_op: str | None = None
    labels: dict[str, str] = {}
    #: where the engine is reached: ``control`` (its agent), ``api``, ``http``
    endpoints: dict[str, str] = {}
    reachable: bool = True
    pid: int | None = None
    #: whether the engine is the init of a PID namespace of its own (a migration needs it);
    #: None when its node could not tell
    own_pid_namespace: bool | None = None
    #: wall time the engine entered its state (its agent's last transition), if known
    since: float | None = None
    #: wall time the node wrote this record
    updated: float = 0.0
    #: memory tag -> the file a level-2 re-wake reads it back from (``StatusReply``): what
    #: a migration's target must read byte for byte the same
    reload_files: dict[str, str] = {}

    def content(self) -> tuple:
        """What a change is: everything but ``updated``."""
        return (self.state, self.generation, self.holder, self.last_op,
                tuple(sorted(self.labels.items())), tuple(sorted(self.endpoints.items())),
                self.reachable, self.pid, self.since, self.node,
                tuple(sorted(self.reload_files.items())))


class FleetOp(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    op_id: str
    kind: FleetKind
    engines: list[str]
    #: the node-local operation's parameters (``OperationCommand`` fields)
    params: dict[str, Param] = {}
    max_unavailable: int
    created: float
    #: running, then succeeded or failed
    status: OperationStatus = OperationStatus.RUNNING
    error: str | None = None
    ended: float | None = None


class Part(msgspec.Struct, kw_only=True):
    """One engine's part of a fleet operation (``PartStatus``): pending, started (in its
    node's inbox), then succeeded, failed, lost (its node died while it ran) or skipped."""

    engine: str
    node: str
    status: PartStatus = PartStatus.PENDING
    #: the node-local operation's id: the same on every try, so it runs at most once
    local_op: str
    state: CheckpointState | None = None
    error: str | None = None
    started: float | None = None
    ended: float | None = None
    #: whether ``unavailable`` has been brought up to date after the part ended
    settled: bool = False


class Task(msgspec.Struct, kw_only=True):
    """A started part, or a migration's step, as its node's inbox holds it: all the node
    needs to run it and to write its end, so the node reads nothing else."""

    op_id: str
    kind: FleetKind
    engine: str
    node: str
    local_op: str
    params: dict[str, Param] = {}
    started: float
    #: the migration step to run (kind ``migrate``); None for a part
    step: MigrationStep | None = None


class StepEnd(msgspec.Struct, kw_only=True):
    """How a migration step ended, written by its node (or by the coordinator: ``lost``)."""

    step: MigrationStep
    node: str
    #: succeeded, failed or lost (its node died while it ran)
    status: PartStatus
    started: float | None = None
    ended: float
    error: str | None = None
    #: what the step found out for the next ones (the page server's address, the image)
    detail: dict[str, Param] = {}


class Migration(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    op_id: str
    engine: str
    source: str
    target: str
    #: the target's ``[migration] image_transport``, once it received
    transport: ImageTransport | None = None
    #: the node-local prepare's parameters (drain mode, its timeout, level)
    params: dict[str, Param] = {}
    #: memory tag -> the file a level-2 re-wake reads it back from, as the engine's record
    #: said when the migration was asked for (the target must read the same bytes there)
    reload_files: dict[str, str] = {}
    #: the step that runs now (``started``: in its node's inbox), or the one to start next
    step: MigrationStep | None = None
    started: bool = False
    step_started: float | None = None
    #: the steps that ended, in order
    done: list[StepEnd] = []
    outcome: MigrationOutcome = MigrationOutcome.RUNNING
    error: str | None = None

    def detail(self, step: MigrationStep) -> dict:
        """What ``step`` reported when it last succeeded ({} if it never did)."""
        for end in reversed(self.done):
            if end.step == step and end.status is PartStatus.SUCCEEDED:
                return end.detail
        return {}

    def node_of(self, step: MigrationStep) -> str:
        """The node that runs ``step`` (the source or the target)."""
        return self.target if step.runs_on is NodeRole.TARGET else self.source


#: ``unavailable``'s value: engine -> what took it out (an op id, or ``lost:<op>``)
Unavailable = dict[str, str]

#: what ``unavailable`` says of an engine whose node died under a part of ``op``
LOST_PREFIX = "lost:"


def lost_mark(op_id: str) -> str:
    return LOST_PREFIX + op_id


encode = msgspec.json.encode

T = TypeVar("T")
_decoders: dict[object, msgspec.json.Decoder] = {}


def decode(kind: type[T], raw: bytes, key: str) -> T:
    """The record of type ``kind`` in ``raw``, the value of ``key``; ``DamagedRecordError``
    naming the key when it cannot be read (malformed JSON, another shape, a newer schema)."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        rec = dec.decode(raw)
    except msgspec.ValidationError as err:
        # policy: an inbox written by an earlier version said ``migrate-<step>``: read it
        if kind is Task and (old := _old_task(raw)) is not None:
            return old  # type: ignore[return-value]
        raise DamagedRecordError(f"{key} is damaged and cannot be read: {err}",
                                 key=key) from None
    except msgspec.DecodeError as err:  # policy: said with its key; the caller decides
        raise DamagedRecordError(f"{key} is damaged and cannot be read: {err}",
                                 key=key) from None
    schema = getattr(rec, "schema", SCHEMA)
    if schema > SCHEMA:
        raise DamagedRecordError(f"{key} has schema {schema}, newer than this version's "
                                 f"{SCHEMA}", key=key, schema=schema)
    return rec


def read(client, key: str, kind: type[T]) -> T | None:
    """The record at ``key`` (None: absent); ``DamagedRecordError`` as ``decode``."""
    kv = client.get(key)
    return None if kv is None else decode(kind, kv.value, key)


def read_all(client, prefix: str, kind: type[T],
             damaged: dict[str, str] | None = None) -> list[tuple[T, object]]:
    """Every record under ``prefix`` with its ``KeyValue``, in key order. A damaged one is
    put in ``damaged`` (key -> why) and left out when ``damaged`` is given, else raised."""
    out = []
    for kv in client.get_prefix(prefix):
        try:
            out.append((decode(kind, kv.value, kv.key), kv))
        except DamagedRecordError as err:
            if damaged is None:
                raise
            damaged[kv.key] = err.message  # policy: listed as damaged; the others go on
    return out


class _OldTask(msgspec.Struct, kw_only=True):
    """A ``Task`` as an earlier version wrote a migration step's: kind ``migrate-<step>``."""

    op_id: str
    kind: str
    engine: str
    node: str
    local_op: str
    params: dict[str, Param] = {}
    started: float


def _old_task(raw: bytes) -> Task | None:
    try:
        old = msgspec.json.decode(raw, type=_OldTask)
        step = MigrationStep(old.kind.removeprefix(f"{FleetKind.MIGRATE}-"))
    except (msgspec.DecodeError, ValueError):  # policy: not that shape either: damaged
        return None
    if old.kind != f"{FleetKind.MIGRATE}-{step}":
        return None
    return Task(op_id=old.op_id, kind=FleetKind.MIGRATE, step=step, engine=old.engine,
                node=old.node, local_op=old.local_op, params=old.params, started=old.started)
