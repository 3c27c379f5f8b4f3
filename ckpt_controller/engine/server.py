"""The reference engine process: model + KV pool + scheduler + request API + embedded agent.

Threads: the API thread owns the request ROUTER (admits requests through the agent's gate,
forwards outputs from the outbox; answers it makes itself go straight to the ROUTER, and it
reads at most ``READ_BUDGET`` requests per round); the scheduler thread steps the batch; the
agent has its own control and operation threads. Under a flood nothing grows without bound: an
ADD past ``--max-waiting`` (``EngineOptions.max_waiting``) or an ABORT past
``scheduler.MAX_PENDING_ABORTS`` is refused by the API thread at once with the typed, retryable
``OverloadedError`` (the scheduler's queues are bounded, see ``scheduler``), and a request id
or an ABORT over ``api``'s limits is refused as a ``UsageError``. The request ROUTER drops any
message over ``api.MAX_MESSAGE_BYTES`` (the control sockets' 16 MiB) before it is read. If the
API or the scheduler thread dies of a bug, the process exits with status 70
(``zmqutil.guarded``): an engine whose agent heartbeats RUNNING must be able to serve. The
engine's ``EngineHooks`` map the agent's drain and pause/resume calls onto the scheduler, and
``verify`` re-runs a golden prompt before the engine serves again, through blocks of the
re-woken KV pool (``TinyLM.paged_forced``: the path requests take) and, only when that
differs, through the cache-free path (``TinyLM.forced_tokens``: the weights) to say which
computes otherwise; each on the prompt and its greedy continuation taken at start, so one
pass checks every token (teacher forcing). After a flood
was shed, the heap gives back what it left free (``memory.trim_host_heap``, glibc's
``malloc_trim``). A request sent again with an id the engine holds (a client that reconnected,
e.g. after the engine moved to another node) keeps its one run and is answered with its whole
output so far, by the API thread at once (``_reattach``, under the scheduler's
``output_lock``), even in the middle of a step; one that ended recently (``RecentEnds``) with
its end again.
Neighbours: ``scheduler``, ``model``, ``kv``, ``api``; ``agent`` (embedded), ``memory`` (the
``MemoryRegistry`` holding ``weights`` and ``kv_cache``), ``zmqutil`` (``Outbox``, ``guarded``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from ckpt_controller.agent import Agent, EngineHooks
from ckpt_controller.endpoints import (cannot_bind, check_endpoint, remove_stale_ipc,
                                      secure_ipc)
from ckpt_controller.engine import api
from ckpt_controller.engine.kv import BlockPool
from ckpt_controller.engine.model import load_model, materialize
from ckpt_controller.engine.scheduler import DEFAULT_MAX_WAITING, Request, Scheduler
from ckpt_controller.errors import (CkptError, OperationError, OverloadedError, ProtocolError,
                                    UsageError, VerificationError, described)
from ckpt_controller.memory import MemoryRegistry, trim_host_heap
from ckpt_controller.zmqutil import Outbox, guarded

log = logging.getLogger("ckpt_controller.engine")

GOLDEN_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GOLDEN_TOKENS = 8


@dataclass
class EngineOptions:
    name: str
    api: str
    control: str | None = None
    model: str = "tiny"
    seed: int = 0
    model_dir: Path = Path(".cache/models")
    dtype: str | None = None
    kv_blocks: int | None = None
    block_size: int = 16
    max_batch: int = 16
    #: requests that may wait for the running batch; one more is shed (``OverloadedError``)
    max_waiting: int = DEFAULT_MAX_WAITING
    heartbeat_interval_s: float = 0.5
    #: CURVE keys for a tcp:// control endpoint (``security.CurveServer``)
    curve: object | None = None
    #: start PREPARED (KV cache released, as vLLM's ``--checkpoint-prepare-on-startup``): a
    #: capture of it is a snapshot that restores serve from
    prepare_on_startup: bool = False


#: outputs queued per client before any is dropped (about 100 bytes each)
OUTPUT_HWM = 1_000_000
#: requests the API thread reads per round before it forwards outputs again
READ_BUDGET = 256
#: once requests were shed and then none was for this long (the flood is over), the C heap
#: gives back what the flood left free (``memory.trim_host_heap``)
TRIM_AFTER_QUIET_S = 1.0
#: the ends of at most this many recently ended requests are kept for resends (encoded: a few
#: bytes per token, so at most a few tens of MiB with the largest models' outputs)
RECENT_ENDS = 4096
#: ... each for this long at most
RECENT_END_AGE_S = 600.0


def signature(prompt: list[int], max_tokens: int, stop_token_id: int | None,
              arrival_time: float) -> int:
    """What tells a resend (the same request, sent again: a client resends the message it
    sent, ``arrival_time`` included) from another request under an id used before (``ckptctl
    load`` names its requests after its seed). ``hash`` of ints, floats and None is the same
    in every process, so it holds across a restore from an image."""
    return hash((tuple(prompt), max_tokens, stop_token_id, arrival_time))


class RecentEnds:
    """The final outputs of recently ended requests, as encoded frames, by request id: a
    client that reconnects (to this engine restored on another node, say) and sends the same
    request again (its ``signature``) gets its end again. Bounded: at most ``max_count``,
    none older than ``max_age_s``. Written by the scheduler thread, read by the API thread
    too (hence the lock)."""

    def __init__(self, max_count: int = RECENT_ENDS, max_age_s: float = RECENT_END_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count, self.max_age_s, self._clock = max_count, max_age_s, clock
        self._ends: OrderedDict[str, tuple[float, int, list[bytes]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, request_id: str, sig: int, frames: list[bytes]) -> None:
        now = self._clock()
        with self._lock:
            self._ends.pop(request_id, None)
            self._ends[request_id] = (now, sig, frames)
            while self._ends and (len(self._ends) > self.max_count
                                  or now - next(iter(self._ends.values()))[0] > self.max_age_s):
                self._ends.popitem(last=False)

    def get(self, request_id: str, sig: int) -> list[bytes] | None:
        """The end of this request (id and signature), if it ended recently."""
        with self._lock:
            found = self._ends.get(request_id)
        if found is None or found[1] != sig or self._clock() - found[0] > self.max_age_s:
            return None
        return found[2]

    def __len__(self) -> int:
        return len(self._ends)


class ReferenceEngine(EngineHooks):
    def __init__(self, opts: EngineOptions) -> None:
        check_endpoint(opts.api)  # before the model loads: a bad address is said at once
        self.opts = opts
        self.weights_path = materialize(opts.model, opts.seed, opts.model_dir, opts.dtype)
        self.model = load_model(self.weights_path)
        cfg = self.model.cfg
        n_blocks = opts.kv_blocks or 4 * self.pool_blocks_for(cfg.max_seq_len, opts.block_size)
        self.pool = BlockPool(cfg, n_blocks, opts.block_size)
        self.golden = self.model.reference_tokens(GOLDEN_PROMPT, GOLDEN_TOKENS)
        #: the golden prompt and its continuation, checked at once (teacher forcing)
        self._golden_seq = GOLDEN_PROMPT + self.golden[:-1]
        self.golden_forced = self._forced_golden()
        self.golden_paged = self._paged_golden()
        self.registry = MemoryRegistry()
        self.registry.register("weights", self.model, source=self.weights_path)
        self.registry.register("kv_cache", {"kv": self.pool.kv})
        self._ctx = zmq.Context()
        self._outbox = Outbox(self._ctx, f"engine-{opts.name}")
        self.agent = Agent(opts.name, hooks=self, memory=self.registry, control=opts.control,
                           heartbeat_interval_s=opts.heartbeat_interval_s, curve=opts.curve)
        self.scheduler = Scheduler(self.model, self.pool, max_batch=opts.max_batch,
                                   emit=self._emit, on_finish=self.agent.gate.finish,
                                   max_waiting=opts.max_waiting, name=opts.name)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._api_sock: zmq.Socket | None = None
        self.api_endpoint = opts.api
        #: ends of recently ended requests, for a client's resend (``RecentEnds``)
        self.ends = RecentEnds()
        #: the ``signature`` of every request held, until its end is kept (scheduler thread)
        self._signatures: dict[str, int] = {}
        #: requests shed since the heap was last trimmed (API thread)
        self._shed = 0

    @staticmethod
    def pool_blocks_for(tokens: int, block_size: int) -> int:
        return -(-tokens // block_size)

    # ---------------------------------------------------------------- life

    def start(self) -> "ReferenceEngine":
        self._api_sock = self._ctx.socket(zmq.ROUTER)
        self._api_sock.setsockopt(zmq.LINGER, 0)
        self._api_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client takes over
        # a ROUTER drops what it cannot queue: a client that reads late (busy elsewhere for a
        # few seconds while thousands of tokens stream) must still get every output, above
        # all the final ones
        self._api_sock.setsockopt(zmq.SNDHWM, OUTPUT_HWM)
        # what is over the limit is dropped by zmq while it arrives, never buffered whole
        self._api_sock.setsockopt(zmq.MAXMSGSIZE, api.MAX_MESSAGE_BYTES)
        try:
            try:
                self._api_sock.bind(self.opts.api)
            except zmq.ZMQError as exc:  # policy: said as the control endpoint's bind says it
                raise cannot_bind(self.opts.api, exc) from exc
            secure_ipc(self.opts.api)  # its owner's only, as the control endpoint's
            # as bound (a port 0 resolved), wildcard hosts kept: the agent reports it in status
            self.api_endpoint = self._api_sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.agent.endpoints["api"] = self.api_endpoint
            self.agent.start()
        except CkptError:
            # policy: an engine that cannot serve both endpoints closes the one it opened
            self._api_sock.close(linger=0)
            self._api_sock = None
            raise
        for target, name in ((self._schedule_loop, "sched"), (self._api_loop, "api")):
            t = threading.Thread(target=guarded(target, f"engine-{name}",
                                                stopping=self._stop.is_set),
                                 name=f"engine-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def info(self) -> dict:
        cfg = self.model.cfg
        return {"event": "ready", "name": self.opts.name, "pid": os.getpid(),
                "api": self.api_endpoint, "control": self.agent.endpoint,
                "weights": str(self.weights_path), "weight_bytes": cfg.weight_bytes(),
                "kv_bytes": self.pool.kv.nbytes, "vocab_size": cfg.vocab_size,
                "max_seq_len": cfg.max_seq_len, "dtype": cfg.dtype,
                "max_batch": self.opts.max_batch, "max_waiting": self.opts.max_waiting,
                "state": self.agent.lifecycle.state.value}

    def wait(self) -> None:
        while not self._stop.wait(0.5):
            pass

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.agent.close()
        self._outbox.close()
        if self._api_sock is not None:
            self._api_sock.close(linger=0)
        self._ctx.term()
        remove_stale_ipc(self.api_endpoint)  # zmq leaves an ipc socket's file behind

    # ---------------------------------------------------------------- threads

    def _schedule_loop(self) -> None:
        def step_failed(exc: Exception) -> None:
            # policy: a failed step ends its requests with ERROR; the engine goes on
            log.error("engine step failed: %s", described(exc), exc_info=exc)
            self.scheduler.fail_all(repr(exc))

        self.scheduler.run_loop(self._stop, step_failed)

    def _on_scheduler(self, fn, timeout_s: float = 60.0):
        """Run ``fn`` on the scheduler thread and wait for its result."""
        return self.scheduler.submit(fn).result(timeout=timeout_s)

    def _api_loop(self) -> None:
        self._outbox.own(self._api_sock)  # this thread's own answers go straight out
        poller = zmq.Poller()
        poller.register(self._api_sock, zmq.POLLIN)
        poller.register(self._outbox.inbox, zmq.POLLIN)
        shed_before, last_shed = 0, time.monotonic()
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._outbox.inbox in events:
                self._outbox.forward()
            if self._api_sock in events:
                for _ in range(READ_BUDGET):  # the rest waits for the next round
                    try:
                        frames = self._api_sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames[0], frames[1:])
            if self._shed != shed_before:
                shed_before, last_shed = self._shed, time.monotonic()
            elif self._shed and time.monotonic() - last_shed >= TRIM_AFTER_QUIET_S:
                log.info("engine %s: shed %d requests in a flood; the heap gives back what it "
                         "left free", self.opts.name, self._shed)
                self._shed = shed_before = 0
                # the flood's threads (zmq's I/O thread, the API and scheduler threads) freed
                # its memory into their malloc arenas, which glibc keeps: give it back
                trim_host_heap()  # False (a no-op) without glibc

    def _handle(self, client: bytes, frames: list[bytes]) -> None:
        try:
            msg = api.decode_request(frames)
        except ProtocolError as err:  # policy: a bad request is answered, never fatal
            log.warning("engine %s: bad request frame: %s", self.opts.name, err)
            self._reject(client, "", err)
            return
        if isinstance(msg, api.AbortRequest):
            ids = msg.request_ids
            try:
                if len(ids) > api.MAX_ABORT_IDS:
                    raise UsageError(f"an abort names at most {api.MAX_ABORT_IDS} request ids",
                                     ids=len(ids), max_ids=api.MAX_ABORT_IDS)
                self.scheduler.submit_abort(lambda: self.scheduler.abort(ids))
            except CkptError as err:  # policy: a refused abort is answered, never queued
                self._shed += isinstance(err, OverloadedError)
                self._reject(client, "", err)
            return
        try:
            self._validate(msg)
            end = self.ends.get(msg.request_id, _signature_of(msg))
            if end is not None:  # a resend of a request that ended: its end again, no run
                self._outbox.send([client, *end])
                return
            if msg.request_id in self.scheduler.by_id and self._reattach(client, msg):
                return
            self.scheduler.submit_add(msg.request_id, lambda: self._admit(client, msg))
        except OverloadedError as err:  # policy: shed at once, typed; nothing of it ran
            # a resend of a request we already have (a membership test of the scheduler's
            # dict, safe from this thread) keeps its one run and its answers
            if msg.request_id in self.scheduler.by_id:
                return
            self._shed += 1
            self._reject(client, msg.request_id, err)
        except CkptError as err:  # policy: an invalid request gets a typed answer
            self._reject(client, msg.request_id, err)

    def _reattach(self, client: bytes, msg: api.EngineRequest) -> bool:
        """A resend of a request the engine holds (its client came back), answered here on
        the API thread at once, even in the middle of a step (a prefill after a restore, say):
        its outputs go to the sender from now on, first the whole output so far. Under the
        scheduler's ``output_lock``, so none of its outputs is emitted meanwhile; the outputs
        emitted before leave first, so the client gets them, then the whole output, then the
        next tokens, in order. False when it is no longer held (``_admit`` answers then)."""
        lock = self.scheduler.output_lock
        while not lock.acquire(timeout=0.01):
            self._outbox.forward()  # the scheduler may be waiting for room to emit
        try:
            req = self.scheduler.find(msg.request_id)
            if req is None:
                return False
            if self._signatures.get(req.request_id) != _signature_of(msg):
                self._reject(client, msg.request_id, UsageError(
                    "the request id is in use by another request", request_id=msg.request_id))
                return True
            while self._outbox.forward():
                pass
            req.client = client
            self._emit(client, api.RequestOutput(request_id=req.request_id,
                                                 token_ids=list(req.output),
                                                 step=self.scheduler.steps))
            return True
        finally:
            lock.release()

    def _admit(self, client: bytes, msg: api.EngineRequest) -> None:
        """On the scheduler thread: admitted and queued as one step, so a drain sees both."""
        req = self.scheduler.find(msg.request_id)
        sig = _signature_of(msg)
        if req is not None:
            if self._signatures.get(req.request_id) != sig:
                self._reject(client, msg.request_id, UsageError(
                    "the request id is in use by another request", request_id=msg.request_id))
                return
            # a client's resend of a request we already have (it reconnected): it keeps its
            # one run; its outputs go to the sender from now on, first the whole output so far
            # (``token_ids``), in order with the deltas (as ``_reattach`` answers most)
            with self.scheduler.output_lock:
                req.client = client
                self._emit(client, api.RequestOutput(request_id=req.request_id,
                                                     token_ids=list(req.output),
                                                     step=self.scheduler.steps))
            return
        end = self.ends.get(msg.request_id, sig)
        if end is not None:  # it ended since the API thread looked
            self._outbox.send([client, *end])
            return
        try:
            self.agent.gate.admit(msg.request_id)
        except CkptError as err:  # policy: not RUNNING (or a duplicate id): typed answer
            self._reject(client, msg.request_id, err)
            return
        except Exception as exc:  # policy: a bug answers this request, typed, and we go on
            log.exception("engine %s: admitting %s failed", self.opts.name, msg.request_id)
            self._reject(client, msg.request_id, OperationError(
                f"engine {self.opts.name} failed to admit the request: {described(exc)}",
                request_id=msg.request_id))
            return
        self._signatures[msg.request_id] = sig
        self.scheduler.add(Request(msg.request_id, list(msg.prompt_token_ids), msg.max_tokens,
                                   msg.stop_token_id, msg.arrival_time, client))

    def _validate(self, msg: api.EngineRequest) -> None:
        cfg = self.model.cfg
        if len(msg.request_id) > api.MAX_REQUEST_ID_CHARS:
            raise UsageError(f"request id longer than {api.MAX_REQUEST_ID_CHARS} characters",
                             request_id=msg.request_id[:64] + "...",
                             max_chars=api.MAX_REQUEST_ID_CHARS)
        if not msg.prompt_token_ids:
            raise UsageError("empty prompt", request_id=msg.request_id)
        bad = [t for t in msg.prompt_token_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise UsageError("token id outside the vocabulary", request_id=msg.request_id,
                             token=bad[0], vocab_size=cfg.vocab_size)
        if msg.max_tokens < 1:
            raise UsageError("max_tokens must be at least 1", request_id=msg.request_id)
        if len(msg.prompt_token_ids) >= cfg.max_seq_len:
            raise UsageError("prompt too long", request_id=msg.request_id,
                             tokens=len(msg.prompt_token_ids), max_seq_len=cfg.max_seq_len)

    def _emit(self, client: bytes, out: api.RequestOutput) -> None:
        frames = api.encode(api.EngineReplyType.OUTPUT.value, out)
        if out.finished:  # kept for a resend (scheduler thread: before the client can see it)
            sig = self._signatures.pop(out.request_id, None)
            if sig is not None:
                self.ends.put(out.request_id, sig, frames)
        self._outbox.send([client, *frames])

    def _reject(self, client: bytes, request_id: str, err: CkptError) -> None:
        rej = api.RequestRejected(request_id=request_id, kind=err.kind, message=err.message,
                                  details={k: v for k, v in err.details.items()
                                           if isinstance(v, (str, int, float, bool, type(None)))})
        self._outbox.send([client, *api.encode(api.EngineReplyType.REJECTED.value, rej)])

    # ---------------------------------------------------------------- agent hooks

    def abort_requests(self, request_ids: list[str]) -> None:
        self._on_scheduler(lambda: self.scheduler.abort(request_ids))

    def keep_requests(self, request_ids: list[str]) -> None:
        self._on_scheduler(lambda: self.scheduler.keep(request_ids))

    def pause_scheduling(self) -> None:
        # runs between two steps: once it returns, no step touches weights or KV cache
        self._on_scheduler(lambda: setattr(self.scheduler, "paused", True))

    def resume_scheduling(self) -> None:
        self._on_scheduler(self.scheduler.resume)

    def _forced_golden(self) -> list[int]:
        """The golden tokens, every one from one cache-free pass over the golden prompt and
        its continuation (``TinyLM.forced_tokens``)."""
        return self.model.forced_tokens(self._golden_seq, GOLDEN_TOKENS)

    def _paged_golden(self) -> list[int] | None:
        """The golden prompt and its continuation through free blocks of the KV pool, a
        prefill then a decode (scheduler thread, or before it starts); ``None`` when too few
        blocks are free to hold it."""
        blocks = self.pool.allocate(self.pool.blocks_for(len(self._golden_seq)))
        if blocks is None:
            return None
        try:
            return self.model.paged_forced(self._golden_seq, self.pool.kv, blocks)
        finally:
            self.pool.free(blocks)

    def verify(self) -> None:
        """The golden prompt, checked against what it gave at start through the KV pool (the
        path requests take); only when that differs (or no block is free for it), the
        cache-free path too, which tells whether the weights or the KV path compute
        otherwise. Each path is one pass or two over the prompt and its greedy continuation
        (teacher forcing), not one per token: a restore waits for this before it serves."""
        paged = self._on_scheduler(self._paged_golden)
        if paged == self.golden_paged:
            return
        if paged is None:  # every block held (cannot happen after a drain): say so, go on
            log.warning("%s: no free KV blocks for the paged golden check", self.opts.name)
        got = self._forced_golden()
        if got != self.golden_forced:
            raise VerificationError("golden prompt gives other tokens after re-wake",
                                    engine=self.opts.name, path="cache-free",
                                    expected=self.golden_forced, got=got)
        if paged is not None:
            raise VerificationError("golden prompt through the KV cache gives other tokens "
                                    "after re-wake", engine=self.opts.name, path="kv_cache",
                                    expected=self.golden_paged, got=paged)


def _signature_of(msg: api.EngineRequest) -> int:
    return signature(msg.prompt_token_ids, msg.max_tokens, msg.stop_token_id, msg.arrival_time)


def serve(opts: EngineOptions, ready: Callable[[dict], None] | None = None,
          notifier=None) -> None:
    """Run an engine until SIGTERM/SIGINT; ``ready(info)`` once both endpoints are bound,
    and ``notifier`` (an ``sdnotify.Notifier``) READY=1 then and STOPPING=1 at the end."""
    from ckpt_controller.procutil import StopSignals

    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    engine = ReferenceEngine(opts).start()
    stop = StopSignals()  # the main thread does the cleanup
    try:
        if opts.prepare_on_startup:  # before the ready line: it says the engine is PREPARED
            from ckpt_controller.protocol import PrepareCommand

            engine.agent.prepare_at_start(PrepareCommand(
                call_id=0, op_id=f"{opts.name}-startup", level=None, tags=["kv_cache"]))
        (ready or (lambda info: print(json.dumps(info), flush=True)))(engine.info())
        if notifier is not None:
            notifier.ready(f"engine {opts.name} serving on {opts.api}",
                           last_round=lambda: engine.agent.last_round,
                           rounds_within=engine.agent.rounds_within)
        stop.wait()
    finally:
        if notifier is not None:
            notifier.stopping()
        engine.stop()
