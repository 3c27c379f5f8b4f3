"""The agent: the engine-side endpoint that owns the engine's lifecycle.

Threads, and what each owns:

- the control thread owns the ROUTER socket: it decodes commands, answers quick ones
  (handshake, status, heartbeat, subscribe) inline, hands operations to an operation thread,
  sends heartbeats to subscribers every ``heartbeat_interval_s``, and forwards every message
  other threads queue on the outbox. It never blocks on an operation, so heartbeats go on
  while a long drain runs: a controller tells a slow agent from a dead one.
- one operation thread at a time runs ``Operations`` (prepare, restore, rollback, fail).
  A different operation while one runs is refused with ``BusyError`` naming the holder; the
  same ``op_id`` again waits for, or returns, the first one's result.

A bad frame is answered with a typed error (or logged and dropped when there is no one to
answer) and the agent keeps serving. Neighbours: ``protocol`` (frames), ``operations``
(steps), ``gate`` (admission), ``client`` (the other end).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from ckpt_controller.agent.endpoints import check_endpoint, check_name, default_endpoint, secure_ipc
from ckpt_controller.agent.engine import EngineHooks, MemoryManager, NoMemory
from ckpt_controller.agent.gate import AdmissionGate
from ckpt_controller.agent.incarnation import IncarnationTracker
from ckpt_controller.agent.operations import Operations
from ckpt_controller.clock import Clock
from ckpt_controller.errors import BusyError, CkptError, OperationError, ProtocolError
from ckpt_controller import protocol as p
from ckpt_controller.lifecycle import Lifecycle, Transition
from ckpt_controller.zmqutil import Outbox

log = logging.getLogger("ckpt_controller.agent")

_OPERATIONS = {
    p.RequestType.PREPARE: "prepare",
    p.RequestType.RESTORE: "restore",
    p.RequestType.ROLLBACK: "rollback",
    p.RequestType.FAIL: "fail",
}
#: results of this many finished operations are kept for repeated op ids
_OP_MEMORY = 256


@dataclass
class _Op:
    op_id: str
    kind: str
    waiters: list[tuple[bytes, int]] = field(default_factory=list)  # (identity, call_id)
    result: p.Result | None = None
    error: CkptError | None = None
    done: bool = False


class Agent:
    """Embed in an engine process: ``Agent(name, hooks=..., memory=...).start()``.

    The engine calls ``agent.gate.admit(id)`` / ``agent.gate.finish(id, reason)`` around every
    request, and ``agent.close()`` (or lets the agent be collected) at exit.
    """

    def __init__(
        self,
        name: str,
        *,
        hooks: EngineHooks | None = None,
        memory: MemoryManager | None = None,
        control: str | None = None,
        clock: Clock | None = None,
        heartbeat_interval_s: float = 0.5,
        retry_after_s: float = 1.0,
        incarnation: IncarnationTracker | None = None,
    ) -> None:
        self.name = check_name(name)
        self.endpoint = check_endpoint(control) if control else default_endpoint(name)
        self.clock = clock or Clock()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lifecycle = Lifecycle(self.clock)
        self.gate = AdmissionGate(self.lifecycle, engine=name, clock=self.clock,
                                  retry_after=lambda: retry_after_s)
        self.memory = memory or NoMemory()
        self.operations = Operations(
            engine_name=name, lifecycle=self.lifecycle, gate=self.gate, memory=self.memory,
            hooks=hooks or EngineHooks(), emit=self.publish, clock=self.clock,
        )
        self.incarnation = incarnation or IncarnationTracker()
        self._ctx = zmq.Context()
        self._outbox: Outbox | None = None
        self._router: zmq.Socket | None = None
        self._subscribers_lock = threading.Lock()
        self._subscribers: set[bytes] = set()
        self._ops: OrderedDict[str, _Op] = OrderedDict()
        self._current: _Op | None = None
        self._ops_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heartbeat_seq = itertools.count(1)
        self.lifecycle.subscribe(self._on_transition)
        self._finalizer = weakref.finalize(self, _close_context, self._ctx)

    # ------------------------------------------------------------------ life of the agent

    def start(self) -> "Agent":
        """Bind the control endpoint and start serving; returns once bound."""
        try:
            self._outbox = Outbox(self._ctx, f"agent-{self.name}")
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, p.HARD_MAX_MESSAGE_BYTES)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._router.bind(self.endpoint)
            if self.endpoint.startswith("tcp://") and self.endpoint.endswith(":0"):
                self.endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            secure_ipc(self.endpoint)
        except (zmq.ZMQError, OSError) as exc:  # policy: a half-built agent closes what it opened
            self.close()
            raise CkptError(f"cannot bind control endpoint: {exc}", endpoint=self.endpoint) from exc
        self._thread = threading.Thread(target=self._serve, name=f"ckpt-agent-{self.name}",
                                        daemon=True)
        self._thread.start()
        log.info("agent %s serving on %s (pid %d)", self.name, self.endpoint, os.getpid())
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._router is not None:
            self._router.close(linger=0)
        if self._outbox is not None:
            self._outbox.close()
        self._router = self._outbox = None
        self._finalizer()

    def __enter__(self) -> "Agent":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ outgoing messages

    def publish(self, body: p.EventBody) -> None:
        """Send an event to every subscriber (callable from any thread)."""
        frames = p.event_frames(body)
        with self._subscribers_lock:
            targets = list(self._subscribers)
        for identity in targets:
            self._send(identity, frames)

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        outbox = self._outbox
        if outbox is not None:
            outbox.send([identity, *frames])

    def _on_transition(self, t: Transition) -> None:
        current = self._current
        self.publish(p.StateChanged(engine=self.name, transition=_record(t),
                                    op_id=current.op_id if current else None))

    # ------------------------------------------------------------------ control thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.inbox, zmq.POLLIN)
        interval_ms = max(1, int(self.heartbeat_interval_s * 1000))
        next_beat = self.clock.monotonic()
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(timeout=min(interval_ms, 100)))
            except zmq.ZMQError:  # policy: socket closed under us means we are stopping
                break
            if self._outbox.inbox in events:
                try:
                    self._outbox.forward(self._router)
                except zmq.ZMQError as exc:  # policy: an undeliverable reply is logged
                    log.warning("agent %s: send failed: %s", self.name, exc)
            if self._router in events:
                while True:
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
            if self.clock.monotonic() >= next_beat:
                next_beat = self.clock.monotonic() + self.heartbeat_interval_s
                self._beat()

    def _beat(self) -> None:
        if self.incarnation.check():
            log.warning("agent %s: process was restored from a checkpoint image "
                        "(incarnation %d)", self.name, self.incarnation.incarnation)
        self.publish(p.Heartbeat(
            engine=self.name, state=self.lifecycle.state.value, seq=next(self._heartbeat_seq),
            monotonic=self.clock.monotonic(), incarnation=self.incarnation.incarnation,
        ))

    def _handle(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        try:
            rtype, cmd = p.decode_command(rest)
        except ProtocolError as err:
            log.warning("agent %s: bad frame from %s: %s", self.name, identity.hex(), err)
            self._reply_error(identity, int(err.details.pop("call_id", 0) or 0), err)
            return
        try:
            if rtype in _OPERATIONS:
                self._start_operation(identity, rtype, cmd)
            else:
                self._reply(identity, cmd.call_id, self._answer(identity, rtype))
        except CkptError as err:  # policy: every refusal is a typed reply
            self._reply_error(identity, cmd.call_id, err)

    def _answer(self, identity: bytes, rtype: p.RequestType) -> p.Result:
        if rtype is p.RequestType.HANDSHAKE:
            return p.HandshakeReply(protocol_version=p.PROTOCOL_VERSION, engine=self.name,
                                    pid=os.getpid(), incarnation=self.incarnation.incarnation,
                                    state=self.lifecycle.state.value,
                                    heartbeat_interval_s=self.heartbeat_interval_s)
        if rtype is p.RequestType.STATUS:
            return self.status()
        if rtype is p.RequestType.HEARTBEAT:
            return p.HeartbeatReply(state=self.lifecycle.state.value, seq=0,
                                    monotonic=self.clock.monotonic())
        with self._subscribers_lock:
            if rtype is p.RequestType.SUBSCRIBE:
                self._subscribers.add(identity)
            else:
                self._subscribers.discard(identity)
        return p.Ack()

    def status(self) -> p.StatusReply:
        history = self.lifecycle.history
        current = self._current
        return p.StatusReply(
            engine=self.name, pid=os.getpid(), state=self.lifecycle.state.value,
            is_restored=self.lifecycle.state.is_restored, generation=self.lifecycle.generation,
            in_flight=len(self.gate.in_flight()), kept=self.gate.kept_count,
            released_tags=list(self.memory.released_tags),
            registered_bytes=self.memory.registered_bytes(),
            incarnation=self.incarnation.incarnation,
            restored_from_image=self.incarnation.restored_from_image,
            current_op=current.op_id if current else None,
            last_transition=_record(history[-1]) if history else None,
        )

    # ------------------------------------------------------------------ operations

    def _start_operation(self, identity: bytes, rtype: p.RequestType, cmd: p.Command) -> None:
        op_id: str = cmd.op_id  # type: ignore[attr-defined]
        kind = _OPERATIONS[rtype]
        with self._ops_lock:
            known = self._ops.get(op_id)
            if known is not None:
                if known.kind != kind:
                    raise BusyError("operation id already used for another operation",
                                    op_id=op_id, kind=known.kind)
                if not known.done:
                    known.waiters.append((identity, cmd.call_id))
                    return
                self._deliver(known, [(identity, cmd.call_id)])
                return
            if self._current is not None:
                raise BusyError(f"engine {self.name} is busy with {self._current.kind}",
                                engine=self.name, holder=self._current.op_id,
                                state=self.lifecycle.state.value)
            op = _Op(op_id, kind, waiters=[(identity, cmd.call_id)])
            self._ops[op_id] = op
            while len(self._ops) > _OP_MEMORY:
                self._ops.popitem(last=False)
            self._current = op
        threading.Thread(target=self._run_operation, args=(op, cmd),
                         name=f"ckpt-op-{self.name}-{kind}", daemon=True).start()

    def _run_operation(self, op: _Op, cmd: p.Command) -> None:
        log.info("agent %s: %s %s starts", self.name, op.kind, op.op_id)
        try:
            op.result = getattr(self.operations, op.kind)(cmd)
        except CkptError as err:
            op.error = err
        except Exception as exc:  # policy: a bug must still answer the caller, typed
            log.exception("agent %s: %s %s crashed", self.name, op.kind, op.op_id)
            op.error = OperationError(f"{op.kind} crashed: {exc!r}", engine=self.name,
                                      state=self.lifecycle.state.value)
        outcome = "ok" if op.error is None else f"{op.error.kind}: {op.error}"
        log.info("agent %s: %s %s ends: %s", self.name, op.kind, op.op_id, outcome)
        with self._ops_lock:
            op.done = True
            self._current = None
            waiters, op.waiters = op.waiters, []
        self._deliver(op, waiters)

    def _deliver(self, op: _Op, waiters: list[tuple[bytes, int]]) -> None:
        for identity, call_id in waiters:
            if op.error is not None:
                self._reply_error(identity, call_id, op.error)
            else:
                self._reply(identity, call_id, op.result)

    def _reply(self, identity: bytes, call_id: int, result: p.Result) -> None:
        self._send(identity, p.reply_frames(call_id, result))

    def _reply_error(self, identity: bytes, call_id: int, err: CkptError) -> None:
        self._send(identity, p.error_frames(call_id, err))


def _record(t: Transition) -> p.TransitionRecord:
    return p.TransitionRecord(trigger=t.trigger.value, source=t.source.value, dest=t.dest.value,
                              generation=t.generation, monotonic=t.monotonic, wall=t.wall,
                              reason=t.reason)


def _close_context(ctx: zmq.Context) -> None:
    ctx.destroy(linger=0)
