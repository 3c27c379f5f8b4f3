"""systemd's service notification protocol (``sd_notify``), without a dependency.

Under a ``Type=notify`` unit, systemd gives the service ``$NOTIFY_SOCKET`` (a path, or
``@name`` for an abstract socket) and, with ``WatchdogSec=``, ``$WATCHDOG_USEC`` and
``$WATCHDOG_PID``. A ``Notifier`` read from the environment sends:

- ``READY=1`` (with ``STATUS=`` and ``MAINPID=``) once the process really serves: the
  controller after recovery and bind, the vLLM sidecar once its control socket is bound and
  vLLM answered, the reference engine once both its endpoints are bound;
- ``WATCHDOG=1`` every ``$WATCHDOG_USEC``/2 (at most an hour apart) from a thread of its
  own, but only while the service's own loop is alive (``last_round()``, the monotonic time
  of its control thread's last round, is at most one ping period old): a hung control thread
  stops the pings and systemd restarts the service; with ``$WATCHDOG_PID`` naming another
  process, no pings;
- ``STOPPING=1`` when a stop signal came, before the cleanup.

Without ``$NOTIFY_SOCKET`` every call is a no-op. A failed send is logged once and never
ends the service. Each datagram goes through a socket opened for it and closed right away:
the process holds no notification socket between sends (a process CRIU dumps has none to
carry). The variables are removed from ``os.environ`` once read, so hooks and other children
do not inherit them (``sd_notify``'s ``unset_environment``).
Neighbours: ``controller.server``, ``engine.server`` and ``adapters.vllm.sidecar`` (which
call it), ``rpcserver`` (``last_round``), the CLI (which makes it), deploy/systemd/.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping

log = logging.getLogger("ckpt_controller.sdnotify")

#: the variables systemd sets for a notify service
VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

#: the longest time between two pings, however long ``$WATCHDOG_USEC`` is: pinging more often
#: than asked is allowed, and a wait longer than the platform's ``time_t`` overflows
MAX_PING_PERIOD_S = 3600.0


def socket_address(value: str) -> str | bytes | None:
    """The address ``$NOTIFY_SOCKET`` names: a filesystem path, or ``@name`` for the
    abstract ``\\0name``; None for anything else (``vsock:`` and the like are not spoken)."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    return None


def watchdog_period(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between pings (half of ``$WATCHDOG_USEC``, at most ``MAX_PING_PERIOD_S``), or
    None: no watchdog asked for, a value that is not a positive whole number in ASCII digits
    (``"²".isdigit()`` is true, yet no number), or ``$WATCHDOG_PID`` naming another
    process."""
    usec = env.get("WATCHDOG_USEC", "")
    if not (usec.isascii() and usec.isdigit()) or int(usec) == 0:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(pid):
        return None
    return min(int(usec) / 1e6 / 2, MAX_PING_PERIOD_S)


class Notifier:
    """One service's notifications (see the module docstring). ``Notifier.from_env()``
    takes the variables out of ``os.environ``; a test may pass its own ``env``."""

    def __init__(self, env: Mapping[str, str], pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        raw = env.get("NOTIFY_SOCKET", "")
        self.address = socket_address(raw) if raw else None
        self.enabled = self.address is not None
        self.watchdog_s = watchdog_period(env, self.pid) if self.enabled else None
        self._warned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if raw and self.address is None:
            log.warning("NOTIFY_SOCKET=%r is not a path or @abstract name: no notifications",
                        raw)

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> "Notifier":
        environ = os.environ if environ is None else environ
        env = {k: environ[k] for k in VARIABLES if k in environ}
        for k in VARIABLES:
            environ.pop(k, None)
        return cls(env)

    # ---------------------------------------------------------------- sending

    def send(self, **fields: object) -> bool:
        """One datagram of ``KEY=value`` lines (``ready=1`` is sent as ``READY=1``); True
        when it was sent. A no-op (False) without ``$NOTIFY_SOCKET``."""
        if not self.enabled:
            return False
        text = "\n".join(f"{k.upper()}={str(v).replace(chr(10), ' ')}"
                         for k, v in fields.items() if v is not None)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(text.encode(), self.address)
        except OSError as exc:
            # policy: systemd gone or the socket refused: logged once, never fatal (a service
            # that serves must not end because its supervisor cannot be told)
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd at %r: %s (logged once)",
                            self.address, exc)
            return False
        return True

    def ready(self, status: str, last_round: Callable[[], float] | None = None,
              rounds_within: Callable[[float], None] | None = None) -> None:
        """``READY=1`` with ``status`` and this process as ``MAINPID``, then the watchdog
        pings while ``last_round()`` is recent (when ``$WATCHDOG_USEC`` asks for them);
        ``rounds_within(seconds)`` is then told how often the loop must begin a round, idle
        or not (half the ping period: ``RpcServer.rounds_within``)."""
        self.send(ready=1, status=status, mainpid=self.pid)
        if last_round is not None:
            if rounds_within is not None and self.watchdog_s is not None:
                rounds_within(self.watchdog_s / 2)
            self.start_watchdog(last_round)

    def status(self, text: str) -> None:
        self.send(status=text)

    def stopping(self, status: str = "stopping") -> None:
        """``STOPPING=1``; the watchdog pings end."""
        self._stop.set()
        self.send(stopping=1, status=status)
        self.close()

    # ---------------------------------------------------------------- watchdog

    def start_watchdog(self, last_round: Callable[[], float]) -> None:
        """Ping every ``watchdog_s`` while ``time.monotonic() - last_round()`` is at most
        ``watchdog_s``; nothing when no watchdog was asked for (or one already runs)."""
        if self.watchdog_s is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, args=(last_round,),
                                        name="sd-watchdog", daemon=True)
        self._thread.start()

    def _watch(self, last_round: Callable[[], float]) -> None:
        period = self.watchdog_s
        silent = False
        while not self._stop.is_set():
            age = time.monotonic() - last_round()
            if age <= period:
                self.send(watchdog=1)
                if silent:
                    log.warning("control loop alive again: watchdog pings resumed")
                silent = False
            elif not silent:
                silent = True
                log.error("control loop silent for %.1f s: no watchdog ping (systemd "
                          "restarts the service after WatchdogSec)", age)
            self._stop.wait(period)

    def close(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
