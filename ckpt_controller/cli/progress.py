"""An operation's progress as a person reads it on stderr while ``ckptctl`` waits.

Every line starts with the time since the command began (``[  1.23s]``). Two things are shown
while they last: a drain, counting down the requests still in flight, and a running hook, with
its time so far against its bound when known (``12 s of at most 30 s``: the wait drain's
deadline, the hook's timeout). On a terminal such a line is rewritten in place (a carriage
return) and replaced by the line that ends it, and fitted to the terminal's width by cutting the
names, never the times (a line that wraps could not be rewritten); elsewhere (a pipe, a file)
the same lines are printed one under the other, a drain's only when its count changed, and
nothing is ever rewritten. Fed by the controller's journal records (``Journaled`` events:
``drain_progress``, ``hook_start``, ``hook``, ``transition``, ``phase``, ``error``) or by an
agent's own events (``StateChanged``, ``DrainProgress``); heartbeats only refresh the line
shown. A hook's stderr is shown with its control characters escaped (``\r``, ``\x1b``): what a
hook prints cannot rewrite or recolour the terminal. Neighbours: ``cli.controller_cmds`` and
``cli.agent_cmds`` (which feed it and print the result after ``finish``)."""

from __future__ import annotations

import os
import sys
import time
from typing import IO, Any


class Progress:
    """Lines on ``stream``, each with its elapsed time; ``live`` (default: ``stream`` is a
    terminal) rewrites the line of a running drain or hook in place, cut to ``width``
    (default: the terminal's, asked at each redraw; 80 when it cannot say)."""

    def __init__(self, stream: IO[str] | None = None, live: bool | None = None,
                 clock=time.monotonic, width: int | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.live = self.stream.isatty() if live is None else live
        self.width = width
        self.clock = clock
        self.start = clock()
        #: what runs now, by engine: (text before the time, when it began, its bound in
        #: seconds or None)
        self._running: dict[str, tuple[str, float, float | None]] = {}
        self._drained: dict[str, int] = {}  # the in-flight count last printed, by engine
        self._shown = False  # a live line is on the terminal, without its newline

    # ---------------------------------------------------------------- output

    def stamp(self) -> str:
        return f"[{self.clock() - self.start:7.2f}s]"

    def line(self, text: str) -> None:
        """``text`` (one or more lines) under the elapsed time, above any live line."""
        self._clear()
        for part in text.splitlines() or [""]:
            self.stream.write(f"{self.stamp()} {part}\n")
        self._redraw()
        self.stream.flush()

    def _clear(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self._shown = False

    def _redraw(self) -> None:
        if not (self.live and self._running):
            return
        now = self.clock()
        items = [(text, _took(now - began, bound)) for text, began, bound in
                 self._running.values()]
        room = self._columns() - 1  # the last column: no wrap
        line = _fit(self.stamp(), items, room)
        self.stream.write(line[:room])
        self._shown = True

    def _columns(self) -> int:
        if self.width is not None:
            return self.width
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or 80
        except (OSError, ValueError, AttributeError):  # policy: not a terminal after all
            return 80

    def refresh(self) -> None:
        """The live line again, with its times now (on a heartbeat)."""
        if self.live and self._running:
            self._clear()
            self._redraw()
            self.stream.flush()

    def finish(self) -> None:
        """End the live line (before the result is printed)."""
        self._running.clear()
        self._clear()
        self.stream.flush()

    # ---------------------------------------------------------------- what happens

    def drain(self, engine: str, in_flight: int, completed: int, aborted: int,
              bound_s: float | None = None) -> None:
        """A drain's count; ``bound_s``: its deadline (a wait drain's), shown beside its time."""
        text = (f"{engine}: draining, {in_flight} in flight left ({completed} completed, "
                f"{aborted} aborted)")
        began = self._running.get(engine, ("", self.clock(), None))[1]
        self._running[engine] = (text, began, bound_s)
        if self.live:
            self.refresh()
        elif self._drained.get(engine) != in_flight:
            self.line(text)
        self._drained[engine] = in_flight

    def drained(self, engine: str, text: str) -> None:
        self._running.pop(engine, None)
        self._drained.pop(engine, None)
        self.line(text)

    def hook_started(self, engine: str, point: str, names: list[str],
                     bound_s: float | None = None) -> None:
        """A hook point began; ``bound_s``: each hook's timeout, shown beside its time."""
        what = f"{engine}: hook {point} {', '.join(names)}"
        self._running[engine] = (f"{what} running", self.clock(), bound_s)
        self.line(f"{what} started")

    def hook_ended(self, engine: str, run: dict[str, Any]) -> None:
        self._running.pop(engine, None)
        self.line(describe_hook(engine, run))

    def other(self, engine: str | None, text: str) -> None:
        self.line(text)


def _took(seconds: float, bound: float | None) -> str:
    """The time so far, against its bound when there is one: ``12 s of at most 30 s``."""
    if bound is None:
        return f"{seconds:.1f}s"
    return f"{seconds:.0f} s of at most {bound:g} s"


def _fit(stamp: str, items: list[tuple[str, str]], room: int) -> str:
    """``stamp`` and each (name, time) in ``room`` columns: too wide, a name is cut, never
    its time (what a person watches), and those that no longer fit are counted (``+3
    more``)."""
    line = stamp
    for i, (text, took) in enumerate(items):
        sep = "; " if i else " "
        rest = len(items) - i - 1
        more = f"; +{rest} more" if rest else ""
        avail = room - len(line) - len(sep) - len(took) - 1 - len(more)
        if avail >= len(text):
            line += f"{sep}{text} {took}"
            continue
        if avail >= 8:  # enough to know what it is: cut it, keep its time, count the rest
            return f"{line}{sep}{text[:avail - 3]}... {took}{more}"
        return line + (f"{sep}+{rest + 1} more" if i else f" {took}")
    return line


def describe_hook(engine: str, run: dict[str, Any]) -> str:
    """A hook's end (a ``HookRun`` as plain data), with its stderr's tail: why it failed, or
    what a hook that succeeded warns of."""
    name = str(run.get("path", "")).rsplit("/", 1)[-1]
    what = f"{engine + ': ' if engine else ''}hook {run.get('point')} {name}"
    took = f" in {float(run.get('duration_s') or 0):.2f}s"
    if run.get("timed_out"):
        head = f"{what} timed out{took}"
    elif run.get("exit_code") == 0:
        head = f"{what} done{took}"
    else:
        head = f"{what} FAILED, exit {run.get('exit_code')}{took}"
    return head + "".join(f"\n  | {line}" for line in hook_tail(run.get("stderr_tail") or ""))


def hook_tail(text: str, lines: int = 10) -> list[str]:
    """The last ``lines`` non-empty lines of a hook's stderr tail (split at newlines only),
    their control characters escaped."""
    return [_printable(line.rstrip()) for line in text.split("\n") if line.strip()][-lines:]


def _printable(line: str) -> str:
    """``line`` with each character a terminal would act on (``\r``, ``\x1b``...) written
    as its escape, the way ``repr`` writes it; a tab stays."""
    return "".join(ch if ch.isprintable() or ch == "\t" else repr(ch)[1:-1] for ch in line)
