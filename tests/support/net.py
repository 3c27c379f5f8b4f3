"""Sockets seen from outside a process: which ipc connections a server holds; a TCP link a
test cuts and mends (``TcpCut``); a stand-in HTTP server on loopback (``LocalHttp``).

A free TCP port comes from the product's own ``ckpt_controller.endpoints.free_port`` (one
helper for the tests and the code). Neighbours: ``timing`` (the waits), ``processes``.
"""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ckpt_controller.endpoints import free_port
from support.timing import wait_until


def ipc_connections(pid: int, endpoint: str) -> frozenset[int]:
    """The sockets (their inodes) process ``pid`` holds on its bound ipc ``endpoint``: the
    listening one and one per connection it accepted (``/proc/net/unix`` names the path on
    the accepting side). Inodes, not a count: a client that just closed may still be counted
    while a new one connects, and a count then stays the same."""
    path = endpoint.removeprefix("ipc://")
    on_path = set()
    with open("/proc/net/unix") as table:
        next(table)
        for row in table:
            cols = row.split()
            if len(cols) >= 8 and cols[7] == path:
                on_path.add(int(cols[6]))
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # policy: closed meanwhile: not a socket it holds
            continue
        if link.startswith("socket:["):
            held.add(int(link[8:-1]))
    return frozenset(on_path & held)


def wait_connected(pid: int, endpoint: str, before: frozenset[int],
                   timeout_s: float = 30.0) -> None:
    """Wait until process ``pid`` accepted a connection on ``endpoint`` that is not among the
    ``before`` sockets it had (``ipc_connections``): a client started meanwhile (``watch``)
    is there."""
    wait_until(lambda: ipc_connections(pid, endpoint) - before, timeout_s,
               f"a new connection to {endpoint}")


class TcpCut:
    """A TCP forwarder from a port of its own to ``target`` (``host``, ``port``) whose link a
    test can cut and mend: ``cut()`` resets every connection through it and refuses new ones
    (as an engine stopped by a CRIU dump does to its clients), ``mend()`` accepts again on
    the same port. ``endpoint`` is the ``tcp://`` address clients connect to."""

    def __init__(self, target: tuple[str, int]) -> None:
        import socket
        import threading

        self._socket, self.target = socket, target
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._listener = None
        self._pairs: dict = {}  # socket -> its other end
        self._stop = threading.Event()
        self.mend()
        self._thread = threading.Thread(target=self._run, name="tcp-cut", daemon=True)
        self._thread.start()

    def mend(self) -> None:
        listener = self._socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        listener.setblocking(False)
        with self._lock:
            self._listener = listener

    def cut(self) -> None:
        import struct

        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for sock in list(self._pairs):
                # SO_LINGER 0: close sends a reset, as a killed peer's kernel does
                sock.setsockopt(self._socket.SOL_SOCKET, self._socket.SO_LINGER,
                                struct.pack("ii", 1, 0))
                sock.close()
            self._pairs.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.cut()

    def _run(self) -> None:
        import select

        while not self._stop.is_set():
            with self._lock:
                listener = self._listener
                socks = [s for s in self._pairs if s.fileno() >= 0]
            readable, _, _ = select.select(socks + ([listener] if listener else []), [], [],
                                           0.05)
            with self._lock:
                for sock in readable:
                    if sock is listener and self._listener is listener:
                        client, _ = listener.accept()
                        try:
                            server = self._socket.create_connection(self.target, timeout=5)
                        except OSError:  # policy: nobody serves the target: refused here too
                            client.close()
                            continue
                        self._pairs[client], self._pairs[server] = server, client
                    elif sock in self._pairs:
                        other = self._pairs[sock]
                        try:
                            data = sock.recv(1 << 16)
                            if data:
                                other.sendall(data)
                                continue
                        except OSError:  # policy: a reset end: both ends go
                            pass
                        del self._pairs[sock], self._pairs[other]
                        sock.close()
                        other.close()


class LocalHttp:
    """``handler`` (a ``BaseHTTPRequestHandler`` class) served on 127.0.0.1 from a thread of
    its own, a thread per connection, until ``close``; ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
