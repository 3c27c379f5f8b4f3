"""Clients of the reference engine's request API (no torch).

``EngineClient`` submits requests and collects their streamed outputs over one DEALER;
``generate`` is the blocking one-request form (raises the engine's typed rejection). Every
wait has a deadline. ``move_to`` follows an engine to another endpoint (same ZMQ identity;
every request without an end is sent again, and the engine answers each with its whole output
so far or its end); ``for_engine`` finds an engine by name through a resolver (the fleet's
registry gives one: ``fleet.registry.Resolver``) and moves when it names another endpoint. Until the engine is first heard from,
``contact.FirstContact`` watches the connection, so a missing socket file or a refused port
is an ``UnreachableError`` within about a second; token ids, counts and timeouts are checked (``values``) before anything is
sent. Neighbours: ``api`` (messages), ``load`` (many requests at a rate), ``contact``,
``values`` (the limits), ``endpoints`` (endpoint checks); ``fleet.registry`` supplies the
resolver (this module knows nothing of etcd).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from ckpt_controller.contact import FirstContact
from ckpt_controller.endpoints import WATCH_SLICE_S, Resolve, check_endpoint, watch_changes
from ckpt_controller.engine import api
from ckpt_controller.errors import (CkptError, ConfigError, DeadlineError, OperationError,
                                    UnreachableError)
from ckpt_controller.values import COUNT, DURATION, TOKEN_ID, check, check_optional
from ckpt_controller.vocab import FinishReason

#: outputs queued in this client before the engine's own queue takes over
RCV_HWM = 1_000_000
#: what to check when the engine cannot be reached at all
UNREACHABLE_HINT = "is the engine running? check its request API endpoint (--api)"
#: a followed engine (``for_engine``) silent this long while requests wait is looked up again
FOLLOW_AFTER_S = 1.0

log = logging.getLogger("ckpt_controller.engine")


@dataclass
class Completion:
    """Everything a request produced, as collected from its outputs."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    events: list[api.RequestEvent] = field(default_factory=list)
    error: str | None = None
    rejected: api.RequestRejected | None = None
    sent_at: float = 0.0
    first_token_at: float | None = None
    ended_at: float | None = None
    heard: bool = False
    #: the engine step of each output that brought tokens (shared by requests batched together)
    steps: list[int] = field(default_factory=list)
    #: the streamed deltas missed tokens that the final output supplied
    repaired: bool = False
    attempts: int = 1
    request: api.EngineRequest | None = None

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.rejected is not None


class EngineClient:
    """``resend_after_s``: a request that got no answer at all (not even ``queued``) in that
    time is sent again with the same id, up to ``max_attempts`` times. A message in flight when
    the engine was checkpointed and stopped is gone with the old connection; the engine
    answers a repeated id that it already has with the request's whole output so far (or its
    end, when it ended recently), so a resend never runs a request twice. What the engine sent
    while this client was away (its outputs, even a request's end) is gone too, so on every
    new connection to the same endpoint (a handshake after the first: the engine restored,
    restarted or its link reset) every request without an end is sent again at once, heard
    or not (``reconnects`` counts them).

    ``locate``: where the engine is now (``for_engine`` gives one that reads the registry).
    With it, when no output came for ``follow_after_s`` while requests wait, ``poll`` asks
    again and ``move_to`` the endpoint it names when that is another one."""

    def __init__(self, endpoint: str, *, context: zmq.Context | None = None,
                 resend_after_s: float = 2.0, max_attempts: int = 5,
                 locate: Callable[[], str] | None = None,
                 follow_after_s: float = FOLLOW_AFTER_S) -> None:
        self.resend_after_s = resend_after_s
        self.max_attempts = max_attempts
        self.follow_after_s = check(DURATION, follow_after_s, "follow_after_s")
        self.endpoint = check_endpoint(endpoint)
        self._ctx = context or zmq.Context.instance()
        # a stable identity: when the engine comes back from a checkpoint image (or on
        # another node) and we reconnect, the outputs of our requests still reach us
        self.identity = f"client-{uuid.uuid4().hex[:12]}".encode()
        self._sock = self._socket()
        self._contact = FirstContact(self._sock, self.endpoint, hint=UNREACHABLE_HINT,
                                     watch_reconnects=True)
        #: new connections to the engine after the first (each made us ask again)
        self.reconnects = 0
        self._handshakes_seen = 0  # of the current socket, when last looked at
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:  # policy: a malformed endpoint is the caller's error
            self._contact.detach()
            self._sock.close(linger=0)
            raise ConfigError(f"cannot connect to {endpoint}: {exc}", endpoint=endpoint) from None
        self.requests: dict[str, Completion] = {}
        self._ids = itertools.count()
        self._locate = locate
        #: when anything last came from the engine, and when it was last looked up
        self._heard_at = self._located_at = time.monotonic()
        #: endpoints this client moved to, in order (``move_to``)
        self.moves: list[str] = []
        self._on_close: list[Callable[[], None]] = []
        #: the engine's name when followed through the registry (``for_engine``)
        self.engine: str | None = None
        self._lookup_failed: str | None = None  # said once until it changes
        #: set by the resolver's watch when the engine's record changed (``for_engine``)
        self._changed: threading.Event | None = None

    @classmethod
    def for_engine(cls, name: str, resolve: Resolve, **kwargs) -> "EngineClient":
        """A client of the engine ``name`` wherever ``resolve`` says it is (its ``api``
        endpoint), asked again at once when the resolver's watch says the engine's record
        changed (a resolver with ``watch``: the fleet's does), else when the engine is
        silent while requests wait (``follow_after_s``), and followed when it names
        another. The client closes
        ``resolve`` with itself, also when it cannot be made. For the fleet's registry:
        ``EngineClient.for_engine("llama-a", Resolver("http://10.0.0.5:2379"))`` with
        ``fleet.registry.Resolver``, whose errors it raises: ``UsageError`` (not in the
        registry, no api endpoint published), ``DamagedRecordError`` (an unreadable record),
        ``UnreachableError`` (etcd unavailable: exit 4)."""
        from ckpt_controller.endpoints import check_name

        try:
            check_name(name)
            client = cls(resolve(name, "api"), locate=lambda: resolve(name, "api"), **kwargs)
        except BaseException:  # policy: nothing half made is left open; the error goes on
            resolve.close()
            raise
        client.engine = name
        client._on_close.append(resolve.close)
        client._changed = watch_changes(resolve, name)
        return client

    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)  # outputs wait here while we do not read
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        return sock

    def close(self) -> None:
        self._contact.detach()
        self._sock.close(linger=0)
        for fn in self._on_close:
            fn()
        self._on_close.clear()

    def move_to(self, endpoint: str) -> list[str]:
        """Reconnect to ``endpoint`` (the engine moved there) with the same identity, and send
        every request that has not ended again (same ids). Each one's tokens start again
        from nothing: the engine answers a request it holds with its whole output so far (or
        its end), and one it does not hold (a fresh engine) runs from the start. Returns the
        ids sent again. An endpoint nobody serves is an ``UnreachableError`` from ``poll``
        within about a second, as at the start."""
        endpoint = check_endpoint(endpoint)
        sock = self._socket()
        contact = FirstContact(sock, endpoint, hint=UNREACHABLE_HINT, watch_reconnects=True)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:  # policy: a malformed endpoint is the caller's error
            contact.detach()
            sock.close(linger=0)
            raise ConfigError(f"cannot connect to {endpoint}: {exc}", endpoint=endpoint) from None
        self._contact.detach()
        self._sock.close(linger=0)  # what the old engine still had queued for us is dropped
        self._sock, self._contact, self.endpoint = sock, contact, endpoint
        self._handshakes_seen = 0
        self.moves.append(endpoint)
        self._heard_at = time.monotonic()
        return self._ask_again()

    def _ask_again(self) -> list[str]:
        """Send every request without an end again (same ids); the ids. Each one's tokens
        start again from nothing: the engine answers with the whole output so far (or the
        end), and a fresh engine that does not hold it runs it from the start."""
        now = time.monotonic()
        resent = []
        for c in self.requests.values():
            if c.ended or c.request is None:
                continue
            c.token_ids, c.steps, c.heard, c.sent_at = [], [], False, now
            self._sock.send_multipart(api.encode(api.EngineRequestType.ADD.value, c.request))
            resent.append(c.request_id)
        return resent

    def _after_reconnect(self) -> None:
        """Ask again for every request without an end once per new connection after the
        first (``FirstContact.handshakes``): what was in flight on the old one is gone."""
        handshakes = self._contact.handshakes
        if handshakes > max(1, self._handshakes_seen):
            self.reconnects += handshakes - max(1, self._handshakes_seen)
            resent = self._ask_again()
            if resent:
                log.info("engine client: connected to %s again; asked again for %d requests "
                         "without an end", self.endpoint, len(resent))
        self._handshakes_seen = handshakes

    def _follow(self, *, force: bool = False) -> bool:
        """Look the engine up again when it has been silent for ``follow_after_s`` while
        requests wait (or at once: ``force``), and move when it is elsewhere. True when this
        client moved."""
        if self._locate is None:
            return False
        if self._changed is not None and self._changed.is_set():  # the record changed: look now
            self._changed.clear()
            force = True
        now = time.monotonic()
        if not force and (now - max(self._heard_at, self._located_at) < self.follow_after_s
                          or all(c.ended for c in self.requests.values())):
            return False
        self._located_at = now
        try:
            endpoint = self._locate()
        except CkptError as err:  # policy: the registry is away or says nothing new: stay
            if str(err) != self._lookup_failed:
                self._lookup_failed = str(err)
                log.warning("engine client: looking engine %s up again failed (%s); staying "
                            "on %s", self.engine or "?", err, self.endpoint)
            return False
        self._lookup_failed = None
        if endpoint == self.endpoint:
            return False
        log.info("engine client: the engine moved from %s to %s", self.endpoint, endpoint)
        self.move_to(endpoint)
        return True

    def engine_lost(self, reason: str) -> list[str]:
        """The engine process died: every request without an end ends now with finish reason
        ``error`` (``reason``), and the connection is replaced, so that nothing queued for
        the dead process reaches its successor. Returns the ids ended."""
        now = time.monotonic()
        ended = []
        for c in self.requests.values():
            if not c.ended:
                c.finish_reason, c.error, c.ended_at = FinishReason.ERROR, reason, now
                ended.append(c.request_id)
        old = self._sock
        self._contact.detach()
        self.identity = f"client-{uuid.uuid4().hex[:12]}".encode()
        self._sock = self._socket()
        self._contact.attach(self._sock)
        self._handshakes_seen = 0
        self._sock.connect(self.endpoint)
        old.close(linger=0)
        return ended

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, prompt: list[int], max_tokens: int, *, stop_token_id: int | None = None,
               request_id: str | None = None) -> str:
        prompt = [check(TOKEN_ID, t, "prompt_token_ids") for t in prompt]
        max_tokens = check(COUNT, max_tokens, "max_tokens")
        stop_token_id = check_optional(TOKEN_ID, stop_token_id, "stop_token_id")
        rid = request_id or f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        req = api.EngineRequest(request_id=rid, prompt_token_ids=list(prompt),
                                max_tokens=max_tokens, stop_token_id=stop_token_id,
                                arrival_time=time.time())
        self.requests[rid] = Completion(rid, sent_at=time.monotonic(), request=req)
        self._sock.send_multipart(api.encode(api.EngineRequestType.ADD.value, req))
        return rid

    def _resend_unheard(self) -> None:
        now = time.monotonic()
        for c in self.requests.values():
            if c.heard or c.ended or c.request is None or c.attempts >= self.max_attempts:
                continue
            if now - c.sent_at >= self.resend_after_s * c.attempts:
                c.attempts += 1
                self._sock.send_multipart(api.encode(api.EngineRequestType.ADD.value,
                                                     c.request))

    def abort(self, request_ids: list[str]) -> None:
        self._sock.send_multipart(api.encode(api.EngineRequestType.ABORT.value,
                                             api.AbortRequest(request_ids=list(request_ids))))

    def poll(self, timeout_s: float) -> list[Completion]:
        """Wait up to ``timeout_s`` for outputs, take in all that arrived, and return the
        requests that ended among them (possibly none: call again)."""
        ended: list[Completion] = []

        def take_all() -> None:
            while self._sock.poll(0, zmq.POLLIN):
                frames = self._sock.recv_multipart()
                self._heard_at = time.monotonic()
                if not self._contact.settled:
                    self._contact.heard()
                c = self._take(api.decode_reply(frames))
                if c is not None and c.ended:
                    ended.append(c)

        take_all()  # what already arrived first: a request is unheard only if nothing came
        self._follow()
        self._resend_unheard()
        try:
            ready = self._wait(timeout_s)  # UnreachableError: nobody serves it
        except UnreachableError:
            if not self._follow(force=True):  # policy: a followed engine may have moved
                raise
            ready = self._wait(timeout_s)
        self._after_reconnect()
        if ready:
            take_all()
        return ended

    def _wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the engine's socket to be readable; a watched
        engine's wait looks every ``WATCH_SLICE_S`` whether its record changed, and moves
        (then waits on the new socket) when it names another endpoint."""
        if self._changed is None:
            return self._contact.poll(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if self._contact.poll(max(0.0, min(left, WATCH_SLICE_S))):
                return True
            if left <= WATCH_SLICE_S:
                return False
            if self._changed.is_set():
                self._follow()

    def _take(self, msg: api.RequestOutput | api.RequestRejected) -> Completion | None:
        c = self.requests.get(msg.request_id)
        if c is None or c.ended:
            return None  # not ours (e.g. a rejection of a malformed frame), or a late echo
        now = time.monotonic()
        c.heard = True
        if isinstance(msg, api.RequestRejected):
            c.rejected, c.ended_at = msg, now
            return c
        if (msg.new_token_ids or msg.token_ids) and c.first_token_at is None:
            c.first_token_at = now
        if msg.token_ids is not None:
            # the whole output so far (an end, or the answer to a resend): it replaces what
            # we have, so deltas lost with a connection are repaired
            if msg.finished:
                c.repaired = c.token_ids + list(msg.new_token_ids) != msg.token_ids
            c.token_ids = list(msg.token_ids)
        else:
            c.token_ids.extend(msg.new_token_ids)
        if msg.new_token_ids:
            c.steps.append(msg.step)
        c.events.extend(msg.events)
        if msg.finished:
            c.finish_reason, c.error, c.ended_at = msg.finish_reason, msg.error, now
        return c

    def generate(self, prompt: list[int], max_tokens: int, *, stop_token_id: int | None = None,
                 timeout_s: float = 60.0) -> Completion:
        """One request, start to end. Raises the typed rejection, ``DeadlineError``, or
        ``UnreachableError`` (within about a second when nobody serves the endpoint)."""
        timeout_s = check(DURATION, timeout_s, "timeout_s")
        start = time.monotonic()
        rid = self.submit(prompt, max_tokens, stop_token_id=stop_token_id)
        deadline = start + timeout_s
        c = self.requests[rid]
        while not c.ended:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineError(
                    f"no end of the request from {self.endpoint} in "
                    f"{time.monotonic() - start:.1f}s", request_id=rid, timeout_s=timeout_s,
                    tokens=len(c.token_ids), heard=c.heard)
            self.poll(min(left, 0.5))
        del self.requests[rid]
        if c.rejected is not None:
            raise c.rejected.to_exception()
        if c.finish_reason == FinishReason.ERROR:
            raise OperationError("the engine failed the request", request_id=rid, error=c.error)
        return c
