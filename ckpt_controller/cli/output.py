"""Every ``--json`` document ``ckptctl`` prints, in its documented shape (docs/json.md).

Each document is one JSON object with ``version`` (``SCHEMA_VERSION``) and ``kind`` (the
shape's name in user terms: ``status``, ``operation``, ``history``, ``record``,
``agent-status``, ``fleet-status``, ``error``...) first. Inside, nothing names an internal
type: a tagged protocol Struct's ``"type": "StatusReply"`` is left out, an enum is its word,
and every wall time is two fields: ``<name>_at`` (ISO 8601, UTC, milliseconds) and
``<name>_at_unix`` (seconds since the epoch). Durations are seconds (``*_s``), sizes bytes
(``*_bytes``). Which field of which Struct is renamed is said once, in ``WALL_TIMES``,
``RENAMED`` and ``LEFT_OUT``.

A document is built by ``document(kind, body)``; ``emit`` prints it as one line, flushed when
it is one of a stream (``watch --json``: JSON lines). Imports msgspec only: the Structs it
walks come from its callers. Neighbours: ``cli.common``, the
``*_cmds`` modules (each ``--json`` goes through here), ``protocol`` and ``fleet.keys`` (the
Structs), docs/json.md (the shapes, checked against real output by tests/cli/test_json_shapes.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import sys
from typing import Any

import msgspec

from ckpt_controller.vocab import Trigger

#: the shapes' version: it changes only when a field is removed, renamed or changes meaning
#: (new fields may appear in any version; a reader ignores fields it does not know)
SCHEMA_VERSION = 1

#: a Struct's wall-time fields (seconds since the epoch) -> the name they go out under
#: (``<name>`` as ISO 8601 and ``<name>_unix`` as the number)
WALL_TIMES: dict[str, dict[str, str]] = {
    "TransitionRecord": {"wall": "changed_at"},
    "PhaseRecord": {"wall": "started_at"},
    "OperationResult": {"wall": "started_at"},
    "OperationSummary": {"wall": "started_at"},
    "LastOperation": {"wall": "started_at"},
    "JournalRecord": {"wall": "written_at"},
    # fleet records (``fleet.keys``, ``fleet.migration``)
    "NodeRecord": {"started": "started_at"},
    "EngineRecord": {"since": "since_at", "updated": "updated_at"},
    "FleetOp": {"created": "created_at", "ended": "ended_at"},
    "Part": {"started": "started_at", "ended": "ended_at"},
    "StepEnd": {"started": "started_at", "ended": "ended_at"},
    "Migration": {"step_started": "step_started_at"},
    "ImageInfo": {"wall": "changed_at"},
    "Manifest": {"wall": "written_at"},
}

#: fields that go out under another name, where the Struct's own name would be ambiguous
#: next to the document's ``kind`` or read as a type
RENAMED: dict[str, dict[str, str]] = {
    "OperationResult": {"kind": "operation"},
    "OperationSummary": {"kind": "operation"},
    "LastOperation": {"kind": "operation"},
    "JournalRecord": {"type": "record_type"},
    "EngineView": {"kind": "engine_kind"},
    "FleetOp": {"kind": "operation"},
    "RequestEvent": {"type": "event", "timestamp": "monotonic"},
}

#: fields left out: storage details of a record (its etcd schema number), the fleet
#: view's own version (the document's ``version`` says it), and the status reply's mark
#: that its views carry ``last_op`` (a transport detail for ``ckptctl status``)
LEFT_OUT: dict[str, set[str]] = {
    "NodeRecord": {"schema"}, "EngineRecord": {"schema"}, "FleetOp": {"schema"},
    "Part": {"schema"}, "Migration": {"schema"}, "FleetView": {"version"},
    "ControllerStatusReply": {"last_ops"},
}


def iso(wall: float | None) -> str | None:
    """``wall`` (seconds since the epoch) as ISO 8601 in UTC, to the millisecond."""
    if wall is None:
        return None
    return datetime.datetime.fromtimestamp(wall, datetime.timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def wall_time(name: str, wall: float | None) -> dict[str, Any]:
    """The two fields one wall time goes out as: ``name`` (ISO) and ``name_unix``."""
    return {name: iso(wall), f"{name}_unix": wall}


def plain(value: Any) -> Any:
    """``value`` as JSON-ready builtins in the documented shape: Structs (and dataclasses) as
    objects without their tag, with ``WALL_TIMES``/``RENAMED``/``LEFT_OUT`` applied; enums as
    their words; tuples and sets as lists."""
    if isinstance(value, msgspec.Struct):
        name = type(value).__name__
        return _fields(name, ((f, getattr(value, f)) for f in value.__struct_fields__))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields(type(value).__name__, ((f.name, getattr(value, f.name))
                                              for f in dataclasses.fields(value)))
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    return value


def _fields(name: str, items) -> dict[str, Any]:
    walls, renamed, left_out = WALL_TIMES.get(name, {}), RENAMED.get(name, {}), \
        LEFT_OUT.get(name, set())
    out: dict[str, Any] = {}
    for field, value in items:
        if field in left_out:
            continue
        if field in walls:
            out.update(wall_time(walls[field], value))
        else:
            out[renamed.get(field, field)] = plain(value)
    return out


def document(kind: str, body: Any = None, **more: Any) -> dict[str, Any]:
    """One document: ``version``, ``kind``, then ``body``'s fields (a Struct, a dataclass or
    a dict, made ``plain``) and ``more``."""
    doc: dict[str, Any] = {"version": SCHEMA_VERSION, "kind": kind}
    if body is not None:
        doc.update(plain(body))
    doc.update(plain(more))
    return doc


def emit(kind: str, body: Any = None, *, stream: bool = False, **more: Any) -> None:
    """Print ``document(kind, body, **more)`` as one line on stdout; ``stream`` flushes it at
    once (a line of ``watch --json``, read by a pipe as it comes)."""
    sys.stdout.write(msgspec.json.encode(document(kind, body, **more)).decode() + "\n")
    if stream:
        sys.stdout.flush()


def emit_error(err) -> None:
    """What a command run with ``--json`` prints when it ends with a ``CkptError``: an
    ``error`` document (its ``error.kind`` is the error's class in ``ckpt_controller.errors``,
    a public name: the Python client raises the same class)."""
    from ckpt_controller.protocol import to_plain

    emit("error", error={"kind": err.kind, "message": err.message,
                         "exit_code": err.exit_code, "details": to_plain(err.details)})


# ---------------------------------------------------------------- kinds by result type

#: an agent's or the controller's reply -> the kind of its document
RESULT_KINDS = {
    "ControllerStatusReply": "status",
    "OperationResult": "operation",
    "HistoryReply": "history",
    "StatusReply": "agent-status",
    "PrepareReply": "agent-prepare",
    "RestoreReply": "agent-restore",
}

#: an agent's event -> the word its ``agent-event`` line carries in ``event``
EVENT_WORDS = {
    "StateChanged": "state_changed",
    "DrainProgress": "drain_progress",
    "MemoryReported": "memory_reported",
    "Heartbeat": "heartbeat",
    "Journaled": "journaled",
}


def result_kind(result: Any, action: str | None = None) -> str:
    """The kind of a reply's document; ``action`` tells a rollback's ``RestoreReply`` from a
    restore's (``agent-rollback``)."""
    name = type(result).__name__
    if name == "RestoreReply" and action == Trigger.ROLLBACK:
        return "agent-rollback"
    return RESULT_KINDS[name]


def event_body(ev: Any) -> dict[str, Any]:
    """An agent's event as the body of an ``agent-event`` line (``agent watch --json``)."""
    return {"event": EVENT_WORDS[type(ev).__name__], **plain(ev)}
