"""One socket, one owner thread, many senders: the outbox pattern used by every server here.

A zmq socket must only be used by the thread that owns it. Other threads that need to send
(an operation thread replying, a scheduler streaming tokens) put their frames in an
``Outbox``: a bounded queue under a lock, plus a wake-up over inproc (PUSH to a PULL socket
that the owner thread polls next to its main socket, then forwards from the queue). Only
the message that finds the queue idle sends a wake-up; the ones behind it ride on it, so a
burst (an operation's events and its answer) costs the owner one wake-up and no inproc copy
per message (a message each through inproc cost more CPU than a no-op operation's own work).

A control thread never blocks on itself: once the owner called ``own(sock)``, what it sends
itself goes straight to ``sock``, non-blocking, never through the outbox it alone drains.
Every queue is bounded: the outbox holds at most ``OUTBOX_HWM`` messages; a
sender from another thread waits at most ``OUTBOX_SEND_TIMEOUT_S`` for room (its own wait: the
lock is held for one non-blocking try at a time, so senders never wait out each other's
timeouts in turn), then the message is dropped and logged (the owner took nothing for that long: it is stuck or gone). A message
the main socket cannot take (the peer left, or its own queue is full) is dropped too, and
``on_gone`` names the peer.

``guarded`` wraps the target of a socket-owning thread: if it dies of an unexpected exception,
the process must not live on looking healthy (an agent heartbeating RUNNING while its request
API is dead). The default policy, ``exit_on_thread_death``, logs and ends the process with
exit status ``THREAD_DEATH_EXIT`` (70, EX_SOFTWARE) so supervision sees it and restarts it;
an embedder that must not exit (an in-process test server) passes its own hook.
``monitor_socket`` and ``recv_monitor_event`` watch a socket's connection events.
``room_for_connections`` raises the process's soft open-files limit to its hard one before a
server binds: libzmq aborts the whole process when its ipc listener cannot accept a
connection for want of a descriptor.
Neighbours: ``rpcserver`` (agent, controller) and ``engine.server`` own such sockets.
"""

from __future__ import annotations

import logging
import os
import resource
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

import zmq

log = logging.getLogger("ckpt_controller.rpc")

#: messages the outbox holds before a sender must wait
OUTBOX_HWM = 10_000
#: how long a sender from another thread waits for room before its message is dropped
OUTBOX_SEND_TIMEOUT_S = 5.0
#: messages ``forward`` moves per call, so the owner's other work gets its turn
FORWARD_BUDGET = 1_000
#: exit status of a process whose socket-owning thread died of a bug (EX_SOFTWARE)
THREAD_DEATH_EXIT = 70

#: flags as plain ints: pyzmq's are ``enum.Flag`` members, and ``|`` on those (which
#: ``send_multipart`` does for each frame) costs more than the send
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_RCVMORE = int(zmq.RCVMORE)

#: ``hook(thread_name, exception)``, called when a guarded thread dies unexpectedly
DeathHook = Callable[[str, BaseException], None]


#: items one gathered entry holds at most (``Outbox.gather``): a longer run starts another
GATHER_MAX = 1024


class _Gathered:
    """Items queued together (``Outbox.gather``), made into messages by the owner."""

    __slots__ = ("key", "items", "make")

    def __init__(self, key: object, items: list,
                 make: Callable[[list], list[list[bytes]]]) -> None:
        self.key, self.items, self.make = key, items, make


class Outbox:
    """Thread-safe sending towards a socket owned by another thread.

    The owner calls ``own(sock)`` on its own thread, polls ``inbox`` and calls ``forward()``;
    ``send(frames)`` from any thread (from the owner: straight to ``sock``); ``gather`` for
    items that may go out together, in one message per peer, when they come in a burst.
    """

    def __init__(self, ctx: zmq.Context, name: str, *, hwm: int = OUTBOX_HWM,
                 send_timeout_s: float = OUTBOX_SEND_TIMEOUT_S) -> None:
        addr = f"inproc://outbox-{name}-{id(self)}"
        self.name = name
        #: readable when messages wait: the owner polls it, then calls ``forward``
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(addr)
        self._wake = ctx.socket(zmq.PUSH)  # used under the lock only
        self._wake.connect(addr)
        self._hwm = hwm
        self._queue: deque[list[bytes] | _Gathered] = deque()
        self._woken = False  # a wake-up is on its way and the owner has not taken the queue
        #: the owner forwards within a short wait of its own (``set_lazy``): gathered items
        #: need not wake it
        self._lazy = False
        self._send_timeout_s = send_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._owner: int | None = None
        self._sock: zmq.Socket | None = None
        self._on_gone: Callable[[bytes], None] | None = None
        #: messages dropped because the owner took none for ``send_timeout_s``
        self.dropped = 0

    def own(self, sock: zmq.Socket, on_gone: Callable[[bytes], None] | None = None) -> None:
        """Called on the owner thread: from now on, its own ``send`` goes straight to ``sock``.

        With a ROUTER set to ``ROUTER_MANDATORY``, a message for a peer that is gone (or whose
        queue is full) is dropped and ``on_gone(identity)`` called instead of blocking."""
        self._sock, self._on_gone = sock, on_gone
        self._owner = threading.get_ident()

    def send(self, frames: list[bytes]) -> bool:
        """Send ``frames`` towards the owned socket; False when they were dropped. The caller
        gives the list away (it is queued as it is, not copied)."""
        if self._owner == threading.get_ident():
            return self._deliver(frames)
        deadline = None
        pause = 0.001
        while True:
            with self._lock:  # held for one try: senders never wait out each other in turn
                if self._closed:
                    return False
                if len(self._queue) < self._hwm:
                    self._queue.append(frames)
                    if not self._woken:  # the first behind an idle queue wakes the owner
                        self._woken = True
                        self._wake.send(b"", zmq.NOBLOCK)  # one in flight at most: no HWM
                    return True
                # full: try again until this sender's deadline
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._send_timeout_s
                elif now >= deadline:
                    # the owner took nothing for the whole timeout (stuck or gone): drop and
                    # say so, the sender goes on. A request resent with the same id is answered
                    self.dropped += 1
                    log.warning("%s: outbox full for %.1fs, message dropped (%d so far)",
                                self.name, self._send_timeout_s, self.dropped)
                    return False
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)

    def wake(self) -> None:
        """Make the owner's poll of ``inbox`` return (from any thread), with or without
        anything queued: a sign to look at its own state (stop, stall)."""
        with self._lock:
            if not self._closed and not self._woken:
                self._woken = True
                self._wake.send(b"", zmq.NOBLOCK)

    def gather(self, key: object, items: list,
               make: Callable[[list], list[list[bytes]]]) -> bool:
        """Queue ``items``; the owner sends ``make(run)`` (whole messages) for them together
        with the items gathered under the same ``key`` right before them, with nothing else
        queued in between (a run of at most about ``GATHER_MAX``). Order is kept: what was
        queued before goes first, what comes after goes after. From the owner itself,
        ``make(items)`` goes at once. False when dropped (closed, or the queue stayed full,
        as ``send``). The caller gives the list away."""
        if self._owner == threading.get_ident():
            return all([self._deliver(frames) for frames in make(items)])
        with self._lock:
            if self._closed:
                return False
            tail = self._queue[-1] if self._queue else None
            if type(tail) is _Gathered and tail.key == key and len(tail.items) < GATHER_MAX:
                tail.items.extend(items)  # the owner has not taken it: it is still queued
                return True
            if self._lazy and len(self._queue) < self._hwm:  # no wake-up: it looks soon
                self._queue.append(_Gathered(key, items, make))
                return True
        return self.send(_Gathered(key, items, make))  # type: ignore[arg-type]

    def set_lazy(self, on: bool) -> None:
        """On the owner thread: while on, gathered items do not wake the owner, which
        promises to begin a round (``lazy_pending``, then ``forward``) within a short wait
        of its own; they go with the next message that does wake it, or then. Turned off,
        anything so queued wakes it at once."""
        with self._lock:
            self._lazy = on
            if not on and self._queue and not self._woken and not self._closed:
                self._woken = True
                self._wake.send(b"", zmq.NOBLOCK)

    def lazy_pending(self) -> bool:
        """Whether gathered items may wait unannounced (``set_lazy``): ``forward`` now."""
        return self._lazy and bool(self._queue)

    def forward(self, limit: int = FORWARD_BUDGET) -> int:
        """On the owner thread: send up to ``limit`` queued messages; returns how many went
        (or were dropped as undeliverable). With more queued, it wakes itself for the next
        round."""
        # the wake-up first: what a sender queues after the lock below wakes the owner anew.
        # One per call (the owner polled it readable); one more left behind by a race only
        # makes the next poll round return at once.
        try:
            self.inbox.recv(_NOBLOCK)
        except zmq.Again:  # policy: called without a wake-up: the queue says what there is
            pass
        with self._lock:
            if self._closed:
                return 0
            batch = [self._queue.popleft() for _ in range(min(limit, len(self._queue)))]
            if self._queue:  # over the budget: the rest in the next round
                self._wake.send(b"", zmq.NOBLOCK)
            else:
                self._woken = False
        for entry in batch:
            if type(entry) is _Gathered:
                try:
                    messages = entry.make(entry.items)
                except Exception:  # policy: a gathered run that cannot be made is lost, logged
                    log.exception("%s: %d gathered items could not be sent", self.name,
                                  len(entry.items))
                    continue
                for frames in messages:
                    self._deliver(frames)
            else:
                self._deliver(entry)
        return len(batch)

    def _deliver(self, frames: list[bytes]) -> bool:
        try:
            send_frames(self._sock, frames)
            return True
        except zmq.Again:
            # policy: the peer's queue is full (it does not read): this message is lost to it
            if self._on_gone is not None:
                self._on_gone(frames[0])
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                # policy: an unreachable peer loses this message; a request it resends with
                # the same id gets the stored answer
                if self._on_gone is not None:
                    self._on_gone(frames[0])
            else:  # policy: any other send failure loses this one message, logged
                log.warning("%s: send failed: %s", self.name, exc)
            return False

    def close(self) -> None:
        self._owner = None  # a later thread that gets the owner's id must not send directly
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._wake.close(linger=0)
        self.inbox.close(linger=0)


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK)``, without its per-frame checks and flag
    arithmetic (the same errors: ``zmq.Again`` when full, ``EHOSTUNREACH`` for a peer that
    left a ``ROUTER_MANDATORY`` ROUTER; both at the first frame, nothing sent)."""
    send = sock.send
    for frame in frames[:-1]:
        send(frame, _MORE_NOBLOCK)
    send(frames[-1], _NOBLOCK)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """``sock.recv_multipart()`` (blocking, copied frames), without its flag arithmetic."""
    recv, get = sock.recv, sock.get
    frames = [recv()]
    while get(_RCVMORE):
        frames.append(recv())
    return frames


def more_to_read(sock: zmq.Socket) -> bool:
    """Whether a message waits in ``sock`` now: cheaper than a ``recv`` that raises
    ``zmq.Again`` to say no."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def exit_on_thread_death(thread_name: str, exc: BaseException) -> None:
    """The default policy for a socket-owning thread that died of a bug: log it and end the
    process with ``THREAD_DEATH_EXIT``, so supervision sees a dead process, not a zombie."""
    log.critical("thread %s died: %r; the process exits with status %d", thread_name, exc,
                 THREAD_DEATH_EXIT, exc_info=exc)
    os._exit(THREAD_DEATH_EXIT)


def guarded(target: Callable[[], None], name: str, *, on_death: DeathHook | None = None,
            stopping: Callable[[], bool] = lambda: False) -> Callable[[], None]:
    """``target`` wrapped for a thread: an exception that escapes it calls ``on_death``
    (default ``exit_on_thread_death``), unless ``stopping()`` says the owner is shutting down
    (sockets closed under a late thread), when it is only logged."""

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # policy: no thread dies silently; see on_death
            if stopping():
                log.debug("thread %s ended while stopping: %s: %s", name, type(exc).__name__, exc)
                return
            (on_death or exit_on_thread_death)(name, exc)

    return run


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket receiving ``sock``'s monitor ``events``, on an inproc address of its
    own. pyzmq's ``get_monitor_socket`` names the address after the socket's file number,
    and a number freed by a closed socket is taken again while its monitor's address may
    still be bound: the new monitor then fails with "Address already in use"."""
    addr = f"inproc://ckpt-monitor-{uuid.uuid4().hex}"
    sock.monitor(addr, events)
    pair = sock.context.socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(addr)
    return pair


def recv_monitor_event(pair: zmq.Socket) -> dict:
    """One event from a monitor socket, as pyzmq's ``recv_monitor_message`` gives it
    (``event``, ``value``, ``endpoint``), without its module: that one imports
    ``zmq.asyncio`` and so asyncio, a fifth of a ``ckptctl`` command's start-up."""
    frames = pair.recv_multipart()
    if len(frames) != 2 or len(frames[0]) != 6:
        raise RuntimeError(f"not a zmq monitor event: {frames!r}")
    event, value = struct.unpack("=hi", frames[0])
    return {"event": event, "value": value, "endpoint": frames[1]}


def room_for_connections() -> int:
    """Raise this process's soft open-files limit to its hard limit (the soft limit now):
    every accepted connection costs a server a descriptor, and libzmq aborts the process
    (``Too many open files (src/ipc_listener.cpp:297)``) when its ipc listener cannot take
    one: at a soft limit of 300, a burst of 389 connections to an agent's socket ended its
    engine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # policy: the limit stays; said, not fatal
        log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard
