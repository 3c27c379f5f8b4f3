"""What the agent needs from the engine it is embedded in, and from its memory.

``EngineHooks`` are callbacks into the engine's own scheduler; an engine overrides the ones
it supports. ``MemoryManager`` is the shape of ``ckpt_controller.memory.MemoryRegistry`` (and of
adapters for engines whose memory we reach another way, e.g. vLLM's HTTP API). The agent
imports neither torch nor an engine: both arrive through these interfaces.
Neighbours: ``operations`` (calls them), ``memory.registry`` and ``adapters.vllm`` (implement
them), ``vocab`` (levels, modes, steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ckpt_controller.clock import Deadline
from ckpt_controller.errors import EngineError, UsageError
from ckpt_controller.protocol import DrainProgress, DrainReport, MemoryReport, PrepareCommand
from ckpt_controller.vocab import DrainMode, MemoryAction, PrepareStep, ReleaseLevel


class EngineHooks:
    """Callbacks the agent makes into the engine, always from the agent's operation thread.

    Defaults: an engine that cannot abort or keep refuses those drain modes with an
    ``EngineError``; pause, resume and verify do nothing.
    """

    def abort_requests(self, request_ids: list[str]) -> None:
        """End each request now with finish reason ``abort`` and its partial output,
        reported to its client, then call ``gate.finish(id, "abort")``. May return first;
        the agent waits for the finishes."""
        raise EngineError("this engine cannot abort requests", step=PrepareStep.DRAIN,
                          mode=DrainMode.ABORT)

    def keep_requests(self, request_ids: list[str]) -> None:
        """Freeze each request, keeping its progress in host memory, so that it completes
        after restore with the output it would have had without the cycle. Return when frozen."""
        raise EngineError("this engine cannot keep requests", step=PrepareStep.DRAIN,
                          mode=DrainMode.KEEP)

    def check_prepare(self, cmd: PrepareCommand) -> None:
        """Raise (``UnsupportedError``) when the engine cannot prepare as ``cmd`` asks; called
        before anything moves, while the engine still serves."""

    def check_restore(self) -> None:
        """Raise (``UnsupportedError``) when the engine cannot be restored now; called before
        a restore moves anything (not before a rollback, which ends FAILED if it fails)."""

    def pause_scheduling(self) -> None:
        """Return once no step runs and none will start until ``resume_scheduling``."""

    def resume_scheduling(self) -> None:
        """Start stepping again; kept requests continue."""

    def verify(self) -> None:
        """Check the engine is fit to serve after re-wake (e.g. a golden prompt). Raise to
        fail the restore."""


class ExternalDrain(Protocol):
    """A drain the engine runs itself, for an engine whose requests do not pass through the
    agent's admission gate (e.g. vLLM, driven over HTTP by a sidecar agent).

    ``drain`` stops new work, then ends, waits for or keeps the in-flight requests as
    ``cmd.drain`` says, enforcing ``cmd.drain_timeout_s`` and ``cmd.on_deadline`` itself, and
    never running past ``deadline`` (raise ``DeadlineError``). It reports progress with
    ``progress`` (about every quarter second) and returns the counts it saw. Raise a
    ``CkptError`` to fail the prepare; the agent then rolls back.
    """

    def drain(self, cmd: PrepareCommand, deadline: Deadline,
              progress: Callable[[DrainProgress], None]) -> DrainReport: ...


class MemoryManager(Protocol):
    """Releases and re-wakes an engine's memory (see ``ckpt_controller.memory``)."""

    @property
    def released_tags(self) -> list[str]: ...

    # optional: ``released_level`` (the level of the release in force, for ``status``)

    def registered_bytes(self) -> dict[str, int]: ...

    def reload_files(self) -> dict[str, str]: ...

    def plan(self, level: int | None = None, tags: list[str] | None = None) -> object: ...

    def release(self, plan: object, residual_budget_bytes: int | None = None) -> MemoryReport: ...

    def rewake(self, tags: list[str] | None = None) -> MemoryReport: ...


class NoMemory:
    """For an engine with nothing registered: every release and re-wake is empty."""

    released_tags: list[str] = []

    def registered_bytes(self) -> dict[str, int]:
        return {}

    def reload_files(self) -> dict[str, str]:
        return {}

    def plan(self, level: int | None = None, tags: list[str] | None = None) -> object:
        if tags:
            raise UsageError("no memory is registered under these tags", tags=tags, registered=[])
        if level is not None:
            try:
                level = ReleaseLevel(level)
            except ValueError:  # policy: the caller's value, named
                raise UsageError("level must be 0, 1 or 2", level=level) from None
        return (level, tags)

    def release(self, plan: object, residual_budget_bytes: int | None = None) -> MemoryReport:
        level, tags = plan  # type: ignore[misc]
        return MemoryReport(action=MemoryAction.RELEASE, level=level, tags=list(tags or []),
                            budget_bytes=residual_budget_bytes)

    def rewake(self, tags: list[str] | None = None) -> MemoryReport:
        return MemoryReport(action=MemoryAction.REWAKE)
