"""The server half of the wire protocol, shared by the agent and the controller.

One control thread owns the ROUTER socket: it decodes requests and calls ``handle`` (which must
not block: long work goes to other threads, which answer through ``reply``), forwards what any
thread queued on the outbox, serves subscribe/unsubscribe and heartbeat requests, and every
``heartbeat_interval_s`` calls ``on_tick`` and sends a ``Heartbeat`` event to subscribers. A bad
frame is answered with a typed error (or dropped by zmq when over the hard size limit) and the
server keeps serving. Neighbours: ``protocol`` (frames), ``zmqutil.Outbox``; subclasses
``agent.server.Agent`` and ``controller.server.ControllerServer``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref

import zmq
from zmq.utils.monitor import recv_monitor_message

from ckpt_controller import protocol as p
from ckpt_controller.endpoints import secure_ipc
from ckpt_controller.clock import Clock
from ckpt_controller.errors import CkptError, EngineError, OperationError, ProtocolError
from ckpt_controller.security import CurveServer, ZapHandler, log_handshake_failures
from ckpt_controller.zmqutil import Outbox

log = logging.getLogger("ckpt_controller.rpc")


class RpcServer:
    #: request types this server answers besides subscribe/unsubscribe/heartbeat
    serves: frozenset[p.RequestType] = frozenset()

    def __init__(self, endpoint: str, *, name: str, heartbeat_interval_s: float = 0.5,
                 clock: Clock | None = None, curve: CurveServer | None = None) -> None:
        self.endpoint = endpoint
        #: CURVE keys: clients must hold an authorized key (tcp:// endpoints)
        self.curve = curve
        self._zap: ZapHandler | None = None
        self._monitor: zmq.Socket | None = None
        self.name = name
        self.heartbeat_interval_s = heartbeat_interval_s
        self.clock = clock or Clock()
        self._ctx = zmq.Context()
        self._outbox: Outbox | None = None
        self._router: zmq.Socket | None = None
        self._subscribers_lock = threading.Lock()
        self._subscribers: set[bytes] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heartbeat_seq = itertools.count(1)
        self._stalled_until = 0.0
        self._finalizer = weakref.finalize(self, _close_context, self._ctx)

    # ------------------------------------------------------------------ life

    def start(self):
        """Bind the endpoint and start serving; returns once bound."""
        try:
            self._outbox = Outbox(self._ctx, self.name)
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, p.HARD_MAX_MESSAGE_BYTES)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # a message for a peer that left fails at once instead of queueing forever: that
            # is how subscribers that went away are forgotten
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.SNDHWM, 100_000)
            if self.curve is not None:  # the handler first: without one, libzmq admits anyone
                self._zap = ZapHandler(self._ctx, self.curve, self.name)
                self.curve.apply(self._router)
                self._monitor = self._router.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            elif self.endpoint.startswith("tcp://"):
                log.warning("%s: control endpoint %s has no CURVE keys: anyone who can reach "
                            "it can drive it", self.name, self.endpoint)
            self._router.bind(self.endpoint)
            if self.endpoint.startswith("tcp://") and self.endpoint.endswith(":0"):
                self.endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            secure_ipc(self.endpoint)
        except (zmq.ZMQError, OSError, CkptError) as exc:
            # policy: a half-built server closes what it opened
            self.close()
            if isinstance(exc, CkptError):
                raise
            raise CkptError(f"cannot bind {self.endpoint}: {exc}", endpoint=self.endpoint) from exc
        self._thread = threading.Thread(target=self._serve, name=f"rpc-{self.name}", daemon=True)
        self._thread.start()
        log.info("%s serving on %s (pid %d)", self.name, self.endpoint, os.getpid())
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self._monitor = self._zap = None
        if self._router is not None:
            self._router.close(linger=0)
        if self._outbox is not None:
            self._outbox.close()
        self._router = self._outbox = None
        self._finalizer()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sending (any thread)

    def publish(self, body: p.EventBody) -> None:
        """Send an event to every subscriber."""
        frames = p.event_frames(body)
        with self._subscribers_lock:
            targets = list(self._subscribers)
        for identity in targets:
            self.send(identity, frames)

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        outbox = self._outbox
        if outbox is not None:
            outbox.send([identity, *frames])

    def reply(self, identity: bytes, call_id: int, result: p.Result) -> None:
        self.send(identity, p.reply_frames(call_id, result))

    def reply_error(self, identity: bytes, call_id: int, err: CkptError) -> None:
        self.send(identity, p.error_frames(call_id, err))

    def stall(self, seconds: float) -> None:
        """Stop the control thread for ``seconds``: no heartbeats, no answers (a fault a
        drill injects; requests queue in the socket meanwhile)."""
        self._stalled_until = time.monotonic() + seconds

    # ------------------------------------------------------------------ to override

    def handle(self, identity: bytes, rtype: p.RequestType, cmd: p.Command) -> None:
        """Answer ``cmd`` (now, or later from another thread) with ``reply``/``reply_error``,
        or raise a ``CkptError`` to have it sent back. Must not block the control thread."""
        raise NotImplementedError

    def on_tick(self) -> None:
        """Runs on the control thread every heartbeat interval, before the heartbeat."""

    def heartbeat_body(self, seq: int) -> p.Heartbeat | None:
        """The heartbeat to publish, or None to stay silent this interval."""
        return p.Heartbeat(engine=self.name, state="serving", seq=seq,
                           monotonic=self.clock.monotonic(), incarnation=0)

    # ------------------------------------------------------------------ control thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.inbox, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.socket, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
        interval_ms = max(1, int(self.heartbeat_interval_s * 1000))
        next_beat = self.clock.monotonic()
        while not self._stop.is_set():
            if time.monotonic() < self._stalled_until:
                time.sleep(min(0.1, self._stalled_until - time.monotonic()))
                continue
            try:
                events = dict(poller.poll(timeout=min(interval_ms, 100)))
            except zmq.ZMQError:  # policy: socket closed under us means we are stopping
                break
            if self._zap is not None and self._zap.socket in events:
                self._zap.handle()
            if self._monitor is not None and self._monitor in events:
                log_handshake_failures(recv_monitor_message(self._monitor), self.name)
            if self._outbox.inbox in events:
                try:
                    self._outbox.forward(self._router, self._forget)
                except zmq.ZMQError as exc:  # policy: an undeliverable reply is logged
                    log.warning("%s: send failed: %s", self.name, exc)
            if self._router in events:
                while True:
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(frames)
            if self.clock.monotonic() >= next_beat:
                next_beat = self.clock.monotonic() + self.heartbeat_interval_s
                self.on_tick()
                beat = self.heartbeat_body(next(self._heartbeat_seq))
                if beat is not None:  # None: the server knows it must not look alive
                    self.publish(beat)

    def _forget(self, identity: bytes) -> None:
        with self._subscribers_lock:
            if identity in self._subscribers:
                self._subscribers.discard(identity)
                log.info("%s: subscriber %s is gone", self.name, identity.hex())

    def _dispatch(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        try:
            rtype, cmd = p.decode_command(rest)
        except ProtocolError as err:
            log.warning("%s: bad frame from %s: %s", self.name, identity.hex(), err)
            self.reply_error(identity, int(err.details.pop("call_id", 0) or 0), err)
            return
        try:
            if rtype is p.RequestType.SUBSCRIBE or rtype is p.RequestType.UNSUBSCRIBE:
                with self._subscribers_lock:
                    if rtype is p.RequestType.SUBSCRIBE:
                        self._subscribers.add(identity)
                    else:
                        self._subscribers.discard(identity)
                self.reply(identity, cmd.call_id, p.Ack())
            elif rtype is p.RequestType.HEARTBEAT:
                beat = self.heartbeat_body(0)
                if beat is None:
                    raise EngineError(f"{self.name}: the engine is not answering", server=self.name)
                self.reply(identity, cmd.call_id, p.HeartbeatReply(
                    state=beat.state, seq=0, monotonic=self.clock.monotonic()))
            elif rtype in self.serves:
                self.handle(identity, rtype, cmd)
            else:
                raise ProtocolError(f"{rtype.name} is not served here", request=rtype.name,
                                    server=self.name)
        except CkptError as err:  # policy: every refusal is a typed reply
            self.reply_error(identity, cmd.call_id, err)
        except Exception as exc:  # policy: a bug answers this request, typed, and we go on
            log.exception("%s: %s failed", self.name, rtype.name)
            self.reply_error(identity, cmd.call_id, OperationError(
                f"{self.name} failed to handle {rtype.name}: {exc!r}", request=rtype.name))


def _close_context(ctx: zmq.Context) -> None:
    ctx.destroy(linger=0)
