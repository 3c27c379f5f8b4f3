"""The wire protocol: clients to an engine's agent, and clients to the controller.

Both servers speak the same framing; each serves its own request types (an agent: handshake,
status, prepare, restore, rollback, fail, heartbeat, subscribe; the controller: handshake,
status, operation, history, heartbeat, subscribe) and answers any other with a
``ProtocolError``.

Transport: pyzmq. The agent binds a ROUTER, clients connect a DEALER. Every message is two
frames, ``[type, payload]`` (a ROUTER prepends the peer identity):

- ``type`` is ONE byte (``RequestType`` from a client, ``ReplyType`` from the agent), so a
  frame needs no extra encoding to be routed;
- ``payload`` is a msgpack-encoded msgspec Struct. Every command carries ``version`` and a
  ``call_id`` that the reply repeats, so a client can match replies and drop stale ones.

Schema evolution: new fields only at the end and with defaults; a tag or a type byte never
changes; a change that breaks old peers bumps ``PROTOCOL_VERSION``. This module knows no
sockets and no torch: it only turns Structs into frames and frames into Structs or errors.
Command fields carry their limits (``values``: durations, op ids, sizes, counts), so a frame
with NaN, an empty op id or an absurd size is refused when it is decoded; every state,
trigger, mode, reason, level, step, kind and status is a ``vocab`` enum, so a misspelt one is
refused the same way.
Neighbours: ``agent.server`` and ``agent.client`` move the frames; ``errors`` is carried in
``ErrorReply``; ``values`` defines what a valid field value is; ``vocab`` the words.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from ckpt_controller.errors import CkptError, ProtocolError, VersionMismatchError, from_wire
from ckpt_controller.values import (
    ByteSize,
    Count,
    Duration,
    DurationOrZero,
    HookEnv,
    Names,
    OpId,
    StepOpId,
    Tags,
    Text,
)
from ckpt_controller.vocab import (
    CheckpointState,
    DrainMode,
    Escalation,
    HookPoint,
    MemoryAction,
    OperationKind,
    OperationStatus,
    OutcomeStatus,
    PrepareStep,
    ReleaseLevel,
    RestoreStep,
    Trigger,
)

if TYPE_CHECKING:  # read by name only: importing the protocol loads no lifecycle machine
    from ckpt_controller.lifecycle import Transition

PROTOCOL_VERSION = 2
#: A frame larger than this is refused with a ``ProtocolError`` reply.
MAX_PAYLOAD_BYTES = 1 << 20
#: zmq drops (and disconnects) anything larger than this before we see it.
HARD_MAX_MESSAGE_BYTES = 16 << 20
#: the most operations or records one history request returns
MAX_HISTORY_LIMIT = 100_000


class RequestType(bytes, enum.Enum):
    """First frame of a message from a client."""

    HANDSHAKE = b"\x00"
    STATUS = b"\x01"
    PREPARE = b"\x02"
    RESTORE = b"\x03"
    ROLLBACK = b"\x04"
    HEARTBEAT = b"\x05"
    SUBSCRIBE = b"\x06"
    UNSUBSCRIBE = b"\x07"
    FAIL = b"\x08"
    # served by the controller only
    OPERATION = b"\x10"
    HISTORY = b"\x11"


class ReplyType(bytes, enum.Enum):
    """First frame of a message from the agent."""

    REPLY = b"\x80"
    ERROR = b"\x81"
    EVENT = b"\x82"


#: What a handshake or a heartbeat says its server is in: an agent's ``CheckpointState``, or
#: ``serving`` from the controller (and any ``rpcserver`` without a lifecycle). A plain string:
#: msgspec takes one string type per field, and ``serving`` is no engine state.
ServerState = str


# ---------------------------------------------------------------- commands (client -> agent)


class Command(msgspec.Struct, kw_only=True):
    """Fields every command starts with."""

    call_id: int
    version: int = PROTOCOL_VERSION


class Handshake(Command, kw_only=True):
    client: Text = ""


class StatusCommand(Command, kw_only=True):
    #: controller only: these engines (empty: all)
    engines: Names = []


class HeartbeatCommand(Command, kw_only=True):
    pass


class SubscribeCommand(Command, kw_only=True):
    pass


class PrepareCommand(Command, kw_only=True):
    """Drain, then release memory. ``level`` or ``tags`` (not both) say what to release."""

    op_id: StepOpId
    drain: DrainMode = DrainMode.WAIT
    #: 0: the drain deadline is now (a wait drain escalates at once)
    drain_timeout_s: DurationOrZero = 30.0
    on_deadline: Escalation = Escalation.ABORT
    level: ReleaseLevel | None = ReleaseLevel.OFFLOAD
    tags: Tags | None = None
    residual_budget_bytes: ByteSize | None = None
    deadline_s: Duration | None = None
    #: with ``step="all"``: the release's own limit, counted from the end of the drain
    release_deadline_s: Duration | None = None
    #: all: drain, release, PREPARED in one go. Or one step at a time, so a controller can run
    #: hooks between them: drain (-> stays PREPARING), release (stays PREPARING), seal
    #: (-> PREPARED). A failure in any step rolls back to RUNNING.
    step: PrepareStep = PrepareStep.ALL


class RestoreCommand(Command, kw_only=True):
    """Re-wake what was released, verify, resume scheduling, re-open admission."""

    op_id: StepOpId
    deadline_s: Duration | None = None
    #: all; or rewake (-> RESTORING: memory back and verified, admission still closed) and
    #: then resume (-> RUNNING), so post-restore hooks can check the engine in between
    step: RestoreStep = RestoreStep.ALL


class RollbackCommand(Command, kw_only=True):
    """Return a PREPARING or PREPARED engine to RUNNING (same path as restore)."""

    op_id: StepOpId
    reason: Text = ""
    deadline_s: Duration | None = None


class FailCommand(Command, kw_only=True):
    """Mark the engine FAILED (e.g. a capture left it unusable)."""

    op_id: StepOpId
    reason: Text = ""


class OperationCommand(Command, kw_only=True):
    """Controller: run one operation on some engines (empty list: all configured engines).

    Prepare parameters left ``None`` take the engine's configured defaults."""

    #: names the operation's image folders: see ``values.OP_ID_PATTERN``
    op_id: OpId
    kind: OperationKind
    engines: Names = []
    drain: DrainMode | None = None
    drain_timeout_s: Duration | None = None
    on_deadline: Escalation | None = None
    level: ReleaseLevel | None = None
    tags: Tags | None = None
    residual_budget_bytes: ByteSize | None = None
    #: overall deadline per engine (default: the configured operation deadline)
    deadline_s: Duration | None = None
    #: cycle: at most this many engines out of service at once (default: all at once)
    max_unavailable: Count | None = None
    #: prepare: if one engine fails, roll back the others
    all_or_nothing: bool = True
    reason: Text = ""
    #: restore: the operation (id) whose image to restore, named explicitly; needed for an
    #: image older than the engine's generation (default: the image of this generation)
    image: OpId | None = None
    #: settings for this operation's hooks, added to their environment (``values.HookEnv``:
    #: a fleet migration's stop-and-stay dump into the target's page server, its restore
    #: beside the stopped original)
    hook_env: HookEnv = {}


class HistoryCommand(Command, kw_only=True):
    engine: Text | None = None
    op_id: Text | None = None
    limit: Annotated[int, Meta(ge=1, le=MAX_HISTORY_LIMIT)] = 50


# ---------------------------------------------------------------- results (agent -> client)


class DrainReport(msgspec.Struct, kw_only=True):
    mode: DrainMode
    escalated_to: Escalation | None = None
    in_flight_at_start: int = 0
    completed: int = 0
    aborted: int = 0
    kept: int = 0
    drain_s: float = 0.0


class DeviceMemory(msgspec.Struct, kw_only=True):
    """One device's numbers. CPU: process RSS. CUDA: torch allocator and ``mem_get_info``."""

    device: str
    before_bytes: int
    after_bytes: int
    freed_bytes: int
    #: memory this process still holds on the device after the step
    residual_bytes: int
    note: str = ""


class MemoryReport(msgspec.Struct, kw_only=True):
    """What a release or re-wake did. ``tensor_bytes`` is what the registry moved."""

    action: MemoryAction
    level: ReleaseLevel | None = None
    tags: list[str] = []
    tensor_bytes: int = 0
    offloaded_bytes: int = 0
    discarded_bytes: int = 0
    freed_bytes: int = 0
    residual_bytes: int = 0
    budget_bytes: int | None = None
    devices: list[DeviceMemory] = []
    verified_tensors: int = 0
    duration_s: float = 0.0


class TransitionRecord(msgspec.Struct, kw_only=True):
    """A ``lifecycle.Transition`` on the wire: the same fields in the same order; ``of`` is the
    one conversion. Two classes, not one, because the lifecycle sits below the protocol (it
    must not import it, and the wire's Structs live here), while the protocol must not load
    the lifecycle's machine (``transitions``) for every client that only reads records."""

    #: an old peer's or journal's ``prepared``/``restored`` reads as ``seal``/``resume``
    trigger: Trigger
    source: CheckpointState
    dest: CheckpointState
    generation: int
    monotonic: float
    wall: float
    reason: str = ""

    @classmethod
    def of(cls, t: Transition) -> TransitionRecord:
        """The record of the lifecycle's move ``t``, as peers and journals read it."""
        return cls(trigger=t.trigger, source=t.source, dest=t.dest, generation=t.generation,
                   monotonic=t.monotonic, wall=t.wall, reason=t.reason)


class HandshakeReply(msgspec.Struct, kw_only=True, tag=True):
    protocol_version: int
    engine: str
    pid: int
    incarnation: int
    #: see ``ServerState``
    state: ServerState
    #: how often the agent sends heartbeats to subscribers
    heartbeat_interval_s: float = 0.0


class StatusReply(msgspec.Struct, kw_only=True, tag=True):
    engine: str
    #: the engine's PID as the host sees it (also when it runs in a PID namespace of its own)
    pid: int
    state: CheckpointState
    is_restored: bool
    generation: int
    in_flight: int
    kept: int
    released_tags: list[str]
    registered_bytes: dict[str, int]
    #: how many times this process was found restored from a checkpoint image
    incarnation: int
    restored_from_image: bool
    current_op: str | None = None
    last_transition: TransitionRecord | None = None
    #: where the engine is reached, as it bound them: ``control`` (its agent), ``api`` (the
    #: reference engine's requests), ``http`` (a vLLM server); a wildcard host (0.0.0.0, *,
    #: ::) is left as it is: a fleet node publishes its own address in its place
    endpoints: dict[str, str] = {}


class PrepareReply(msgspec.Struct, kw_only=True, tag=True):
    op_id: str
    state: CheckpointState
    drain: DrainReport
    memory: MemoryReport
    duration_s: float
    #: the transitions this operation made (events can be lost; a reply is not)
    transitions: list[TransitionRecord] = []


class RestoreReply(msgspec.Struct, kw_only=True, tag=True):
    op_id: str
    state: CheckpointState
    generation: int
    memory: MemoryReport | None
    duration_s: float
    resumed_kept: int = 0
    #: the transitions this operation made (events can be lost; a reply is not)
    transitions: list[TransitionRecord] = []


class HeartbeatReply(msgspec.Struct, kw_only=True, tag=True):
    #: see ``ServerState``
    state: ServerState
    seq: int
    monotonic: float


class Ack(msgspec.Struct, kw_only=True, tag=True):
    pass


# ---------------------------------------------------------------- controller results


class ErrorInfo(msgspec.Struct, kw_only=True):
    kind: str
    message: str
    details: dict[str, Any] = {}

    def to_exception(self) -> CkptError:
        return from_wire(self.kind, self.message, self.details)


class PhaseRecord(msgspec.Struct, kw_only=True):
    name: str
    wall: float
    duration_s: float
    ok: bool = True


class HookRun(msgspec.Struct, kw_only=True):
    point: HookPoint
    path: str
    exit_code: int | None
    duration_s: float
    timed_out: bool = False
    stdout_tail: str = ""
    stderr_tail: str = ""


class EngineOutcome(msgspec.Struct, kw_only=True):
    engine: str
    status: OutcomeStatus
    state: CheckpointState | None = None
    phases: list[PhaseRecord] = []
    drain: DrainReport | None = None
    released: MemoryReport | None = None
    rewoken: MemoryReport | None = None
    hooks: list[HookRun] = []
    error: ErrorInfo | None = None
    generation: int | None = None
    #: capture: whether a dump hook ran (False: nothing was captured); None for other steps
    dumped: bool | None = None
    #: the image (the id of the operation that dumped it) this capture made or this
    #: restore restored; None when there is none
    image: str | None = None


class OperationResult(msgspec.Struct, kw_only=True, tag=True):
    op_id: str
    kind: OperationKind
    status: OperationStatus
    engines: list[EngineOutcome]
    wall: float
    duration_s: float
    error: ErrorInfo | None = None
    max_unavailable_seen: int = 0


class LastOperation(msgspec.Struct, kw_only=True):
    """The newest operation on one engine in the controller's journal (``EngineView``'s
    ``last_op``): what ``ckptctl status`` shows as LAST-OP without a request per engine."""

    op_id: str
    kind: OperationKind
    #: ``running`` while the operation is in progress
    status: OperationStatus
    #: when it started
    wall: float
    duration_s: float | None = None


class EngineView(msgspec.Struct, kw_only=True):
    """The controller's view of one engine: the agent's own status when it answered."""

    engine: str
    kind: str
    control: str
    reachable: bool
    status: StatusReply | None = None
    holder: str | None = None
    error: ErrorInfo | None = None
    #: the operation that lost contact with this engine, until the reconciler settles it
    unsettled_by: str | None = None
    #: an engine the controller gave away: the node it lives on now, and the operation that
    #: moved it there (the controller no longer drives it: it is not probed)
    moved_to: str | None = None
    moved_by: str | None = None
    #: the newest operation on it in the journal (None: none there)
    last_op: LastOperation | None = None


class ControllerStatusReply(msgspec.Struct, kw_only=True, tag=True):
    controller_pid: int
    engines: list[EngineView]
    #: the controller filled each view's ``last_op`` (one of before this field was added
    #: leaves it False, and a client asks ``history`` per engine instead)
    last_ops: bool = False


class OperationSummary(msgspec.Struct, kw_only=True):
    op_id: str
    kind: OperationKind
    engines: list[str]
    #: ``running`` while the operation is in progress
    status: OperationStatus
    wall: float
    duration_s: float | None = None


class JournalRecord(msgspec.Struct, kw_only=True):
    seq: int
    op_id: str | None
    engine: str | None
    type: str
    wall: float
    monotonic: float
    data: dict[str, Any] = {}


class HistoryReply(msgspec.Struct, kw_only=True, tag=True):
    operations: list[OperationSummary]
    records: list[JournalRecord]


Result = (HandshakeReply | StatusReply | PrepareReply | RestoreReply | HeartbeatReply | Ack
          | OperationResult | ControllerStatusReply | HistoryReply)


class Reply(msgspec.Struct, kw_only=True):
    call_id: int
    result: Result


class ErrorReply(msgspec.Struct, kw_only=True):
    """A typed error; ``kind`` is a class name from ``ckpt_controller.errors``."""

    call_id: int
    kind: str
    message: str
    details: dict[str, Any] = {}

    def to_exception(self) -> CkptError:
        return from_wire(self.kind, self.message, self.details)


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


# ---------------------------------------------------------------- codec

COMMAND_TYPES: dict[RequestType, type[Command]] = {
    RequestType.HANDSHAKE: Handshake,
    RequestType.STATUS: StatusCommand,
    RequestType.PREPARE: PrepareCommand,
    RequestType.RESTORE: RestoreCommand,
    RequestType.ROLLBACK: RollbackCommand,
    RequestType.HEARTBEAT: HeartbeatCommand,
    RequestType.SUBSCRIBE: SubscribeCommand,
    RequestType.UNSUBSCRIBE: SubscribeCommand,
    RequestType.FAIL: FailCommand,
    RequestType.OPERATION: OperationCommand,
    RequestType.HISTORY: HistoryCommand,
}


class _Header(msgspec.Struct):
    """The two fields read before the full command, to answer even a half-broken frame."""

    call_id: int = 0
    version: int = 0


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_command_decoders = {t: msgspec.msgpack.Decoder(c) for t, c in COMMAND_TYPES.items()}
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_error_decoder = msgspec.msgpack.Decoder(ErrorReply)
_event_decoder = msgspec.msgpack.Decoder(Event)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def command_frames(rtype: RequestType, cmd: Command) -> list[bytes]:
    return [rtype.value, _encoder.encode(cmd)]


def reply_frames(call_id: int, result: Result) -> list[bytes]:
    return [ReplyType.REPLY.value, _encoder.encode(Reply(call_id=call_id, result=result))]


def error_frames(call_id: int, err: CkptError) -> list[bytes]:
    body = ErrorReply(
        call_id=call_id, kind=err.kind, message=err.message, details=to_plain(err.details)
    )
    return [ReplyType.ERROR.value, _encoder.encode(body)]


def event_frames(body: EventBody) -> list[bytes]:
    return [ReplyType.EVENT.value, _encoder.encode(Event(body=body))]


def decode_command(frames: list[bytes]) -> tuple[RequestType, Command]:
    """Decode ``[type, payload]`` from a client, or raise ``ProtocolError`` carrying the
    ``call_id`` (when it could be read) in ``details`` so the caller can still reply."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (type, payload), got {len(frames)}", call_id=0)
    tframe, payload = frames
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            "payload too large", call_id=0, size=len(payload), limit=MAX_PAYLOAD_BYTES
        )
    # the payload is not even a map with ints: reply with call_id 0
    header = decode_frame(_header_decoder, payload, "malformed payload", call_id=0)
    call_id = header.call_id
    if len(tframe) != 1:
        raise ProtocolError(f"type frame must be 1 byte, got {len(tframe)}", call_id=call_id)
    rtype = _REQUEST_TYPES.get(bytes(tframe))  # a dict look-up, no enum to construct
    if rtype is None:
        raise ProtocolError(f"unknown request type 0x{tframe.hex()}", call_id=call_id)
    if header.version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"protocol version {header.version} is not supported",
            call_id=call_id, got=header.version, supported=PROTOCOL_VERSION,
        )
    # a well-framed command with bad fields is answered, not dropped
    return rtype, decode_frame(_command_decoders[rtype], payload,
                               f"invalid {rtype.name} command", call_id=call_id)


#: each reply type's first frame -> (its decoder, what a frame that fails it is called)
_REPLY_DECODERS = {
    ReplyType.REPLY.value: (_reply_decoder, "malformed REPLY"),
    ReplyType.ERROR.value: (_error_decoder, "malformed ERROR"),
    ReplyType.EVENT.value: (_event_decoder, "malformed EVENT"),
}


#: each request type by its byte (a dict look-up instead of building the enum)
_REQUEST_TYPES = {t.value: t for t in RequestType}


def decode_reply(frames: list[bytes]) -> Reply | ErrorReply | Event:
    """Decode ``[type, payload]`` from an agent or the controller, or raise ``ProtocolError``."""
    if len(frames) != 2 or len(frames[0]) != 1:
        raise ProtocolError(f"malformed reply ({len(frames)} frames)")
    found = _REPLY_DECODERS.get(bytes(frames[0]))  # a dict look-up, no enum to construct
    if found is None:
        raise ProtocolError(f"unknown reply type 0x{bytes(frames[0]).hex()}")
    return decode_frame(found[0], frames[1], found[1])


def decode_frame(decoder: msgspec.msgpack.Decoder, payload: bytes, what: str, **details: Any):
    """``decoder.decode(payload)``; whatever goes wrong is a ``ProtocolError`` ("what: why").

    Not only ``DecodeError``/``ValidationError``: 2 KB of msgpack nested 2,000 deep is a
    ``RecursionError`` inside the decoder, and an exception that escapes a decode would kill
    the thread that owns the socket (also used by ``engine.api``)."""
    try:
        return decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # policy: a malformed frame is answered, typed, and the server goes on
        raise ProtocolError(f"{what}: {exc}", **details) from None
    except RecursionError:
        # policy: nesting deeper than the decoder may go is malformed as well
        raise ProtocolError(f"{what}: nested too deeply", **details) from None
    except Exception as exc:
        # policy: anything else a decode raises is still the frame's fault: typed, not fatal
        raise ProtocolError(f"{what}: {exc!r}", **details) from None


def to_plain(value: Any) -> Any:
    """Error details as msgpack-safe values (unknown objects become strings)."""
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)
    return str(value)
