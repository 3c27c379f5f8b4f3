"""One socket, one owner thread, many senders: the outbox pattern used by every server here.

A zmq socket must only be used by the thread that owns it. Other threads that need to send
(an operation thread replying, a scheduler streaming tokens) push their frames into an
``Outbox``: a PUSH socket guarded by a lock, connected over inproc to a PULL socket that the
owner thread polls next to its main socket and forwards from. Neighbours: ``agent.server``
and ``engine.server`` own such sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq


class Outbox:
    """Thread-safe sending towards a socket owned by another thread.

    ``send(frames)`` from any thread; the owner polls ``inbox`` and calls ``forward(sock)``.
    """

    def __init__(self, ctx: zmq.Context, name: str) -> None:
        addr = f"inproc://outbox-{name}-{id(self)}"
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(addr)
        self._push = ctx.socket(zmq.PUSH)
        self._push.connect(addr)
        self._lock = threading.Lock()
        self._closed = False

    def send(self, frames: list[bytes]) -> None:
        with self._lock:
            if not self._closed:
                self._push.send_multipart(frames)

    def forward(self, sock: zmq.Socket,
                on_gone: Callable[[bytes], None] | None = None) -> int:
        """Send everything queued through ``sock``; returns how many messages went.

        With a ROUTER set to ``ROUTER_MANDATORY``, a message for a peer that is gone (or whose
        queue is full) is dropped and ``on_gone(identity)`` called instead of blocking."""
        sent = 0
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return sent
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                sent += 1
            except (zmq.Again, zmq.ZMQError) as exc:
                # policy: an unreachable peer loses this message; a request it resends with
                # the same id gets the stored answer
                if on_gone is not None and (isinstance(exc, zmq.Again)
                                            or exc.errno == zmq.EHOSTUNREACH):
                    on_gone(frames[0])
                else:
                    raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._push.close(linger=0)
        self.inbox.close(linger=0)
