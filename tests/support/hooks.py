"""Hooks a test puts in a controller's hooks folder: a shell script of its own
(``write_hook``) or a link to a shipped hook in ``hooks/`` (``link_hook``).

Folders are made private (0700, whatever the umask): the hook runner refuses a hook below a
folder others may write. Neighbours: ``processes`` (``ControllerProcess.dir / "hooks"`` is
its ``hooks_dir``), ``ckpt_controller.hooks``.
"""

from __future__ import annotations

from pathlib import Path

from support import ROOT


def _hooks_folder(where) -> Path:
    """A hooks folder, or a controller's (anything with a ``dir``: its ``dir / "hooks"``)."""
    return Path(where.dir) / "hooks" if hasattr(where, "dir") else Path(where)


def _private_folder(folder: Path) -> None:
    """``folder`` and every missing folder above it, each made 0700."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for one in reversed(missing):
        one.mkdir(mode=0o700)


def write_hook(where, point: str, name: str, body: str, mode: int = 0o755) -> Path:
    """An executable shell hook ``name`` at ``point`` below ``where`` (a hooks folder, or a
    controller: its hooks folder); ``body`` follows ``#!/bin/sh``. Returns its path."""
    folder = _hooks_folder(where) / point
    _private_folder(folder)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return path


def link_hook(where, point: str, name: str, shipped: str) -> Path:
    """``name`` at ``point`` below ``where`` (as ``write_hook``): a link to the shipped hook
    ``hooks/SHIPPED`` of this checkout; one already there is kept. Returns its path."""
    folder = _hooks_folder(where) / point
    _private_folder(folder)
    link = folder / name
    if not link.is_symlink():
        link.symlink_to(ROOT / "hooks" / shipped)
    return link


#: the shipped CRIU hooks as a node runs them: ``(point, name, shipped hook)``
CRIU_HOOKS = (("dump", "10-criu-dump", "criu-dump"),
              ("pre-restore", "10-criu-restore", "criu-restore"))
#: the same with ``tcp-hold`` around them (new connections wait while the engine is out)
CRIU_TCP_HOLD_HOOKS = (("dump", "05-tcp-hold", "tcp-hold"), CRIU_HOOKS[0],
                       ("post-dump", "95-tcp-hold", "tcp-hold"), CRIU_HOOKS[1],
                       ("pre-restore", "30-tcp-hold", "tcp-hold"))


def link_hooks(where, table) -> None:
    """``link_hook`` for each ``(point, name, shipped)`` of ``table`` (``CRIU_HOOKS``)."""
    for point, name, shipped in table:
        link_hook(where, point, name, shipped)
