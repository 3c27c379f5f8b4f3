"""Sockets seen from outside a process: which ipc connections a server holds.

A free TCP port comes from the product's own ``ckpt_controller.endpoints.free_port`` (one
helper for the tests and the code). Neighbours: ``timing`` (the waits), ``processes``.
"""

from __future__ import annotations

import os

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
