"""What a vLLM sidecar keeps on disk, so that a sidecar restarted beside the same vLLM server
(after a crash or a kill -9, say) knows what its predecessor did to it.

One small JSON file, rewritten whole (write, fsync, rename) at every change:

- ``generation``: the engine's completed cycles (``status``'s ``generation`` survives a
  restart of the sidecar);
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


@dataclass
class SidecarState:
    generation: int = 0
    progress: Progress = field(default_factory=Progress)


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
            return SidecarState(generation=int(raw.get("generation", 0)),
                                progress=Progress(**raw.get("progress", {})))
        except FileNotFoundError:
            return SidecarState()
        except (OSError, ValueError, TypeError) as err:  # policy: start afresh, say so
            log.warning("ignoring the sidecar state in %s: %s", self.path, err)
            return SidecarState()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self.state), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
