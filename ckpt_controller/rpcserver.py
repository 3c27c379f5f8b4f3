"""The server half of the wire protocol, shared by the agent and the controller.

One control thread owns the ROUTER socket: it decodes requests and calls ``handle`` (which must
not block: long work goes to other threads, which answer through ``reply``), forwards what any
thread queued on the outbox, serves subscribe/unsubscribe and heartbeat requests, and every
``heartbeat_interval_s`` calls ``on_tick`` and sends a ``Heartbeat`` event to subscribers. A bad
frame is answered with a typed error (or dropped by zmq when over the hard size limit) and the
server keeps serving.

Under a burst the control thread never blocks on itself and no queue grows without bound:

- what it sends itself (answers, heartbeats) goes straight to the ROUTER, non-blocking; other
  threads go through the bounded ``Outbox`` (see ``zmqutil``);
- each poll round reads at most ``READ_BUDGET`` requests (the ROUTER takes them from its peers
  in turn), so answers, events and heartbeats interleave with any flood, and a new client is
  answered after at most one request of each other peer;
- a peer that does not read its answers loses those beyond the ROUTER's ``SNDHWM``, and one
  silent for ``PEER_SILENCE_S`` (it does not answer zmq's own heartbeats: stopped, hung, or
  no longer reading) is disconnected and what was queued for it freed;
- at most ``MAX_SUBSCRIBERS`` peers subscribe at once (each event is one message per
  subscriber); one more is refused with the retryable ``OverloadedError``, and a subscriber
  whose queue is full (it stopped reading) is let go, said in the log;
- slow work (``offload``) runs on ``WORKER_THREADS`` threads from a queue of
  ``WORKER_QUEUE`` jobs; when it is full the request is shed at once with the typed,
  retryable ``OverloadedError`` (nothing of it ran).

If the control thread (or a worker) dies of a bug, ``on_thread_death`` runs: by default the
process exits with status 70 (``zmqutil.exit_on_thread_death``) rather than live on
unreachable. Neighbours: ``protocol`` (frames), ``zmqutil`` (outbox, thread guard);
subclasses ``agent.server.Agent`` and ``controller.server.ControllerServer``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable

import zmq

from ckpt_controller import protocol as p
from ckpt_controller.endpoints import cannot_bind, remove_stale_ipc, secure_ipc
from ckpt_controller.clock import Clock
from ckpt_controller.errors import (CkptError, EngineError, OperationError, OverloadedError,
                                    ProtocolError, described)
from ckpt_controller.security import CurveServer, ZapHandler, log_handshake_failures
from ckpt_controller.zmqutil import (DeathHook, Outbox, exit_on_thread_death, guarded,
                                     monitor_socket, more_to_read, recv_monitor_event,
                                     room_for_connections)

log = logging.getLogger("ckpt_controller.rpc")

#: requests the control thread reads per poll round before it forwards, beats and polls again
READ_BUDGET = 256
#: messages queued towards one peer before what follows for it is dropped
PEER_SNDHWM = 100_000
#: a peer that sends nothing, not even zmq's own answers to the heartbeats zmq sends it
#: every ``PEER_PING_S``, for this long is disconnected and what was queued for it freed: a
#: stopped or hung process, or a subscriber that stopped reading (once its receive queue is
#: full its zmq reads nothing more, answers included). zmq bounds a peer's queue in messages
#: (``PEER_SNDHWM``), and a gathered event can be megabytes: this bounds it in time
PEER_SILENCE_S = 30.0
PEER_PING_S = 5.0
#: a gathered event (``publish_gathered``) is split into events of at most about this size
#: (clients take messages up to ``protocol.HARD_MAX_MESSAGE_BYTES``)
GATHERED_BYTES = 4 << 20
#: threads that run offloaded (slow) requests, and the jobs that may wait for one
WORKER_THREADS = 4
WORKER_QUEUE = 64
#: the longest the control thread waits with nothing to do (it wakes for each heartbeat, and
#: at once to stop or stall: nothing else is timed): how old ``last_round`` gets, unless a
#: watchdog asks for less (``rounds_within``). Each idle round costs CPU: at 0.25 s, rounds
#: were half an idle agent's CPU
IDLE_ROUND_S = 1.0
#: peers subscribed at once, at most (``watch``, ``status -w``, progress of a command)
MAX_SUBSCRIBERS = 256
#: the hint an ``OverloadedError`` carries
OVERLOAD_RETRY_AFTER_S = 0.5


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
        #: the longest idle wait (``IDLE_ROUND_S``, or less: ``rounds_within``)
        self._idle_cap = IDLE_ROUND_S
        #: ``time.monotonic()`` when the control thread last began a round (0.0: never): a
        #: liveness signal for a watchdog (``sdnotify``); a hung or stalled thread stops it
        self.last_round = 0.0
        self._workers: _Workers | None = None
        #: called as ``hook(thread_name, exc)`` when the control thread or a worker dies of
        #: a bug; None: ``zmqutil.exit_on_thread_death`` (the process exits with status 70).
        #: In-process servers that must not end their process (tests) set their own.
        self.on_thread_death: DeathHook | None = None
        self._finalizer = weakref.finalize(self, _close_context, self._ctx)

    # ------------------------------------------------------------------ life

    def bind(self) -> None:
        """Bind the endpoint without serving yet: what arrives waits in the socket until
        ``start``. A server that must check its endpoint before it touches anything (the
        controller, before it recovers) binds first. The process's soft open-files limit is
        raised to its hard one first (``room_for_connections``)."""
        room_for_connections()
        try:
            self._outbox = Outbox(self._ctx, self.name)
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, p.HARD_MAX_MESSAGE_BYTES)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # a message for a peer that left fails at once instead of queueing forever: that
            # is how subscribers that went away are forgotten
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.SNDHWM, PEER_SNDHWM)
            self._router.setsockopt(zmq.HEARTBEAT_IVL, int(PEER_PING_S * 1000))
            self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(PEER_SILENCE_S * 1000))
            if self.curve is not None:  # the handler first: without one, libzmq admits anyone
                self._zap = ZapHandler(self._ctx, self.curve, self.name)
                self.curve.apply(self._router)
                self._monitor = monitor_socket(self._router,
                                               zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
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
            raise cannot_bind(self.endpoint, exc) from exc

    def start(self):
        """Bind the endpoint (unless ``bind`` did) and start serving; returns once bound."""
        if self._router is None:
            self.bind()
        name = f"rpc-{self.name}"
        self._thread = threading.Thread(
            target=guarded(self._serve, name, on_death=self._thread_died,
                           stopping=self._stop.is_set), name=name, daemon=True)
        self._thread.start()
        log.info("%s serving on %s (pid %d)", self.name, self.endpoint, os.getpid())
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake()  # the control thread may be waiting up to ``IDLE_ROUND_S``
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._workers is not None:
            self._workers.close()
            self._workers = None
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
        if self._finalizer.alive:  # the first close: the context ends, then the file goes
            self._finalizer()
            remove_stale_ipc(self.endpoint)  # zmq leaves an ipc socket's file behind

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sending (any thread)

    def publish(self, body: p.EventBody, *, skip: frozenset[bytes] = frozenset(),
                only: frozenset[bytes] | None = None) -> None:
        """Send an event to every subscriber (encoded once; not at all when there is none),
        but those in ``skip``; with ``only``, to those of them that subscribed."""
        with self._subscribers_lock:
            if not self._subscribers:
                return
            targets = [i for i in (self._subscribers if only is None
                                   else self._subscribers & only) if i not in skip]
        if not targets:
            return
        frames = p.event_frames(body)
        for identity in targets:
            self.send(identity, frames)

    def publish_gathered(self, items: list,
                         body_of: Callable[[list], p.EventBody]) -> None:
        """``publish(body_of(items))``, except that items published one after another from
        another thread, with nothing else sent in between, go out together: ``body_of``
        makes one event of a run (encoded once, one message per subscriber). Those
        subscribed when the control thread sends it get it; nothing is made when there are
        none. The caller gives the list away."""
        if not self._subscribers:  # a look without the lock: at worst one more run gathered
            return
        outbox = self._outbox
        if outbox is not None:
            outbox.gather(body_of, items, functools.partial(self._gathered, body_of))

    def _gathered(self, body_of: Callable[[list], p.EventBody],
                  items: list) -> list[list[bytes]]:
        """The messages for ``items``: one event per run that fits ``GATHERED_BYTES``
        (halved until it does: one item alone goes as it is), to every subscriber."""
        with self._subscribers_lock:
            targets = list(self._subscribers)
        if not targets:
            return []
        out: list[list[bytes]] = []
        runs = [items]
        while runs:
            run = runs.pop(0)
            frames = p.event_frames(body_of(run))
            if len(run) > 1 and len(frames[1]) > GATHERED_BYTES:
                half = len(run) // 2
                runs[:0] = [run[:half], run[half:]]
                continue
            out.extend([identity, *frames] for identity in targets)
        return out

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        outbox = self._outbox
        if outbox is not None:
            outbox.send([identity, *frames])

    def reply(self, identity: bytes, call_id: int, result: p.Result) -> None:
        self.send(identity, p.reply_frames(call_id, result))

    def reply_error(self, identity: bytes, call_id: int, err: CkptError) -> None:
        self.send(identity, p.error_frames(call_id, err))

    def offload(self, identity: bytes, call_id: int, what: str,
                job: Callable[[], p.Result]) -> None:
        """From ``handle``: run ``job`` on a worker thread and answer with its result (or its
        typed error). Raises ``OverloadedError`` at once when ``WORKER_QUEUE`` jobs already
        wait: the dispatcher sends it back and the control thread goes on."""
        if self._workers is None:
            self._workers = _Workers(self.name, self._worker_died)

        def run() -> None:
            try:
                self.reply(identity, call_id, job())
            except CkptError as err:  # policy: answered, typed
                self.reply_error(identity, call_id, err)
            except Exception as exc:  # policy: a bug answers this request, typed, and we go on
                log.exception("%s: %s failed", self.name, what)
                self.reply_error(identity, call_id, OperationError(
                    f"{self.name} failed to handle {what}: {described(exc)}", request=what))

        self._workers.submit(run, what)

    def rounds_within(self, seconds: float) -> None:
        """Begin a round at least every ``seconds``, idle or not (a watchdog that pings only
        while ``last_round`` is younger than its period asks for half of it); from any
        thread, at once."""
        self._idle_cap = max(0.001, min(self._idle_cap, seconds))
        self._wake()

    def stall(self, seconds: float) -> None:
        """Stop the control thread for ``seconds``: no heartbeats, no answers (a fault a
        drill injects; requests queue in the socket meanwhile)."""
        self._stalled_until = time.monotonic() + seconds
        self._wake()

    def _wake(self) -> None:
        """End the control thread's wait now (from any thread)."""
        outbox = self._outbox
        if outbox is not None:
            outbox.wake()

    # ------------------------------------------------------------------ to override

    def handle(self, identity: bytes, rtype: p.RequestType, cmd: p.Command) -> None:
        """Answer ``cmd`` (now, or later from another thread) with ``reply``/``reply_error``,
        or raise a ``CkptError`` to have it sent back. Must not block the control thread."""
        raise NotImplementedError

    def on_tick(self) -> None:
        """Runs on the control thread every heartbeat interval, before the heartbeat."""

    def before_wait(self) -> None:
        """Runs on the control thread after each round, just before it waits for the next:
        the place to wake another thread, which then finds the GIL about to be free."""

    def wake_by(self) -> float | None:
        """The ``time.monotonic()`` by which the control thread must begin its next round
        (to run ``before_wait`` then), or None; asked after ``before_wait``. Another thread
        that sets an earlier one calls ``_wake``."""
        return None

    def heartbeat_body(self, seq: int) -> p.Heartbeat | None:
        """The heartbeat to publish, or None to stay silent this interval."""
        return p.Heartbeat(engine=self.name, state="serving", seq=seq,
                           monotonic=self.clock.monotonic(), incarnation=0)

    # ------------------------------------------------------------------ control thread

    def _thread_died(self, thread_name: str, exc: BaseException) -> None:
        (self.on_thread_death or exit_on_thread_death)(thread_name, exc)

    def _worker_died(self, thread_name: str, exc: BaseException) -> None:
        if not self._stop.is_set():
            self._thread_died(thread_name, exc)

    def _serve(self) -> None:
        self._outbox.own(self._router, self._forget)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.inbox, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.socket, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
        next_beat = self.clock.monotonic()
        while not self._stop.is_set():
            self.before_wait()
            if time.monotonic() < self._stalled_until:
                time.sleep(min(0.1, self._stalled_until - time.monotonic()))
                continue
            self.last_round = time.monotonic()
            try:
                wait_s = min(self._idle_cap, next_beat - self.clock.monotonic())
                due = self.wake_by()
                if due is not None:
                    wait_s = min(wait_s, due - time.monotonic())
                events = dict(poller.poll(timeout=max(1, math.ceil(wait_s * 1000))))
            except zmq.ZMQError:  # policy: socket closed under us means we are stopping
                break
            if self._zap is not None and self._zap.socket in events:
                self._zap.handle()
            if self._monitor is not None and self._monitor in events:
                log_handshake_failures(recv_monitor_event(self._monitor), self.name,
                                       self._zap.log)
            if self._outbox.inbox in events or self._outbox.lazy_pending():
                self._outbox.forward()
            if self._router in events:
                for _ in range(READ_BUDGET):  # the rest waits for the next round
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:  # policy: nothing after all: back to polling
                        break
                    self._dispatch(frames)
                    if not more_to_read(self._router):
                        break
            if self.clock.monotonic() >= next_beat:
                next_beat = self.clock.monotonic() + self.heartbeat_interval_s
                self.on_tick()
                beat = self.heartbeat_body(next(self._heartbeat_seq))
                if beat is not None:  # None: the server knows it must not look alive
                    self.publish(beat)

    def _forget(self, identity: bytes) -> None:
        """A message to ``identity`` could not be queued: it is gone, or its queue is full
        (``PEER_SNDHWM`` messages it did not read): as a subscriber it is let go."""
        with self._subscribers_lock:
            if identity in self._subscribers:
                self._subscribers.discard(identity)
                log.info("%s: subscriber %s is gone (or %d messages behind: let go)",
                         self.name, identity.hex(), PEER_SNDHWM)

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
                    if rtype is p.RequestType.UNSUBSCRIBE:
                        self._subscribers.discard(identity)
                    elif (identity not in self._subscribers
                          and len(self._subscribers) >= MAX_SUBSCRIBERS):
                        raise OverloadedError(
                            f"{self.name} has {MAX_SUBSCRIBERS} subscribers already (watch, "
                            "progress of commands); try again later",
                            max_subscribers=MAX_SUBSCRIBERS,
                            retry_after_s=OVERLOAD_RETRY_AFTER_S)
                    else:
                        self._subscribers.add(identity)
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
                f"{self.name} failed to handle {rtype.name}: {described(exc)}", request=rtype.name))


class _Workers:
    """``WORKER_THREADS`` threads taking jobs from a queue of at most ``WORKER_QUEUE``: when
    it is full, ``submit`` raises ``OverloadedError`` at once (its caller never waits)."""

    def __init__(self, name: str, on_death: DeathHook) -> None:
        self.name = name
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=WORKER_QUEUE)
        self._threads = []
        for n in range(WORKER_THREADS):
            tname = f"rpc-{name}-worker{n}"
            t = threading.Thread(target=guarded(self._run, tname, on_death=on_death),
                                 name=tname, daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, job: Callable[[], None], what: str) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            # policy: shed, typed and retryable; the queue never grows past its bound
            raise OverloadedError(
                f"{self.name} is overloaded: {WORKER_QUEUE} requests already wait for its "
                f"{WORKER_THREADS} workers", server=self.name, request=what,
                retry_after_s=OVERLOAD_RETRY_AFTER_S) from None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def close(self) -> None:
        for _ in self._threads:  # one stop mark each; jobs still queued are dropped
            try:
                self._jobs.put(None, timeout=1)
            except queue.Full:  # policy: a stuck worker is a daemon thread; leave it
                break


def _close_context(ctx: zmq.Context) -> None:
    ctx.destroy(linger=0)
