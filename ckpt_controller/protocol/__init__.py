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
Modules: ``commands`` (constants, type bytes, what a client sends), ``results`` (what comes
back, ``Reply``, ``ErrorReply``), ``events`` (what subscribers get unasked), ``codec``
(frames); every public name is importable from the package itself (``protocol.PrepareCommand``).
Neighbours: ``agent.server`` and ``agent.client`` move the frames; ``errors`` is carried in
``ErrorReply``; ``values`` defines what a valid field value is; ``vocab`` the words.
"""

from __future__ import annotations

from ckpt_controller.protocol.codec import (
    COMMAND_TYPES,
    command_frames,
    decode_command,
    decode_frame,
    decode_reply,
    encode,
    error_frames,
    event_frames,
    reply_frames,
    to_plain,
)
from ckpt_controller.protocol.commands import (
    HARD_MAX_MESSAGE_BYTES,
    MAX_HISTORY_LIMIT,
    MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    Command,
    CompactCommand,
    FailCommand,
    Handshake,
    HeartbeatCommand,
    HistoryCommand,
    ImagesCommand,
    OperationCommand,
    PrepareCommand,
    ReplyType,
    RequestType,
    RestoreCommand,
    RollbackCommand,
    ServerState,
    StatusCommand,
    SubscribeCommand,
)
from ckpt_controller.protocol.events import (
    DrainProgress,
    Event,
    EventBody,
    Heartbeat,
    Journaled,
    JournaledMany,
    MemoryReported,
    StateChanged,
)
from ckpt_controller.protocol.results import (
    Ack,
    CompactReply,
    ControllerStatusReply,
    DeviceMemory,
    DrainReport,
    EngineOutcome,
    EngineView,
    ErrorInfo,
    ErrorReply,
    HandshakeReply,
    HeartbeatReply,
    HistoryReply,
    HookRun,
    ImageInfo,
    ImagesReply,
    JournalRecord,
    LastOperation,
    MemoryReport,
    OperationResult,
    OperationSummary,
    PhaseRecord,
    PrepareReply,
    Reply,
    RestoreReply,
    Result,
    StatusReply,
    TransitionRecord,
)

__all__ = [
    "PROTOCOL_VERSION", "MAX_PAYLOAD_BYTES", "HARD_MAX_MESSAGE_BYTES", "MAX_HISTORY_LIMIT",
    "RequestType", "ReplyType", "ServerState", "Command", "Handshake", "StatusCommand",
    "HeartbeatCommand", "SubscribeCommand", "PrepareCommand", "RestoreCommand", "RollbackCommand",
    "FailCommand", "OperationCommand", "HistoryCommand", "CompactCommand", "ImagesCommand",
    "DrainReport",
    "DeviceMemory",
    "MemoryReport", "TransitionRecord", "HandshakeReply", "StatusReply", "PrepareReply",
    "RestoreReply", "HeartbeatReply", "Ack", "ErrorInfo", "PhaseRecord", "HookRun",
    "EngineOutcome", "OperationResult", "LastOperation", "EngineView", "ControllerStatusReply",
    "OperationSummary", "JournalRecord", "HistoryReply", "CompactReply", "ImageInfo",
    "ImagesReply", "Result", "Reply",
    "ErrorReply",
    "StateChanged", "DrainProgress", "MemoryReported", "Heartbeat", "Journaled", "JournaledMany",
    "EventBody", "Event", "COMMAND_TYPES", "encode", "command_frames", "reply_frames",
    "error_frames", "event_frames", "decode_command", "decode_reply", "decode_frame", "to_plain",
]
