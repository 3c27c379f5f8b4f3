"""What a server sends its subscribers unasked: transitions, drain progress, memory
reports, heartbeats, and the controller's journal records (``watch``).
Neighbours: ``results`` (the records events carry), ``codec``, ``rpcserver`` (publishes),
``rpc`` (receives).
"""

from __future__ import annotations

import msgspec

from ckpt_controller.protocol.commands import ServerState
from ckpt_controller.protocol.results import JournalRecord, MemoryReport, TransitionRecord

# ---------------------------------------------------------------- events (agent -> subscribers)


class StateChanged(msgspec.Struct, kw_only=True, tag=True):
    engine: str
    transition: TransitionRecord
    op_id: str | None = None


class DrainProgress(msgspec.Struct, kw_only=True, tag=True):
    engine: str
    op_id: str
    in_flight: int
    completed: int
    aborted: int
    kept: int
    elapsed_s: float


class MemoryReported(msgspec.Struct, kw_only=True, tag=True):
    engine: str
    op_id: str
    report: MemoryReport


class Heartbeat(msgspec.Struct, kw_only=True, tag=True):
    engine: str
    #: see ``ServerState``
    state: ServerState
    seq: int
    monotonic: float
    incarnation: int


class Journaled(msgspec.Struct, kw_only=True, tag=True):
    """Controller: a record just written to the journal (what ``watch`` shows)."""

    record: JournalRecord


class JournaledMany(msgspec.Struct, kw_only=True, tag=True):
    """Controller: records written one after another, in their order, in one message (a
    fan-out's round of records costs one message per subscriber, not one per record).
    ``RpcClient`` hands them on as ``Journaled`` events, one each."""

    records: list[JournalRecord]


EventBody = StateChanged | DrainProgress | MemoryReported | Heartbeat | Journaled | JournaledMany


class Event(msgspec.Struct, kw_only=True):
    body: EventBody
