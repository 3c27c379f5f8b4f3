"""What a vLLM sidecar keeps on disk, so that a sidecar restarted beside the same vLLM server
(after a crash or a kill -9, say) knows what its predecessor did to it.

One small JSON file, rewritten whole (write, fsync, rename) at every change:

- ``generation``: the engine's completed cycles (``status``'s ``generation`` survives a
  restart of the sidecar);
- ``engine_started``: when the vLLM process it is about started, so a sidecar beside a
  brand-new vLLM of the same name starts afresh rather than with the old one's generation
  (updated when a restore brings a new process: ``belongs_to``);
- ``progress``: what the current prepare did to vLLM and must be undone by a restore or a
  rollback (tags put to sleep, the level, whether ``checkpoint_prepare`` ran, requests kept)
  and the baseline taken before it (golden completion, weight checksums), so a successor's
  restore re-wakes, verifies and resumes as the predecessor's would have. Empty while vLLM
  serves.

The file lives beside the control socket (``<socket>.state``) for an ``ipc://`` endpoint, else
in the runtime folder (``<runtime dir>/<name>.vllm-state``). Neighbours: ``sidecar`` (writes
and reads it), ``endpoints`` (the runtime folder).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ckpt_controller.endpoints import runtime_dir

log = logging.getLogger("ckpt_controller.vllm")


@dataclass
class Progress:
    """What a prepare did to vLLM, and the baseline taken before it."""

    released: list[str] = field(default_factory=list)
    level: int | None = None
    checkpoint_prepared: bool = False
    kept: int = 0
    golden: str | None = None
    checksums: dict[str, str] | None = None
    #: the API the prepare went through (``EngineApi``'s value; None: the dev-mode API)
    api: str | None = None


@dataclass
class SidecarState:
    generation: int = 0
    progress: Progress = field(default_factory=Progress)
    #: when the vLLM process this state is about started (wall clock, from ``/proc``; None:
    #: not known): a sidecar beside another vLLM process starts afresh (``belongs_to``)
    engine_started: float | None = None


#: two start times of one process, as read at two moments, differ by less than this
SAME_START_S = 1.0


def state_path(control: str | None, name: str) -> Path:
    """Where the sidecar serving ``control`` as engine ``name`` keeps its state."""
    if control and control.startswith("ipc://") and not control[6:].startswith("@"):
        return Path(control[6:] + ".state")
    return runtime_dir() / f"{name}.vllm-state"


class StateFile:
    """The sidecar's state at ``path``; ``state`` is what was read at start (defaults when
    there was no file, or one that cannot be read: logged, not fatal)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state = self._read()

    def _read(self) -> SidecarState:
        try:
            raw = json.loads(self.path.read_text())
            started = raw.get("engine_started")
            return SidecarState(generation=int(raw.get("generation", 0)),
                                progress=Progress(**raw.get("progress", {})),
                                engine_started=None if started is None else float(started))
        except FileNotFoundError:
            return SidecarState()
        except (OSError, ValueError, TypeError) as err:  # policy: start afresh, say so
            log.warning("ignoring the sidecar state in %s: %s", self.path, err)
            return SidecarState()

    def belongs_to(self, started: float | None) -> bool:
        """Whether this state is about the vLLM process that started at ``started`` (None:
        not known, and then it is kept). A state about another process (a brand-new vLLM
        under the same name: it once went on with the old one's generation) is dropped:
        generation 0, nothing to undo. The process's start time is recorded either way."""
        known = self.state.engine_started
        same = started is None or known is None or abs(started - known) < SAME_START_S
        if not same:
            log.warning("the sidecar state in %s is about another vLLM process (started %s, "
                        "this one %s): generation and progress start afresh", self.path,
                        time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(known)),
                        time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)))
            self.state = SidecarState()
        if started is not None and self.state.engine_started != started:
            self.state.engine_started = started
            self.save()
        return same

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self.state), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
