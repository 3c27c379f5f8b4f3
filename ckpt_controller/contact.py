"""First contact: tell "nobody is there" from "slow to answer" within about a second.

A zmq DEALER connects in the background and retries for ever, so a client that only waits
for a reply cannot tell a missing ipc socket file, a refused TCP port or a CURVE key the
server refused from a server that is merely slow. ``FirstContact`` watches the socket's
monitor until the peer is heard from (or its ZMTP handshake succeeded) and raises
``UnreachableError`` at once when:

- the connection is refused (``EVENT_CONNECT_RETRIED`` with no ``EVENT_CONNECTED``) for
  ``grace_s``: no socket file, a stale one, or a TCP port nobody listens on;
- the handshake fails (``EVENT_HANDSHAKE_FAILED_*``): the server refused this client's CURVE
  key, the client has no CURVE keys for a CURVE server, or the wrong server key.

A peer that accepted the connection but never answers is not judged here: the caller's own
timeout and retries apply. With ``watch_reconnects`` the watch goes on after first contact
and only counts the socket's handshakes (``handshakes``): one after the first is a new
connection (the server restarted, restored from a checkpoint image, or the link was reset),
and what was in flight on the old one is gone (``engine.client`` asks again). Neighbours: ``rpc`` and ``engine.client`` (its users), ``errors``.
"""

from __future__ import annotations

import math
import os
import time

import zmq

from ckpt_controller import hub
from ckpt_controller.errors import UnreachableError
from ckpt_controller.zmqutil import monitor_socket, recv_monitor_event

#: how long a refused connection may keep being refused before the first contact fails (a
#: server that is just binding gets this long)
REFUSED_GRACE_S = 0.5

_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused this client's CURVE key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed (a client without CURVE keys "
                                         "for a CURVE server, or the other way round)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed (the wrong CURVE server key?)",
}


class FirstContact:
    """Watches ``sock`` (already set up, not yet connected: call before ``connect``) until
    the peer is heard from. ``poll`` replaces ``sock.poll`` meanwhile; ``heard`` ends the
    watch for good; ``detach`` before closing ``sock`` (``attach`` a replacement to go on
    watching). ``hint`` is added to a refusal (e.g. "is `ckptctl serve` running?")."""

    def __init__(self, sock: zmq.Socket, endpoint: str, *, hint: str = "",
                 grace_s: float = REFUSED_GRACE_S, watch_reconnects: bool = False) -> None:
        self.endpoint, self.hint, self.grace_s = endpoint, hint, grace_s
        self.watch_reconnects = watch_reconnects
        #: the peer was heard from (or shook hands): nothing left to judge
        self.settled = False
        #: handshakes on the current socket so far (counted with ``watch_reconnects``)
        self.handshakes = 0
        self._started: float | None = None
        self._refused_since: float | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self.attach(sock)

    def attach(self, sock: zmq.Socket) -> None:
        """Watch ``sock`` (a client reopened its socket before first contact); what was seen
        so far (how long the connection has been refused) carries over."""
        self.detach()
        self._sock = sock
        #: the wait once settled: one poller for the socket's life, not one per wait
        self._plain = zmq.Poller()
        self._plain.register(sock, zmq.POLLIN)
        self._socks = (sock,)
        self.handshakes = 0
        if self.settled and not self.watch_reconnects:
            return
        self._monitor = monitor_socket(sock, _EVENTS)

    def detach(self) -> None:
        """Stop watching the current socket (call before closing it)."""
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:  # policy: the socket is already closed; nothing to stop
                pass
            self._monitor.close(linger=0)
            self._monitor = None

    def heard(self) -> None:
        """The peer answered (or shook hands): from now on only the caller's timeouts apply
        (and, with ``watch_reconnects``, handshakes are still counted)."""
        self.settled = True
        if not self.watch_reconnects:
            self.detach()

    def poll(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``sock`` to be readable, as ``sock.poll`` would; raises
        ``UnreachableError`` as soon as the first contact has failed."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self._started is None:
            self._started = time.monotonic()
        while True:
            if self._monitor is None:  # settled: a plain wait
                left = deadline - time.monotonic()
                if hub.current() is not None:
                    return bool(hub.poll(self._socks, left))
                return bool(self._plain.poll(max(0, math.ceil(left * 1000))))
            now = time.monotonic()
            wait = deadline - now
            if self._refused_since is not None:  # wake up when the grace ends
                wait = min(wait, self._refused_since + self.grace_s - now)
            ready = hub.poll((self._sock, self._monitor), wait)
            if self._monitor in ready:
                self._read_events()
            if self._sock in ready:
                return True
            self._judge()
            if time.monotonic() >= deadline:
                return False

    def _read_events(self) -> None:
        while self._monitor is not None and self._monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_event(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
                self.heard()
            elif self.settled:  # policy: after first contact only handshakes are counted
                continue
            elif event == zmq.EVENT_CONNECTED:
                self._refused_since = None
            elif event == zmq.EVENT_CONNECT_RETRIED:
                if self._refused_since is None:
                    self._refused_since = time.monotonic()
            elif event in _HANDSHAKE_FAILED:
                self._fail(_HANDSHAKE_FAILED[event], reason="handshake",
                           hint="check this client's CURVE keys (--curve-key, "
                                "--curve-server-key); the server logs the key it refused")

    def _judge(self) -> None:
        if self._refused_since is None or self.settled:
            return
        if time.monotonic() - self._refused_since < self.grace_s:
            return
        path = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
        if path and not path.startswith("@") and not os.path.exists(path):
            what = f"no socket file {path}: nothing is serving there"
        else:
            what = "connection refused: nothing is listening there"
        self._fail(what, reason="refused", hint=self.hint)

    def _fail(self, what: str, *, reason: str, hint: str) -> None:
        waited = time.monotonic() - (self._started or time.monotonic())
        raise UnreachableError(
            f"cannot reach {self.endpoint}: {what} (after {waited:.1f}s)",
            endpoint=self.endpoint, reason=reason, waited_s=round(waited, 3),
            hint=hint or None)
