"""The reference engine's request API: msgspec messages over a pyzmq ROUTER/DEALER pair.

As vLLM's ``EngineCoreRequestType``, each message is ``[type, payload]`` with a one-byte type:
``ADD`` (a new request) and ``ABORT`` (end some requests now). The engine answers each request
with ``RequestOutput`` messages: one when it is queued, then one per generated token, the last
with ``finished=True`` and a ``finish_reason`` (``stop``, ``length``, ``abort``, ``error``); or
at once with ``RequestRejected`` (the engine is not RUNNING, or its waiting queue is full:
``OverloadedError``; retry after the hint; or the request is invalid). An ABORT is answered
only when it is refused (``request_id`` empty). Events ``queued``, ``scheduled``, ``preempted``
carry monotonic times.
Imports no torch: clients (``ckptctl generate``, ``ckptctl load``) stay light. Any decode
failure (nesting too deep included) is a ``ProtocolError``; a message over
``MAX_MESSAGE_BYTES`` never reaches the engine. Neighbours: ``server`` (engine side),
``client``, ``protocol`` (the shared decode guard and size limit), ``vocab`` (finish reasons).
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from ckpt_controller.errors import CkptError, ProtocolError, from_wire
from ckpt_controller.protocol import HARD_MAX_MESSAGE_BYTES, decode_frame
from ckpt_controller.vocab import FinishReason


class EngineRequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"


class EngineReplyType(bytes, enum.Enum):
    OUTPUT = b"\x80"
    REJECTED = b"\x81"


EventType = Literal["queued", "scheduled", "preempted"]


class EngineRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_id: int | None = None
    #: wall-clock seconds when the client sent it
    arrival_time: float = 0.0


class AbortRequest(msgspec.Struct, kw_only=True):
    request_ids: list[str]


class RequestEvent(msgspec.Struct, kw_only=True, array_like=True):
    type: EventType
    timestamp: float  # time.monotonic() on the engine's host


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    new_token_ids: list[int] = []
    finished: bool = False
    finish_reason: FinishReason | None = None
    events: list[RequestEvent] = []
    #: for an ``error`` finish: what went wrong
    error: str | None = None
    #: the engine's step that produced ``new_token_ids``: one step decodes the whole running
    #: batch, so requests decoded together share their steps
    step: int = 0
    #: on the final output: every output token of the request. Deltas sent just before a
    #: checkpoint can be lost with the connection (CRIU's --tcp-close); the end never is
    #: (it is sent after restore), so a client ends with the whole output either way. Also
    #: on the answer to a resend of a request still running (not finished): every output
    #: token so far, which replaces what the client has; the deltas follow it.
    token_ids: list[int] | None = None


class RequestRejected(msgspec.Struct, kw_only=True):
    """The request was not accepted; ``kind``/``details`` rebuild the typed error."""

    request_id: str
    kind: str
    message: str
    details: dict[str, Any] = {}

    def to_exception(self) -> CkptError:
        return from_wire(self.kind, self.message, self.details)


_enc = msgspec.msgpack.Encoder()
_dec_add = msgspec.msgpack.Decoder(EngineRequest)
_dec_abort = msgspec.msgpack.Decoder(AbortRequest)
_dec_out = msgspec.msgpack.Decoder(RequestOutput)
_dec_rej = msgspec.msgpack.Decoder(RequestRejected)
#: a request larger than this is refused with a ``ProtocolError``
MAX_PAYLOAD_BYTES = 4 << 20
#: zmq drops (and disconnects) anything larger before the engine reads it: the control
#: sockets' limit
MAX_MESSAGE_BYTES = HARD_MAX_MESSAGE_BYTES
#: a longer request id is refused (``UsageError``): what the engine keeps per request is small
MAX_REQUEST_ID_CHARS = 256
#: an ABORT naming more request ids is refused (``UsageError``): send several
MAX_ABORT_IDS = 1024


def encode(rtype: bytes, msg: msgspec.Struct) -> list[bytes]:
    return [rtype, _enc.encode(msg)]


def decode_request(frames: list[bytes]) -> EngineRequest | AbortRequest:
    if len(frames) != 2 or len(frames[1]) > MAX_PAYLOAD_BYTES:
        raise ProtocolError("expected [type, payload] within the size limit", frames=len(frames))
    try:
        rtype = EngineRequestType(bytes(frames[0]))
    except ValueError:
        raise ProtocolError(f"unknown engine request type 0x{bytes(frames[0]).hex()}") from None
    return decode_frame(_dec_add if rtype is EngineRequestType.ADD else _dec_abort, frames[1],
                        f"invalid {rtype.name} request")


def decode_reply(frames: list[bytes]) -> RequestOutput | RequestRejected:
    if len(frames) != 2:
        raise ProtocolError("expected [type, payload] from the engine", frames=len(frames))
    if bytes(frames[0]) == EngineReplyType.OUTPUT.value:
        return decode_frame(_dec_out, frames[1], "malformed engine reply")
    if bytes(frames[0]) == EngineReplyType.REJECTED.value:
        return decode_frame(_dec_rej, frames[1], "malformed engine reply")
    raise ProtocolError(f"unknown engine reply type 0x{bytes(frames[0]).hex()}")
