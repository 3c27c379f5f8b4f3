"""Request/reply client transport shared by ``AgentClient`` and ``ControllerClient``.

A DEALER with a deadline on every receive. Replies are matched by ``call_id``; stale replies of
earlier calls are dropped. On a timeout the socket is closed with ``linger=0``, reopened, and
the request sent again (operations carry an ``op_id``, so the server runs each only once), up to
``retries`` times, then ``UnreachableError``. After ``subscribe`` the client follows the
server's heartbeats: ``missed_beats`` intervals with no message at all means the server is dead,
not slow (also between calls: ``poll_events`` raises ``UnreachableError`` then).

Until the server is first heard from, ``contact.FirstContact`` watches the connection: a
missing socket file, a refused port or a refused CURVE key fails the call within about a
second instead of after every retry. An error after retries states the whole time waited;
meanwhile ``on_wait`` (when given) hears, as a line for a person, that a request has had no
answer for ``notice_after_s`` and then each resend (``ckptctl status`` prints them).
Every command is checked against its field limits (``values``) before it is sent: a bad value
is a ``UsageError`` naming the field, and nothing reaches the server.
Not thread-safe: one client per thread. Neighbours: ``protocol`` (frames), ``contact``.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from ckpt_controller import hub
from ckpt_controller import protocol as p
from ckpt_controller.contact import FirstContact
from ckpt_controller.endpoints import check_endpoint
from ckpt_controller.errors import (
    ConfigError,
    DeadlineError,
    ProtocolError,
    UnreachableError,
    UsageError,
    VersionMismatchError,
)
from ckpt_controller.security import CurveClient
from ckpt_controller.values import COUNT, DURATION, check, count, shown
from ckpt_controller.zmqutil import recv_frames, send_frames


#: plain ints: zmq's flag enums cost an enum operation on every use
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


#: sockets the process's shared context may hold. zmq's default, 1023, is about 340 clients
#: (a DEALER each and, until first contact, a monitor pair): fewer than the engines one
#: controller cycles at once
SHARED_MAX_SOCKETS = 16_384


def shared_context() -> zmq.Context:
    """The process's shared zmq context, with room for ``SHARED_MAX_SOCKETS`` sockets. zmq reads
    the limit when the context makes its first socket: one that other code used first keeps
    the limit it had then."""
    ctx = zmq.Context.instance()
    ctx.set(zmq.MAX_SOCKETS, SHARED_MAX_SOCKETS)
    return ctx


def new_op_id() -> str:
    return uuid.uuid4().hex[:16]


def check_command(cmd: p.Command) -> None:
    """Raise ``UsageError`` naming the field and its value when ``cmd`` breaks a limit its
    Struct declares (the same check the server's decoder makes)."""
    try:
        msgspec.convert(msgspec.structs.asdict(cmd), type(cmd))
    except msgspec.ValidationError as exc:  # policy: the caller's value, refused before sending
        m = re.search(r"at `\$\.(\w+)", str(exc))
        field = m.group(1) if m else "?"
        value = shown(getattr(cmd, field, None)) if m else "?"
        raise UsageError(f"{field} = {value} is refused: {exc}", field=field,
                         value=value) from None


class RpcClient:
    #: what to check when the server cannot be reached at all (subclasses say which server)
    unreachable_hint = "is the server running at this endpoint?"
    #: who serves the endpoint, as a waiting notice names it ("the controller"); None: only
    #: the endpoint
    peer: str | None = None
    #: check each command's fields before sending it (``check_command``); a client whose
    #: commands are built from values checked already (the controller's links) skips it,
    #: and the server's decoder still refuses a bad one with the same typed error
    checks_commands = True

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
        on_wait: Callable[[str], None] | None = None,
        notice_after_s: float = 2.0,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        #: told (a line for a person) when a request has had no answer for
        #: ``notice_after_s``, and at each resend: a silent server is not waited out silently
        self.on_wait = on_wait
        self.notice_after_s = check(DURATION, notice_after_s, "notice_after_s")
        #: CURVE keys for a server that requires them
        self.curve = curve
        self.timeout_s = check(DURATION, timeout_s, "timeout_s")
        self.retries = check(count(0, 100), retries, "retries")
        #: the current (or last) call's attempt: 2 and more is a resend after no answer
        self.attempt = 1
        self.missed_beats = check(COUNT, missed_beats, "missed_beats")
        self.liveness_s = check(DURATION, heartbeat_interval_s, "heartbeat_interval_s") \
            * missed_beats
        self.name = name
        self.on_event = on_event
        self.events: deque[p.EventBody] = deque(maxlen=10_000)
        self._ctx = context or shared_context()
        self._calls = itertools.count(1)
        self._subscribed = False
        #: the server sends heartbeats to subscribers (its handshake said so)
        self._server_beats = False
        self._last_seen = time.monotonic()
        self._contact: FirstContact | None = None
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
        if self._contact is None:
            self._contact = FirstContact(self._sock, self.endpoint, hint=self.unreachable_hint)
        else:
            self._contact.attach(self._sock)
        try:
            self._sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # policy: an endpoint zmq cannot parse is the caller's error
            self._contact.detach()
            self._sock.close(linger=0)
            self._sock = None
            raise ConfigError(f"cannot connect to {self.endpoint}: {exc}",
                              endpoint=self.endpoint) from None

    def _reopen(self) -> None:
        self._contact.detach()
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
            self._contact.detach()
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

    @property
    def subscribed(self) -> bool:
        """``subscribe`` was called (the server sends this client its events)."""
        return self._subscribed

    @property
    def follows_heartbeats(self) -> bool:
        """Subscribed to a server that beats: ``poll_events`` notices when it is lost."""
        return self._subscribed and self._server_beats

    def heartbeat(self) -> p.HeartbeatReply:
        return self.call(p.RequestType.HEARTBEAT, p.HeartbeatCommand(call_id=0))

    def subscribe(self) -> None:
        """Receive the server's events; from now on, waits end when heartbeats stop."""
        beat = self.handshake().heartbeat_interval_s
        if beat > 0:  # the server's own interval decides what "silent too long" means
            self.liveness_s = beat * self.missed_beats
        self._server_beats = beat > 0
        self.call(p.RequestType.SUBSCRIBE, p.SubscribeCommand(call_id=0))
        self._subscribed = True
        self._last_seen = time.monotonic()

    # ------------------------------------------------------------------ transport

    def call(self, rtype: p.RequestType, cmd: p.Command, *, timeout_s: float | None = None,
             retries: int | None = None):
        """Send ``cmd`` and return the reply's result, or raise the server's typed error;
        ``retries`` (resends after a timeout) replaces the client's own for this call."""
        timeout = self.timeout_s if timeout_s is None else check(DURATION, timeout_s, "timeout_s")
        retries = self.retries if retries is None else retries
        if self.checks_commands:
            check_command(cmd)
        last_exc: UnreachableError | None = None
        self._take_pending()
        start = time.monotonic()
        attempts = retries + 1
        for attempt in range(1, attempts + 1):
            self.attempt = attempt  # a resend's answer may come from a new server process
            cmd = msgspec.structs.replace(cmd, call_id=next(self._calls))
            notice = None
            if self.on_wait is not None:
                who = f"{self.peer} at {self.endpoint}" if self.peer else self.endpoint
                if attempt > 1:
                    self.on_wait(f"no answer from {who} in {timeout:.1f}s; still "
                                 f"trying (attempt {attempt} of {attempts})")
                elif self.notice_after_s < timeout:
                    notice = (f"no answer from {who} yet ({self.notice_after_s:.1f}s);"
                              f" still trying (attempt 1 of {attempts}, at most "
                              f"{timeout * attempts:.0f}s in all)")
            try:
                self._send(p.command_frames(rtype, cmd), timeout)
                return self._await(cmd.call_id, timeout, notice)
            except UnreachableError as exc:  # policy: lazy pirate, reopen and resend
                if exc.details.get("reason") in ("refused", "handshake"):
                    exc.details["attempts"] = 1
                    raise  # nobody there, or we are refused: resending changes nothing
                last_exc = exc
                self._reopen()
                if self._subscribed:
                    # the new socket is a new peer: subscribe again without waiting (its Ack
                    # is dropped as stale); heartbeats then bound the next attempt as well
                    sub = p.SubscribeCommand(call_id=next(self._calls))
                    try:
                        send_frames(self._sock, p.command_frames(p.RequestType.SUBSCRIBE, sub))
                    except zmq.Again:  # policy: no connection yet: the next attempt's wait
                        pass           # tells, and a resend subscribes again
        assert last_exc is not None
        waited = time.monotonic() - start
        details = dict(last_exc.details, attempts=retries + 1, waited_s=round(waited, 3))
        what, n = last_exc.message, retries + 1
        if n > 1:  # the time in the message is the whole wait, every attempt included
            what, found = re.subn(r" in [0-9.]+s$", f" in {waited:.1f}s ({n} attempts)", what)
            if not found:
                what += f" ({waited:.1f}s in all, {n} attempts)"
        raise UnreachableError(what, **details)

    def _send(self, frames: list[bytes], timeout: float) -> None:
        """Queue a request. zmq keeps no connection to queue it on while a refused handshake
        is tried again (a blocking send then waited forever): wait up to ``timeout`` for
        one, a refused first contact raised at once (``contact``), else
        ``UnreachableError``."""
        start = time.monotonic()
        while True:
            try:
                send_frames(self._sock, frames)
                return
            except zmq.Again:  # policy: no connection to queue on yet: wait for one
                pass
            left = start + timeout - time.monotonic()
            if left <= 0:
                raise UnreachableError(
                    f"no connection to {self.endpoint} in {timeout:.1f}s",
                    endpoint=self.endpoint, waited_s=round(time.monotonic() - start, 3))
            if self._contact.poll(min(left, 0.05)):  # readable (an old reply): no wait there
                hub.sleep(min(left, 0.01))

    def _take_pending(self) -> None:
        """Handle events that arrived between calls, so they never pile up on the server."""
        while self._sock.getsockopt(_EVENTS) & _POLLIN:  # no poller for a look
            msg = self._receive()
            if isinstance(msg, p.Event):
                self._on_event(msg.body)

    def _await(self, call_id: int, timeout: float, notice: str | None = None):
        """The reply to ``call_id``; ``notice`` goes to ``on_wait`` once there has been no
        answer for ``notice_after_s``."""
        start = time.monotonic()
        last_seen = start
        while True:
            now = time.monotonic()
            left = start + timeout - now
            if notice is not None:
                if now - start >= self.notice_after_s:
                    self.on_wait(notice)
                    notice = None
                else:
                    left = min(left, start + self.notice_after_s - now)
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
            if not self._contact.poll(left + 0.001):
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
        frames = recv_frames(self._sock)
        self._last_seen = time.monotonic()
        if not self._contact.settled:
            self._contact.heard()
        try:
            return p.decode_reply(frames)
        except ProtocolError as err:
            err.details["endpoint"] = self.endpoint
            raise

    def _on_event(self, body: p.EventBody) -> None:
        if isinstance(body, p.JournaledMany):  # handed on one record at a time, in order
            for rec in body.records:
                self._on_event(p.Journaled(record=rec))
            return
        self.events.append(body)
        if self.on_event is not None:
            self.on_event(body)

    def poll_events(self, timeout_s: float = 0.0) -> list[p.EventBody]:
        """Receive events for ``timeout_s``; returns (and drains) everything queued.

        Subscribed to a server that sends heartbeats, silence longer than ``liveness_s``
        raises ``UnreachableError``: the server is gone, and waiting on says nothing."""
        deadline = time.monotonic() + timeout_s
        beats = self.follows_heartbeats
        while True:
            now = time.monotonic()
            wait = deadline - now
            if beats:  # wake up when the silence becomes too long
                wait = min(wait, self._last_seen + self.liveness_s - now)
            if self._contact.poll(max(0.0, wait)):
                msg = self._receive()
                if isinstance(msg, p.Event):
                    self._on_event(msg.body)
            elif beats and time.monotonic() - self._last_seen > self.liveness_s:
                silent = time.monotonic() - self._last_seen
                raise UnreachableError(
                    f"lost contact with {self.endpoint}: no heartbeat for {silent:.1f}s "
                    f"(the process is gone, stopped or cut off)", endpoint=self.endpoint,
                    silent_s=round(silent, 3), liveness_s=self.liveness_s,
                    hint=self.unreachable_hint)
            if time.monotonic() >= deadline:
                break
        out = list(self.events)
        self.events.clear()
        return out
