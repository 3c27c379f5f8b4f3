"""Failpoints: faults armed in an agent when it starts, so a drill can prove what each does.

Armed only from the environment of the engine process (``CKPT_FAILPOINTS``), never over the
wire: a comma-separated list of ``POINT:ACTION`` items, each firing once, when the agent's
operation reaches ``POINT`` (before that step runs).

==========  ===================================================================================
point       reached
==========  ===================================================================================
drain       PREPARING, admission just closed, requests still in flight
release     PREPARING, drained and paused, before memory is released
rewake      RESTORING, before memory comes back
resume      RESTORING, memory back and verified, before scheduling and admission reopen
==========  ===================================================================================

==============  ===============================================================================
action          effect
==============  ===============================================================================
kill            SIGKILL to this process (the engine dies mid-phase)
stall=SECONDS   the agent stops: no heartbeats, no answers, the operation waits too
corrupt         one bit of the first weight tensor flips after its bytes come back and before
                they are verified (``rewake`` only)
ballast=SIZE    SIZE of memory the registry does not know is touched and held until the
                operation ends (``release`` only): a residual over the budget
==============  ===============================================================================

Example: ``CKPT_FAILPOINTS=release:stall=8,rewake:corrupt``. A bad spec is a ``ConfigError``
at start. Neighbours: ``operations`` (calls ``hit`` as its step table says), ``server``
(stalls), the drill (arms), ``vocab`` (the step names).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckpt_controller import units
from ckpt_controller.errors import ConfigError
from ckpt_controller.vocab import PrepareStep, RestoreStep

log = logging.getLogger("ckpt_controller.agent")

ENV = "CKPT_FAILPOINTS"
#: the agent's steps a failpoint can be armed at (``operations.PREPARE_STEPS``, ``RESTORE_STEPS``)
POINTS = (PrepareStep.DRAIN, PrepareStep.RELEASE, RestoreStep.REWAKE, RestoreStep.RESUME)
ACTIONS = ("kill", "stall", "corrupt", "ballast")
#: actions that make sense only at one point
ONLY_AT = {"corrupt": RestoreStep.REWAKE, "ballast": PrepareStep.RELEASE}


@dataclass(frozen=True)
class Failpoint:
    point: str
    action: str
    #: seconds for ``stall``, bytes for ``ballast``
    amount: float = 0.0

    def __str__(self) -> str:
        if not self.amount:
            return f"{self.point}:{self.action}"
        amount = int(self.amount) if self.action == "ballast" else f"{self.amount:g}"
        return f"{self.point}:{self.action}={amount}"


def parse(spec: str) -> list[Failpoint]:
    """``POINT:ACTION[=AMOUNT],...`` into failpoints; ``ConfigError`` naming the bad item."""
    out: list[Failpoint] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, action = item.partition(":")
        action, _, amount = action.partition("=")
        problem = None
        if point not in POINTS:
            problem = f"unknown point {point!r} (points: {', '.join(POINTS)})"
        elif action not in ACTIONS:
            problem = f"unknown action {action!r} (actions: {', '.join(ACTIONS)})"
        elif ONLY_AT.get(action, point) != point:
            problem = f"{action} works only at {ONLY_AT[action]}"
        elif (action in ("stall", "ballast")) != bool(amount):
            problem = f"{action} " + ("needs =AMOUNT" if not amount else "takes no amount")
        if problem:
            raise ConfigError(f"bad failpoint {item!r}: {problem}", key=ENV, problem=problem)
        value = 0.0
        if action == "stall":
            try:
                value = float(amount)
            except ValueError:
                value = -1.0
            if not 0 < value <= 3600:
                raise ConfigError(f"bad failpoint {item!r}: stall takes 0 < seconds <= 3600",
                                  key=ENV, problem="bad seconds")
        elif action == "ballast":
            try:
                value = float(units.parse_bytes(amount))
            except Exception:  # policy: any unparsable size is the spec's error
                raise ConfigError(f"bad failpoint {item!r}: ballast takes a size like 256MiB",
                                  key=ENV, problem="bad size") from None
        out.append(Failpoint(point, action, value))
    return out


class Failpoints:
    """The failpoints armed in this process. ``stall(seconds)`` stops the agent's control
    thread; ``corrupt()`` flips a weight bit; both are given by the agent and engine."""

    def __init__(self, armed: list[Failpoint] | None = None) -> None:
        self.armed = list(armed or [])
        self.stall: Callable[[float], None] = lambda s: None
        self.corrupt: Callable[[], str] | None = None
        self._ballast: list[bytearray] = []
        if self.armed:
            log.warning("failpoints armed: %s", ", ".join(map(str, self.armed)))

    def armed_at(self, point: str) -> bool:
        return any(fp.point == point for fp in self.armed)

    @classmethod
    def from_env(cls) -> Failpoints:
        return cls(parse(os.environ.get(ENV, "")))

    def _take(self, point: str, action: str) -> Failpoint | None:
        for fp in self.armed:
            if fp.point == point and fp.action == action:
                self.armed.remove(fp)
                log.warning("failpoint %s fires", fp)
                return fp
        return None

    def hit(self, point: str) -> None:
        """Fire what is armed at ``point`` (kill, stall, ballast)."""
        if not self.armed:
            return
        if self._take(point, "kill"):
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # not reached: the signal is delivered at once
        fp = self._take(point, "stall")
        if fp:
            self.stall(fp.amount)
            time.sleep(fp.amount)
        fp = self._take(point, "ballast")
        if fp:
            block = bytearray(int(fp.amount))
            for i in range(0, len(block), 4096):  # touched: resident, not just reserved
                block[i] = 1
            self._ballast.append(block)

    def after_refill(self) -> None:
        """Between re-wake and verification: the ``rewake:corrupt`` failpoint."""
        if self.armed and self.corrupt is not None and self._take(RestoreStep.REWAKE, "corrupt"):
            log.warning("failpoint flipped a bit of %s", self.corrupt())

    def operation_ended(self) -> None:
        self._ballast.clear()
