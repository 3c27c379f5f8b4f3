"""The agent: the engine-side endpoint that owns the engine's lifecycle.

Threads, and what each owns:

- the control thread (``rpcserver.RpcServer``) owns the ROUTER socket: it answers quick
  requests (handshake, status, heartbeat, subscribe) inline, hands operations to an operation
  thread, and sends heartbeats to subscribers every ``heartbeat_interval_s``. It never blocks
  on an operation, so heartbeats go on while a long drain runs: a controller tells a slow
  agent from a dead one. It also sends an operation's callers the transition that began it
  once the operation has run ``LIVE_HOLD_S`` (its reply lists it; a quick one needs no event).
- one operation thread, started with the first operation and kept for the agent's life,
  runs ``Operations`` (prepare, restore, rollback, fail), one at a time: a thread per
  operation cost more CPU than a no-op operation itself. A different operation while one
  runs is refused with ``BusyError`` naming the holder; the same ``op_id`` again waits for,
  or returns, the first one's result.

A bad frame is answered with a typed error (or logged and dropped when there is no one to
answer; one over the 16 MiB hard limit is dropped by zmq itself, which disconnects its sender
and tells us no more than that) and the agent keeps serving. A burst of requests is answered
as it comes (see ``rpcserver``); the callers of one running operation are bounded
(``_MAX_WAITERS``, then ``OverloadedError``). Neighbours: ``protocol``
(frames), ``operations`` (steps), ``gate`` (admission), ``client`` (the other end).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ckpt_controller import protocol as p
from ckpt_controller.endpoints import check_endpoint, check_name, default_endpoint
from collections.abc import Callable

from ckpt_controller.agent.engine import EngineHooks, ExternalDrain, MemoryManager, NoMemory
from ckpt_controller.agent.failpoints import Failpoints
from ckpt_controller.security import CurveServer
from ckpt_controller.agent.gate import AdmissionGate
from ckpt_controller.agent.incarnation import IncarnationTracker, host_pid
from ckpt_controller.agent.operations import Operations
from ckpt_controller.clock import Clock
from ckpt_controller.errors import (BusyError, CkptError, OperationError, OverloadedError,
                                    described)
from ckpt_controller.lifecycle import Lifecycle, Transition
from ckpt_controller.rpcserver import RpcServer
from ckpt_controller.zmqutil import guarded
from ckpt_controller.vocab import TRANSITIONAL, CheckpointState, EngineApi, RestoreStep, Trigger

log = logging.getLogger("ckpt_controller.agent")

#: the operations, each named after the trigger it fires first (and its ``Operations`` method)
_OPERATIONS = {
    p.RequestType.PREPARE: Trigger.PREPARE,
    p.RequestType.RESTORE: Trigger.RESTORE,
    p.RequestType.ROLLBACK: Trigger.ROLLBACK,
    p.RequestType.FAIL: Trigger.FAIL,
}
#: operations whose successful reply lists their transitions and memory report
#: (``PrepareReply``, ``RestoreReply``): the transition into a settled state that ends one,
#: and its memory report, go to its callers in the reply only, not also as events
_REPLY_LISTS_TRANSITIONS = frozenset({Trigger.PREPARE, Trigger.RESTORE, Trigger.ROLLBACK})
#: a transition that begins an operation (PREPARING, RESTORING) reaches the operation's callers
#: as an event only when the operation still runs this long after it: its reply lists it, and
#: an operation with nothing to wait for ends sooner (one message and wake-up fewer each way)
LIVE_HOLD_S = 0.02
#: results of this many finished operations are kept for repeated op ids
_OP_MEMORY = 256
#: callers one running operation answers at its end; one more is shed (``OverloadedError``)
_MAX_WAITERS = 64


@dataclass
class _Op:
    op_id: str
    kind: Trigger
    waiters: list[tuple[bytes, int]] = field(default_factory=list)  # (identity, call_id)
    result: p.Result | None = None
    error: CkptError | None = None
    done: bool = False
    transitions: list[p.TransitionRecord] = field(default_factory=list)
    #: events its callers were skipped for (``Agent._publish_beside_reply``), who they were,
    #: and when they go to them while it still runs (None: only with an error reply)
    held: list[tuple[p.EventBody, frozenset[bytes], float | None]] = \
        field(default_factory=list)


class Agent(RpcServer):
    """Embed in an engine process: ``Agent(name, hooks=..., memory=...).start()``.

    The engine calls ``agent.gate.admit(id)`` / ``agent.gate.finish(id, reason)`` around every
    request, and ``agent.close()`` (or lets the agent be collected) at exit.
    """

    serves = frozenset({p.RequestType.HANDSHAKE, p.RequestType.STATUS, *_OPERATIONS})

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
        drain: ExternalDrain | None = None,
        engine_pid: int | None = None,
        engine_alive: Callable[[], bool] | None = None,
        request_counts: Callable[[], tuple[int, int]] | None = None,
        failpoints: Failpoints | None = None,
        curve: CurveServer | None = None,
        generation: int = 0,
        endpoints: dict[str, str] | None = None,
        api: EngineApi = EngineApi.EMBEDDED,
        api_detail: str | None = None,
        initial: CheckpointState = CheckpointState.RUNNING,
    ) -> None:
        """``drain``, ``engine_pid``, ``engine_alive`` and ``request_counts`` are for an agent
        that runs beside an engine it does not own (a sidecar): the engine drains itself, its
        PID is not ours (hooks such as ``criu-dump`` need the engine's), heartbeats stop while
        ``engine_alive()`` is false so a controller sees the engine as gone, and
        ``request_counts()`` gives (in flight, kept) for ``status`` instead of the gate's.
        ``generation`` is where the count of completed cycles starts (a sidecar restarted
        beside its engine carries on its predecessor's). ``endpoints`` are the engine's
        other endpoints (``api``, ``http``) that ``status`` reports beside ``control``; the
        engine may add to ``agent.endpoints`` until it starts the agent. ``api`` and
        ``api_detail`` say in ``status`` how the agent drives its engine. ``initial``: the
        state the engine was found in (a vLLM that started prepared is PREPARED)."""
        check_name(name)
        super().__init__(check_endpoint(control) if control else default_endpoint(name),
                         name=name, heartbeat_interval_s=heartbeat_interval_s, clock=clock,
                         curve=curve)
        self.lifecycle = Lifecycle(self.clock, generation=generation, initial=initial)
        self.api, self.api_detail = api, api_detail
        self.gate = AdmissionGate(self.lifecycle, engine=name, clock=self.clock,
                                  retry_after=lambda: retry_after_s)
        self.memory = memory or NoMemory()
        # faults a drill armed through the environment (see failpoints); none normally
        self.failpoints = failpoints if failpoints is not None else Failpoints.from_env()
        self.failpoints.stall = self.stall
        if hasattr(self.memory, "after_refill") and self.failpoints.armed_at(RestoreStep.REWAKE):
            # a MemoryRegistry: the corrupt-weight seam
            self.memory.after_refill = self.failpoints.after_refill
            self.failpoints.corrupt = lambda: self.memory.flip_bit("weights")
        self.operations = Operations(
            engine_name=name, lifecycle=self.lifecycle, gate=self.gate, memory=self.memory,
            hooks=hooks or EngineHooks(), emit=self._emit, clock=self.clock, drain=drain,
            failpoints=self.failpoints,
        )
        #: our own PID (not a sidecar's engine): the host's, read again after a restore
        self._own_pid = engine_pid is None
        self.engine_pid = engine_pid or host_pid()
        self.endpoints: dict[str, str] = dict(endpoints or {})
        self.engine_alive = engine_alive
        self.request_counts = request_counts
        self.incarnation = incarnation or IncarnationTracker()
        self._ops: OrderedDict[str, _Op] = OrderedDict()
        self._current: _Op | None = None
        self._ops_lock = threading.Lock()
        # the operation thread's jobs: one at most, since one operation runs at a time (it
        # is taken before the next may start; ``_start_operation`` checks); None stops the
        # thread. A SimpleQueue: a ``Queue``'s Python condition cost more than the op
        self._jobs: queue.SimpleQueue[tuple[_Op, p.Command] | None] = queue.SimpleQueue()
        self._op_thread: threading.Thread | None = None
        # the operation started in this round of the control thread, handed over when the
        # round ends (``before_wait``): woken while the control thread still ran Python, the
        # operation thread only fought it for the GIL (about a tenth of a no-op's CPU)
        self._handoff: tuple[_Op, p.Command] | None = None
        #: when the earliest event held live for the running operation's callers is due
        #: (``_publish_beside_reply``); None: none held
        self._live_due: float | None = None
        self.lifecycle.subscribe(self._on_transition)

    def _on_transition(self, t: Transition) -> None:
        current = self._current
        record = p.TransitionRecord.of(t)
        event = p.StateChanged(engine=self.name, transition=record,
                               op_id=current.op_id if current else None)
        if current is None:
            self.publish(event)
            return
        current.transitions.append(record)
        if record.dest not in TRANSITIONAL:
            # the transition that ends the operation: its reply, sent next, lists it
            self._publish_beside_reply(current, event)
        else:  # the one that begins it: to its callers too, if it runs on for a while
            self._publish_beside_reply(current, event, live=True)

    def _emit(self, body: p.EventBody) -> None:
        """An operation's events: a memory report goes in its reply as well; any other
        (drain progress) to every subscriber, after what is held live for the callers."""
        current = self._current
        if current is not None and isinstance(body, p.MemoryReported):
            self._publish_beside_reply(current, body)
        else:
            if current is not None:
                self._send_live(current, float("inf"))
            self.publish(body)

    def _publish_beside_reply(self, op: _Op, event: p.EventBody, live: bool = False) -> None:
        """An event whose content the operation's successful reply carries (its
        transitions, its memory report): sent to every subscriber but the operation's callers,
        and held for them in case the reply is an error, which carries none. ``live`` (a
        transition that begins it): sent to them as well once the operation still runs
        ``LIVE_HOLD_S`` later (the control thread sees to it, ``_send_live``)."""
        if op.kind not in _REPLY_LISTS_TRANSITIONS:
            self.publish(event)
            return
        due = time.monotonic() + LIVE_HOLD_S if live else None
        unwatched = False
        with self._ops_lock:
            callers = frozenset(identity for identity, _ in op.waiters)
            op.held.append((event, callers, due))
            if due is not None and self._live_due is None:
                self._live_due, unwatched = due, True
        self.publish(event, skip=callers)
        if unwatched:  # the control thread set no time to look, and may wait long
            self._wake()

    def _send_live(self, op: _Op, now: float) -> None:
        """Send the callers of the running ``op`` the events held live for them that are
        due by ``now``, in order (taken under the lock: the operation's end, which drops or
        sends what is held, never sends one of them again)."""
        with self._ops_lock:
            if op.done:
                return
            due = [h for h in op.held if h[2] is not None and h[2] <= now]
            op.held = [h for h in op.held if h[2] is None or h[2] > now]
            self._live_due = min((h[2] for h in op.held if h[2] is not None), default=None)
            if not due:
                return
        for event, callers, _ in due:
            self.publish(event, only=callers)

    # ------------------------------------------------------------------ control thread

    def on_tick(self) -> None:
        if self.incarnation.check():
            if self._own_pid:  # restored from an image: the host gave us another PID
                self.engine_pid = host_pid()
            log.warning("agent %s: process was restored from a checkpoint image "
                        "(incarnation %d)", self.name, self.incarnation.incarnation)

    def heartbeat_body(self, seq: int) -> p.Heartbeat | None:
        if self.engine_alive is not None and not self.engine_alive():
            return None  # silence: a controller must see a dead engine as gone, not slow
        return p.Heartbeat(engine=self.name, state=self.lifecycle.state, seq=seq,
                           monotonic=self.clock.monotonic(),
                           incarnation=self.incarnation.incarnation)

    def handle(self, identity: bytes, rtype: p.RequestType, cmd: p.Command) -> None:
        if rtype in _OPERATIONS:  # their replies carry no incarnation: the tick's check does
            self._start_operation(identity, rtype, cmd)
            return
        self.on_tick()  # the first handshake or status after a restore already knows it
        if rtype is p.RequestType.HANDSHAKE:
            self.reply(identity, cmd.call_id, p.HandshakeReply(
                protocol_version=p.PROTOCOL_VERSION, engine=self.name, pid=self.engine_pid,
                incarnation=self.incarnation.incarnation, state=self.lifecycle.state,
                heartbeat_interval_s=self.heartbeat_interval_s))
        else:
            self.reply(identity, cmd.call_id, self.status())

    def status(self) -> p.StatusReply:
        history = self.lifecycle.history
        current = self._current
        in_flight, kept = (self.request_counts() if self.request_counts is not None
                           else (len(self.gate.in_flight()), self.gate.kept_count))
        return p.StatusReply(
            engine=self.name, pid=self.engine_pid, state=self.lifecycle.state,
            is_restored=self.lifecycle.state.is_restored, generation=self.lifecycle.generation,
            in_flight=in_flight, kept=kept,
            released_tags=list(self.memory.released_tags),
            registered_bytes=self.memory.registered_bytes(),
            incarnation=self.incarnation.incarnation,
            restored_from_image=self.incarnation.restored_from_image,
            current_op=current.op_id if current else None,
            last_transition=p.TransitionRecord.of(history[-1]) if history else None,
            endpoints={**self.endpoints, "control": self.endpoint},
            reload_files=self.memory.reload_files(),
            api=self.api, api_detail=self.api_detail,
            released_level=getattr(self.memory, "released_level", None),
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
                    if len(known.waiters) >= _MAX_WAITERS:
                        raise OverloadedError(
                            f"{_MAX_WAITERS} callers already wait for operation {op_id}",
                            engine=self.name, op_id=op_id, retry_after_s=1.0)
                    known.waiters.append((identity, cmd.call_id))
                    return
                self._deliver(known, [(identity, cmd.call_id)])
                return
            if self._current is not None:
                raise BusyError(f"engine {self.name} is busy with {self._current.kind}",
                                engine=self.name, holder=self._current.op_id,
                                state=self.lifecycle.state.value)
            if self._jobs.qsize():  # the previous job was never taken: the thread died
                raise OperationError("the agent's operation thread is not running",
                                     engine=self.name, op_id=op_id)
            op = _Op(op_id, kind, waiters=[(identity, cmd.call_id)])
            self._ops[op_id] = op
            while len(self._ops) > _OP_MEMORY:
                self._ops.popitem(last=False)
            self._current = op
        self._handoff = (op, cmd)  # one at most: the next operation is busy until it ends

    def prepare_at_start(self, cmd: p.PrepareCommand) -> p.PrepareReply:
        """A prepare the engine runs itself before it serves (``--prepare-on-startup``: it
        starts PREPARED, as vLLM's ``--checkpoint-prepare-on-startup``), on the calling
        thread; an operation asked meanwhile is refused as busy, as any other would be."""
        op = _Op(cmd.op_id, Trigger.PREPARE)
        with self._ops_lock:
            if self._current is not None:
                raise BusyError(f"engine {self.name} is busy with {self._current.kind}",
                                engine=self.name, holder=self._current.op_id)
            self._current = op
        try:
            return self.operations.prepare(cmd)
        finally:
            with self._ops_lock:
                self._current = None

    def wake_by(self) -> float | None:
        return self._live_due if self._current is not None else None

    def before_wait(self) -> None:
        current = self._current
        if current is not None and self._live_due is not None:
            self._send_live(current, time.monotonic())
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            return
        with self._ops_lock:  # the transition that begins it is due about then: look then
            if self._live_due is None:
                self._live_due = time.monotonic() + LIVE_HOLD_S
        self._jobs.put(handoff)
        if self._op_thread is None:  # only the control thread starts operations
            name = f"ckpt-op-{self.name}"
            self._op_thread = threading.Thread(
                target=guarded(self._operation_loop, name, on_death=self._thread_died,
                               stopping=self._stop.is_set), name=name, daemon=True)
            self._op_thread.start()

    def close(self) -> None:
        """Stop serving; the operation thread ends after the operation it runs, if any (a
        daemon thread: close never waits for an operation)."""
        super().close()
        if self._op_thread is not None:
            self._jobs.put(None)
            self._op_thread = None

    def _operation_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run_operation(*job)

    def _run_operation(self, op: _Op, cmd: p.Command) -> None:
        log.debug("agent %s: %s %s starts", self.name, op.kind, op.op_id)
        try:
            op.result = getattr(self.operations, op.kind)(cmd)
        except CkptError as err:
            op.error = err
        except Exception as exc:  # policy: a bug must still answer the caller, typed
            log.exception("agent %s: %s %s crashed", self.name, op.kind, op.op_id)
            op.error = OperationError(f"{op.kind} crashed: {described(exc)}", engine=self.name,
                                      state=self.lifecycle.state.value)
        self.failpoints.operation_ended()
        if isinstance(op.result, (p.PrepareReply, p.RestoreReply)):
            op.result.transitions = list(op.transitions)
        # a failure is worth a line in the engine's log; a success is in the controller's
        # journal, and an INFO line for it cost a no-op operation as much as its own work
        if op.error is None:
            log.debug("agent %s: %s %s ends: ok", self.name, op.kind, op.op_id)
        else:
            log.warning("agent %s: %s %s ends: %s: %s", self.name, op.kind, op.op_id,
                        op.error.kind, op.error)
        with self._ops_lock:
            op.done = True
            self._current = None
            self._live_due = None
            waiters, op.waiters = op.waiters, []
            held, op.held = op.held, []
        if op.error is not None:
            # an error reply carries no transitions or memory report: the callers that were
            # skipped get those events after all, before the reply
            for event, callers, _ in held:
                self.publish(event, only=callers)
        self._deliver(op, waiters)

    def _deliver(self, op: _Op, waiters: list[tuple[bytes, int]]) -> None:
        for identity, call_id in waiters:
            if op.error is not None:
                self.reply_error(identity, call_id, op.error)
            else:
                self.reply(identity, call_id, op.result)

