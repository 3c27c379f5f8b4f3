"""Request/reply client transport shared by ``AgentClient`` and ``ControllerClient``.

A DEALER with a deadline on every receive. Replies are matched by ``call_id``; stale replies of
earlier calls are dropped. On a timeout the socket is closed with ``linger=0``, reopened, and
the request sent again (operations carry an ``op_id``, so the server runs each only once), up to
``retries`` times, then ``UnreachableError``. After ``subscribe`` the client follows the
server's heartbeats: ``missed_beats`` intervals with no message at all means the server is dead,
not slow. Not thread-safe: one client per thread. Neighbours: ``protocol`` (frames).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from ckpt_controller import protocol as p
from ckpt_controller.endpoints import check_endpoint
from ckpt_controller.errors import (
    ConfigError,
    DeadlineError,
    ProtocolError,
    UnreachableError,
    VersionMismatchError,
)
from ckpt_controller.security import CurveClient


def new_op_id() -> str:
    return uuid.uuid4().hex[:16]


class RpcClient:
    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 5.0,
        retries: int = 2,
        heartbeat_interval_s: float = 0.5,
        missed_beats: int = 6,
        name: str = "ckpt-client",
        on_event: Callable[[p.EventBody], None] | None = None,
        context: zmq.Context | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        #: CURVE keys for a server that requires them
        self.curve = curve
        self.timeout_s = timeout_s
        self.retries = retries
        self.missed_beats = missed_beats
        self.liveness_s = heartbeat_interval_s * missed_beats
        self.name = name
        self.on_event = on_event
        self.events: deque[p.EventBody] = deque(maxlen=10_000)
        self._ctx = context or zmq.Context.instance()
        self._calls = itertools.count(1)
        self._subscribed = False
        # one identity for the client's life: after a reconnect (ours, or the server's
        # process restored from a checkpoint image) replies and events still find us
        self.identity = f"{name}-{uuid.uuid4().hex[:12]}".encode()
        self._sock: zmq.Socket | None = None
        self._open()

    def _open(self) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, self.identity)
        self._sock.setsockopt(zmq.MAXMSGSIZE, p.HARD_MAX_MESSAGE_BYTES)
        if self.curve is not None:
            try:
                self.curve.apply(self._sock)
            except ConfigError:
                self._sock.close(linger=0)
                self._sock = None
                raise
        try:
            self._sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # policy: an endpoint zmq cannot parse is the caller's error
            self._sock.close(linger=0)
            self._sock = None
            raise ConfigError(f"cannot connect to {self.endpoint}: {exc}",
                              endpoint=self.endpoint) from None

    def _reopen(self) -> None:
        self._sock.close(linger=0)
        self._open()

    def close(self) -> None:
        if self._sock is not None:
            if self._subscribed:  # best effort: the server also forgets peers that are gone
                unsub = p.SubscribeCommand(call_id=next(self._calls))
                try:
                    self._sock.send_multipart(
                        p.command_frames(p.RequestType.UNSUBSCRIBE, unsub), zmq.NOBLOCK)
                except zmq.ZMQError:  # policy: nothing to tell a server we cannot reach
                    pass
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ common requests

    def handshake(self) -> p.HandshakeReply:
        """The server's name, PID and heartbeat interval; raises ``VersionMismatchError`` if
        it speaks another protocol version than this client."""
        reply = self.call(p.RequestType.HANDSHAKE, p.Handshake(call_id=0, client=self.name))
        if reply.protocol_version != p.PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"{self.endpoint} speaks protocol version {reply.protocol_version}; this client "
                f"speaks {p.PROTOCOL_VERSION}", endpoint=self.endpoint,
                got=reply.protocol_version, supported=p.PROTOCOL_VERSION)
        return reply

    def heartbeat(self) -> p.HeartbeatReply:
        return self.call(p.RequestType.HEARTBEAT, p.HeartbeatCommand(call_id=0))

    def subscribe(self) -> None:
        """Receive the server's events; from now on, waits end when heartbeats stop."""
        beat = self.handshake().heartbeat_interval_s
        if beat > 0:  # the server's own interval decides what "silent too long" means
            self.liveness_s = beat * self.missed_beats
        self.call(p.RequestType.SUBSCRIBE, p.SubscribeCommand(call_id=0))
        self._subscribed = True

    # ------------------------------------------------------------------ transport

    def call(self, rtype: p.RequestType, cmd: p.Command, *, timeout_s: float | None = None):
        """Send ``cmd`` and return the reply's result, or raise the server's typed error."""
        timeout = timeout_s or self.timeout_s
        last_exc: UnreachableError | None = None
        self._take_pending()
        for _ in range(self.retries + 1):
            cmd = msgspec.structs.replace(cmd, call_id=next(self._calls))
            self._sock.send_multipart(p.command_frames(rtype, cmd))
            try:
                return self._await(cmd.call_id, timeout)
            except UnreachableError as exc:  # policy: lazy pirate, reopen and resend
                last_exc = exc
                self._reopen()
                if self._subscribed:
                    # the new socket is a new peer: subscribe again without waiting (its Ack
                    # is dropped as stale); heartbeats then bound the next attempt as well
                    sub = p.SubscribeCommand(call_id=next(self._calls))
                    self._sock.send_multipart(p.command_frames(p.RequestType.SUBSCRIBE, sub))
        assert last_exc is not None
        last_exc.details["attempts"] = self.retries + 1
        raise last_exc

    def _take_pending(self) -> None:
        """Handle events that arrived between calls, so they never pile up on the server."""
        while self._sock.poll(0, zmq.POLLIN):
            msg = self._receive()
            if isinstance(msg, p.Event):
                self._on_event(msg.body)

    def _await(self, call_id: int, timeout: float):
        start = time.monotonic()
        last_seen = start
        while True:
            now = time.monotonic()
            left = start + timeout - now
            if self._subscribed and left <= 0 and now - last_seen < self.liveness_s:
                # alive (heartbeats) but no answer in time: a deadline, not a lost peer
                raise DeadlineError(f"no answer from {self.endpoint} in {timeout:.1f}s although "
                                    f"it is alive", endpoint=self.endpoint, timeout_s=timeout)
            if self._subscribed:
                left = min(left, last_seen + self.liveness_s - now)
            if left <= 0:
                hint = {"hint": "the server may have refused this client's CURVE key"} \
                    if self.curve is not None else {}
                silent = now - last_seen
                what = (f"no answer and no heartbeat from {self.endpoint} for {silent:.1f}s "
                        f"(the process is gone, stopped or cut off)") if self._subscribed \
                    else f"no answer from {self.endpoint} in {now - start:.1f}s"
                raise UnreachableError(
                    what, endpoint=self.endpoint,
                    waited_s=round(now - start, 3), silent_s=round(silent, 3), **hint,
                )
            if not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                continue
            msg = self._receive()
            last_seen = time.monotonic()
            if isinstance(msg, p.Event):
                self._on_event(msg.body)
            elif msg.call_id == call_id:
                if isinstance(msg, p.ErrorReply):
                    raise msg.to_exception()
                return msg.result
            # otherwise: a stale reply to an earlier, timed-out call; dropped

    def _receive(self) -> p.Reply | p.ErrorReply | p.Event:
        frames = self._sock.recv_multipart()
        try:
            return p.decode_reply(frames)
        except ProtocolError as err:
            err.details["endpoint"] = self.endpoint
            raise

    def _on_event(self, body: p.EventBody) -> None:
        self.events.append(body)
        if self.on_event is not None:
            self.on_event(body)

    def poll_events(self, timeout_s: float = 0.0) -> list[p.EventBody]:
        """Receive events for ``timeout_s``; returns (and drains) everything queued."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if not self._sock.poll(max(0, int(left * 1000)), zmq.POLLIN):
                break
            msg = self._receive()
            if isinstance(msg, p.Event):
                self._on_event(msg.body)
            if time.monotonic() >= deadline:
                break
        out = list(self.events)
        self.events.clear()
        return out
