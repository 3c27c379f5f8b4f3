"""Clients of the reference engine's request API (no torch).

``EngineClient`` submits requests and collects their streamed outputs over one DEALER;
``generate`` is the blocking one-request form (raises the engine's typed rejection). Every
wait has a deadline. Until the engine is first heard from, ``contact.FirstContact`` watches
the connection, so a missing socket file or a refused port is an ``UnreachableError`` within
about a second; token ids, counts and timeouts are checked (``values``) before anything is
sent. Neighbours: ``api`` (messages), ``load`` (many requests at a rate), ``contact``,
``values`` (the limits), ``endpoints`` (endpoint checks).
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field

import zmq

from ckpt_controller.contact import FirstContact
from ckpt_controller.endpoints import check_endpoint
from ckpt_controller.engine import api
from ckpt_controller.errors import ConfigError, DeadlineError, OperationError
from ckpt_controller.values import COUNT, DURATION, TOKEN_ID, check, check_optional
from ckpt_controller.vocab import FinishReason


#: outputs queued in this client before the engine's own queue takes over
RCV_HWM = 1_000_000
#: what to check when the engine cannot be reached at all
UNREACHABLE_HINT = "is the engine running? check its request API endpoint (--api)"


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
    the engine was checkpointed and stopped is gone with the old connection; the engine ignores
    a repeated id that it already has, so a resend never runs a request twice."""

    def __init__(self, endpoint: str, *, context: zmq.Context | None = None,
                 resend_after_s: float = 2.0, max_attempts: int = 5) -> None:
        self.resend_after_s = resend_after_s
        self.max_attempts = max_attempts
        self.endpoint = check_endpoint(endpoint)
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RCV_HWM)  # outputs wait here while we do not read
        # a stable identity: when the engine comes back from a checkpoint image and we
        # reconnect, the outputs of our kept requests still reach us
        self._sock.setsockopt(zmq.ROUTING_ID, f"client-{uuid.uuid4().hex[:12]}".encode())
        self._contact = FirstContact(self._sock, self.endpoint, hint=UNREACHABLE_HINT)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:  # policy: a malformed endpoint is the caller's error
            self._contact.detach()
            self._sock.close(linger=0)
            raise ConfigError(f"cannot connect to {endpoint}: {exc}", endpoint=endpoint) from None
        self.requests: dict[str, Completion] = {}
        self._ids = itertools.count()

    def close(self) -> None:
        self._contact.detach()
        self._sock.close(linger=0)

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
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        self._sock.setsockopt(zmq.ROUTING_ID, f"client-{uuid.uuid4().hex[:12]}".encode())
        self._contact.attach(self._sock)
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
                if not self._contact.settled:
                    self._contact.heard()
                c = self._take(api.decode_reply(frames))
                if c is not None and c.ended:
                    ended.append(c)

        take_all()  # what already arrived first: a request is unheard only if nothing came
        self._resend_unheard()
        if self._contact.poll(timeout_s):  # UnreachableError when nobody serves the endpoint
            take_all()
        return ended

    def _take(self, msg: api.RequestOutput | api.RequestRejected) -> Completion | None:
        c = self.requests.get(msg.request_id)
        if c is None or c.ended:
            return None  # not ours (e.g. a rejection of a malformed frame), or a late echo
        now = time.monotonic()
        c.heard = True
        if isinstance(msg, api.RequestRejected):
            c.rejected, c.ended_at = msg, now
            return c
        if msg.new_token_ids and c.first_token_at is None:
            c.first_token_at = now
        c.token_ids.extend(msg.new_token_ids)
        if msg.new_token_ids:
            c.steps.append(msg.step)
        c.events.extend(msg.events)
        if msg.finished:
            c.finish_reason, c.error, c.ended_at = msg.finish_reason, msg.error, now
            if msg.token_ids is not None:
                # the end carries the whole output: deltas lost with a connection are repaired
                c.repaired = c.token_ids != msg.token_ids
                c.token_ids = list(msg.token_ids)
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
