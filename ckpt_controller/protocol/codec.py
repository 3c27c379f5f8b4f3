"""Frames: Structs into ``[type, payload]`` and back, every failure a ``ProtocolError``
(answered, typed; never one that kills the socket's thread), with the payload limit and the
version check. Knows no sockets.
Neighbours: ``commands``, ``results``, ``events``; ``rpc`` and ``rpcserver`` move the frames;
``engine.api`` decodes with ``decode_frame`` too.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ckpt_controller.errors import CkptError, ProtocolError, VersionMismatchError, described

from ckpt_controller.protocol.commands import (
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
    StatusCommand,
    SubscribeCommand,
)
from ckpt_controller.protocol.events import Event, EventBody
from ckpt_controller.protocol.results import ErrorReply, Reply, Result

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
    RequestType.COMPACT: CompactCommand,
    RequestType.IMAGES: ImagesCommand,
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
        raise ProtocolError(f"{what}: {described(exc)}", **details) from None


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
