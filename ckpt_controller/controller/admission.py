"""Which requests become operations: checks, engine holds and repeated operation ids.

``Admission`` holds each running operation's engines (one operation per engine at a time: a
second is refused with ``BusyError`` naming the holder), answers a repeated operation id with
the stored result or by waiting for the running operation (at most ``MAX_WAITERS`` callers;
one more is shed with ``OverloadedError``), and refuses a repeated id that names a different
operation. ``check`` refuses a malformed request before anything is held.
Neighbours: ``service`` (the controller that admits and runs), ``journal`` (what ids it has
seen), ``config`` (the engines and limits); the reconciler holds engines here too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt_controller import protocol as p
from ckpt_controller.controller.config import MAX_SECONDS, ControllerConfig
from ckpt_controller.controller.journal import Journal
from ckpt_controller.errors import (BusyError, CkptError, OverloadedError, UnreachableError,
                                    UsageError)
from ckpt_controller.values import RESERVED_OP_IDS
from ckpt_controller.vocab import ReleaseLevel

#: called once with the operation's result, or with the error that refused it
Done = Callable[[p.OperationResult | CkptError], None]
#: callers one running operation answers at its end; one more is shed (``OverloadedError``)
MAX_WAITERS = 64


@dataclass
class Running:
    kind: str
    engines: list[str]
    waiters: list[Done] = field(default_factory=list)


class Admission:
    def __init__(self, config: ControllerConfig, journal: Journal) -> None:
        self.config = config
        self.journal = journal
        self.lock = threading.Lock()
        #: engine -> the operation (or reconcile) holding it
        self.holders: dict[str, str] = {}
        self.running: dict[str, Running] = {}
        #: the controller stops (SIGTERM): no operation starts from now on
        self.stopping = False

    def select(self, names: list[str]) -> list[str]:
        roster = self.config.roster  # one snapshot: engines may be adopted or given away
        if not names:
            if not roster.engines:
                raise UsageError("no engines are configured" + (
                    f" (given away: {', '.join(roster.moved)})" if roster.moved else ""))
            return [e.name for e in roster.engines]
        for name in names:
            roster.engine(name)  # UsageError naming the known engines (or where one moved)
        return list(dict.fromkeys(names))

    def accept(self, cmd: p.OperationCommand, done: Done) -> list[str] | None:
        """Hold ``cmd``'s engines for it and return them; ``None`` when ``done`` is already
        taken care of (the id's stored result, or a running operation with that id)."""
        engines = self.select(cmd.engines)
        check(cmd)
        if self.stopping:
            raise UnreachableError("the controller is stopping; nothing starts now (try again "
                                   "once it is back)", op_id=cmd.op_id, retry_after_s=1.0)
        with self.lock:
            row = self.journal.lookup(cmd.op_id)
            known = row[:2] if row is not None else None
            running = self.running.get(cmd.op_id)
            if known is None and running is not None:
                known = (running.kind, running.engines)
            if known is not None and known != (cmd.kind, engines):
                raise UsageError(f"operation id {cmd.op_id} was already used for a {known[0]} "
                                 f"of {', '.join(known[1])}; a repeated id must repeat the "
                                 f"same operation", op_id=cmd.op_id, kind=known[0],
                                 engines=known[1])
            if running is not None:
                if len(running.waiters) >= MAX_WAITERS:
                    raise OverloadedError(
                        f"{MAX_WAITERS} callers already wait for operation {cmd.op_id}",
                        op_id=cmd.op_id, retry_after_s=1.0)
                running.waiters.append(done)
                return None
            stored = row[2] if row is not None else None
            if stored is None:
                self._hold(cmd, engines, done, journaled=row is not None)
        if stored is not None:
            # answered at once, outside the lock: a burst of repeats costs no thread each
            done(stored)
            return None
        return engines

    def _hold(self, cmd: p.OperationCommand, engines: list[str], done: Done,
              journaled: bool) -> None:
        """Under ``lock``: hold ``engines`` for the new operation ``cmd``, or refuse it
        (``journaled``: the id is in the journal without a result)."""
        if journaled:
            raise BusyError("operation id belongs to an interrupted operation being "
                            "recovered", op_id=cmd.op_id)
        for e in engines:  # given away since ``select``: refused as ``select`` would now
            if not self.config.knows(e):
                self.config.engine(e)
        busy = {e: self.holders[e] for e in engines if e in self.holders}
        if busy:
            engine, holder = next(iter(busy.items()))
            raise BusyError(f"engine {engine} is held by operation {holder}",
                            engine=engine, holder=holder, busy=busy)
        for e in engines:
            self.holders[e] = cmd.op_id
        self.running[cmd.op_id] = Running(cmd.kind, engines, [done])

    def release(self, op_id: str) -> list[Done]:
        """Free the engines ``op_id`` held; returns the callers waiting for its end."""
        with self.lock:
            for e in [e for e, holder in self.holders.items() if holder == op_id]:
                del self.holders[e]
            running = self.running.pop(op_id, None)
        return running.waiters if running else []


def check(cmd: p.OperationCommand) -> None:
    """Refuse (``UsageError``) a request whose parameters no operation can take."""
    if cmd.level is not None and cmd.level not in set(ReleaseLevel):
        raise UsageError("level must be 0, 1 or 2", level=cmd.level)
    if cmd.level is not None and cmd.tags:
        raise UsageError("give a level or tags, not both", level=cmd.level, tags=cmd.tags)
    if cmd.op_id in RESERVED_OP_IDS:  # a hand-built frame: the client refuses it already
        raise UsageError(f"operation id {cmd.op_id} is reserved (the name of the image "
                         "link); give another", op_id=cmd.op_id)
    if cmd.max_unavailable is not None and cmd.max_unavailable < 1:
        raise UsageError("max_unavailable must be at least 1", max_unavailable=cmd.max_unavailable)
    if cmd.max_unavailable is not None and cmd.max_unavailable_percent is not None:
        raise UsageError("give max_unavailable as a number or a percentage, not both",
                         max_unavailable=cmd.max_unavailable,
                         max_unavailable_percent=cmd.max_unavailable_percent)
    for name in ("deadline_s", "drain_timeout_s"):
        value = getattr(cmd, name)
        if value is not None and value <= 0:
            raise UsageError(f"{name} must be positive", **{name: value})
        if value is not None and value > MAX_SECONDS:
            raise UsageError(f"{name} must be at most {MAX_SECONDS:.0f} s (a day)",
                             **{name: value})
    if not cmd.op_id:
        raise UsageError("an operation needs an id")
