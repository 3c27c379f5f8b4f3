"""Continuous batching: which requests run, and one step of the whole batch.

Requests wait in a queue, are admitted into the running batch when KV blocks are free
(prefill), then decode together one token per step. When a running request needs a block
and none is free, the most recently admitted request is preempted: its blocks are freed and
it goes back to the front of the queue to be recomputed (prompt + tokens so far), as vLLM
does. ``keep`` takes requests out of scheduling with their tokens (host memory) and ``resume``
puts them back the same way, so they finish with the tokens they would have had anyway.
One thread (the server's scheduler thread) owns all of this state. Other threads (the API
thread admitting requests, the agent's hooks) ``submit`` a function and it runs on the owner
thread between two steps, and also between two prefills of one step: a step that admits
several requests (a burst, or the kept requests after a resume) prefills them one by one, and
a hook or a client that came back waits for one prefill, not for all of them. So a hook never
starves behind the loop, and after a resume a client's resend is answered with the first
kept request's new token as soon as it is computed.

Every queue is bounded and says what happens when it is full. The engine holds at most
``max_batch + max_waiting`` requests (running, waiting, and on their way into ``waiting``):
``submit_add`` refuses one more at once with the typed, retryable ``OverloadedError``, on the
submitting thread, so a flood is shed without waiting for a step. So ``waiting`` holds at most
``max_waiting`` requests beyond the free places in the batch (all of them when the KV pool, not
the batch, is what is full). A request that was already accepted is never refused: one
preempted, or kept and resumed, goes back into ``waiting``. ``submit_abort`` holds at most
``MAX_PENDING_ABORTS`` aborts, then sheds likewise. ``submit`` (the engine's own hooks) is not
counted: each caller waits for its result, so it queues one command at a time. ``running``
holds at most ``max_batch``.
Neighbours: ``model``, ``kv``, ``api`` (the ``RequestOutput`` messages it emits), ``server``
(the thread that runs the loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ckpt_controller.engine.api import RequestEvent, RequestOutput
from ckpt_controller.engine.kv import BlockPool
from ckpt_controller.engine.model import TinyLM
from ckpt_controller.errors import OverloadedError
from ckpt_controller.vocab import FinishReason

log = logging.getLogger("ckpt_controller.engine")

#: requests that may wait for a place in the running batch (``ckptctl engine serve
#: --max-waiting``): 16 full batches at the default ``max_batch``
DEFAULT_MAX_WAITING = 256
#: ABORT messages that may wait for the scheduler thread before one more is shed
MAX_PENDING_ABORTS = 16
#: the hint an ``OverloadedError`` carries: about how long a queue of short requests takes to
#: make room
OVERLOAD_RETRY_AFTER_S = 0.5


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    stop_token_id: int | None
    arrival_time: float
    client: bytes
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    #: tokens whose K/V are in ``blocks``; the token after them is pending
    computed: int = 0
    events: list[RequestEvent] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Scheduler:
    def __init__(
        self,
        model: TinyLM,
        pool: BlockPool,
        *,
        max_batch: int,
        emit: Callable[[bytes, RequestOutput], None],
        on_finish: Callable[[str, str], None],
        max_waiting: int = DEFAULT_MAX_WAITING,
        name: str = "",
    ) -> None:
        self.model = model
        self.pool = pool
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.name = name
        self.emit = emit
        self.on_finish = on_finish
        self.lock = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.kept: list[Request] = []
        self.paused = False
        self.steps = 0
        #: every request the scheduler holds (running, waiting or kept), by id
        self.by_id: dict[str, Request] = {}
        #: held while a request's output grows and is emitted, and while it joins or leaves
        #: ``by_id``: another thread holding it sees a request's output, its client and
        #: whether it is held all at one moment (the server answers a client that came back
        #: under it, in the middle of a step)
        self.output_lock = threading.RLock()
        self._commands: deque[tuple[Callable[[], object], Future | None]] = deque()
        #: ``submit_add`` / ``submit_abort`` commands not yet run (guarded by ``lock``)
        self._arriving = 0
        self._aborting = 0

    # ---------------------------------------------------------------- any thread

    def submit(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the scheduler thread before its next step (the engine's own hooks:
        the caller waits for the result, so it has one command queued at a time)."""
        fut: Future = Future()
        with self.lock:
            self._commands.append((fn, fut))
            self.lock.notify_all()
        return fut

    def submit_add(self, request_id: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` (which admits ``request_id`` into ``waiting``) on the scheduler thread,
        or raise ``OverloadedError`` at once when ``max_batch + max_waiting`` requests are
        already running, waiting or on their way. ``fn`` answers its client itself (an
        exception from it is only logged)."""
        with self.lock:
            # running and waiting belong to the scheduler thread: their lengths here are a
            # snapshot, in which a request passing between them, or from _arriving into
            # waiting, may count twice but never zero times
            held = len(self.running) + len(self.waiting) + self._arriving
            if held >= self.max_batch + self.max_waiting:
                # policy: shed, typed and retryable; nothing of the request ran
                raise OverloadedError(
                    f"engine {self.name or '?'} is overloaded: {held} requests running or "
                    f"waiting (at most {self.max_batch} running + {self.max_waiting} waiting)",
                    engine=self.name, request_id=request_id, held=held,
                    max_batch=self.max_batch, max_waiting=self.max_waiting,
                    retry_after_s=OVERLOAD_RETRY_AFTER_S)
            self._arriving += 1
            self._commands.append((lambda: self._arrived(fn, "_arriving"), None))
            self.lock.notify_all()

    def submit_abort(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (an ABORT from the request API) on the scheduler thread, or raise
        ``OverloadedError`` at once when ``MAX_PENDING_ABORTS`` aborts already wait."""
        with self.lock:
            if self._aborting >= MAX_PENDING_ABORTS:
                # policy: shed, typed and retryable; nothing of the abort ran
                raise OverloadedError(
                    f"engine {self.name or '?'} is overloaded: {self._aborting} aborts already "
                    f"wait for the scheduler", engine=self.name,
                    retry_after_s=OVERLOAD_RETRY_AFTER_S)
            self._aborting += 1
            self._commands.append((lambda: self._arrived(fn, "_aborting"), None))
            self.lock.notify_all()

    def _arrived(self, fn: Callable[[], None], counter: str) -> None:
        try:
            fn()
        finally:  # after fn: its request is in waiting by now, counted there
            with self.lock:
                setattr(self, counter, getattr(self, counter) - 1)

    def run_loop(self, stop: threading.Event, on_error: Callable[[Exception], None]) -> None:
        """The scheduler thread: commands, then one step, until ``stop``."""
        while not stop.is_set():
            with self.lock:
                if not self._commands and not self.has_work():
                    self.lock.wait(0.1)
            self.run_commands()
            if self.has_work():
                try:
                    self.step()
                except Exception as exc:  # policy: the caller decides (ends requests with ERROR)
                    on_error(exc)

    def run_commands(self) -> None:
        """Run every submitted command, in order (scheduler thread only)."""
        with self.lock:
            commands, self._commands = self._commands, deque()
        for fn, fut in commands:
            if fut is None:  # from the request API: it answers its client itself
                try:
                    fn()
                except Exception:  # policy: a bug in one request's command is logged
                    log.exception("engine %s: a request command failed", self.name)
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:  # policy: the submitter gets the exception
                    fut.set_exception(exc)

    # ---------------------------------------------------------------- scheduler thread only

    def add(self, req: Request) -> None:
        self._event(req, "queued")
        with self.output_lock:
            self.emit(req.client, RequestOutput(request_id=req.request_id, events=req.events))
            req.events = []
            self.waiting.append(req)
            self.by_id[req.request_id] = req

    def has_work(self) -> bool:
        return not self.paused and bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        return self.by_id.get(request_id)

    def abort(self, request_ids: list[str]) -> int:
        """End each request now with ``abort`` and its partial output."""
        n = 0
        for rid in request_ids:
            req = self.find(rid)
            if req is not None:
                self._finish(req, FinishReason.ABORT)
                n += 1
        return n

    def keep(self, request_ids: list[str]) -> int:
        """Take requests out of scheduling, tokens kept, KV blocks returned."""
        for rid in request_ids:
            req = self.find(rid)
            if req is None or req in self.kept:
                continue
            self._unschedule(req)
            self.kept.append(req)
        return len(self.kept)

    def resume(self) -> int:
        """Kept requests go back to the front of the queue, oldest first; scheduling resumes."""
        n = len(self.kept)
        self.kept.sort(key=lambda r: r.arrival_time)
        self.waiting.extendleft(reversed(self.kept))
        self.kept.clear()
        self.paused = False
        return n

    def fail_all(self, error: str) -> None:
        for req in (*self.running, *self.waiting):
            self._finish(req, FinishReason.ERROR, error)

    def step(self) -> None:
        """Admit what fits (prefill), then decode the running batch by one token."""
        self.steps += 1
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            need = self.pool.blocks_for(len(req.tokens) + 1)
            blocks = self.pool.allocate(need)
            if blocks is None:
                break
            req.blocks = blocks
            self._event(req, "scheduled")
            self.running.append(req)  # first: if prefill raises, fail_all still ends it
            self.waiting.popleft()  # after: submit_add's count never misses it in passing
            token = self.model.prefill(req.tokens, self.pool.kv, req.blocks)
            req.computed = len(req.tokens)
            self._append(req, token)
            if self.waiting and self._commands:
                # between two prefills: hooks and resends wait for one, not for all; a
                # command may pause (a drain), abort or keep (each leaves the state whole)
                self.run_commands()
                if self.paused:
                    return
        batch = [r for r in self.running if r.computed == len(r.tokens) - 1]
        for req in list(batch):
            if req not in self.running:  # preempted to make room for an earlier one
                batch.remove(req)
                continue
            if not self._ensure_block(req):
                batch.remove(req)
        batch = [r for r in batch if r in self.running]
        if not batch:
            return
        nxt = self.model.decode([(r.tokens[-1], r.computed, r.blocks) for r in batch], self.pool.kv)
        for req, token in zip(batch, nxt):
            req.computed += 1
            self._append(req, token)

    # ---------------------------------------------------------------- helpers

    def _ensure_block(self, req: Request) -> bool:
        """A block for position ``req.computed``; preempt the newest other request if needed."""
        while len(req.blocks) * self.pool.block_size <= req.computed:
            got = self.pool.allocate(1)
            if got is not None:
                req.blocks.extend(got)
                continue
            victims = [r for r in self.running if r is not req]
            if not victims:
                return False
            victim = victims[-1]
            self._unschedule(victim)
            self._event(victim, "preempted")
            self.waiting.appendleft(victim)
        return True

    def _unschedule(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.blocks)
        req.computed = 0

    def _append(self, req: Request, token: int) -> None:
        with self.output_lock:  # the token and its output together (see ``output_lock``)
            req.output.append(token)
            reason = None
            if req.stop_token_id is not None and token == req.stop_token_id:
                reason = FinishReason.STOP
            elif (len(req.output) >= req.max_tokens
                  or len(req.tokens) >= self.model.cfg.max_seq_len):
                reason = FinishReason.LENGTH
            if reason is not None:
                self._finish(req, reason, new=[token])
            else:
                self.emit(req.client, RequestOutput(
                    request_id=req.request_id, new_token_ids=[token], events=req.events,
                    step=self.steps))
                req.events = []

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None,
                new: list[int] | None = None) -> None:
        with self.output_lock:
            if req in self.kept:
                self.kept.remove(req)
            else:
                self._unschedule(req)
            self.pool.free(req.blocks)
            self.by_id.pop(req.request_id, None)
            # the agent's books first: once the client sees the end, status no longer counts it
            self.on_finish(req.request_id, reason)
            self.emit(req.client, RequestOutput(
                request_id=req.request_id, new_token_ids=new or [], finished=True,
                finish_reason=reason, events=req.events, error=error,
                token_ids=list(req.output), step=self.steps,
            ))
            req.events = []

    @staticmethod
    def _event(req: Request, kind: str) -> None:
        req.events.append(RequestEvent(type=kind, timestamp=time.monotonic()))
