"""Capture images on disk, per engine, and their retention (``[images] keep``).

An operation whose hooks run on an engine has a folder ``<image_dir>/<engine>/<op>/`` (made by
``session.image_dir``; one that holds nothing when the operation ends is removed then:
``remove_if_empty``). A folder is a *good* image when a capture dumped it (its journal
``capture`` record says ``dumped``); the others are what failed captures, or hooks that
wrote beside them, left.

Retention keeps, per engine: the newest ``keep`` good images (at least one: the newest is
never removed), the one ``latest`` points at (what criu-restore restores by default), the
folders of operations running on the engine now, and the folders newer than its newest good
image, at most ``keep`` of them (the last attempts, with their logs). Everything else goes:
after every operation that dumped (``after_capture``, on a thread of its own: removing GiB
takes a while, and nobody waits for it), or at once with ``ckptctl images prune``.
``ckptctl images list`` shows each folder with its size and why it is kept. The bytes each
engine's images take are counted once and kept (``images_bytes``) for ``status`` and the
``ckpt_images_bytes`` metric, counted again after a capture or a prune.

Neighbours: ``session`` (makes the folders), ``journal`` (``captures``), ``service`` (owns
one; the engines' holders), ``server`` (the ``IMAGES`` request), ``metrics``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ckpt_controller import protocol as p
from ckpt_controller.controller.journal import Journal

log = logging.getLogger("ckpt_controller.images")

#: what criu-dump points at the image a restore uses by default (a link, not an image)
LATEST = "latest"


def folder_name(op_id: str) -> str:
    """The folder an operation's hooks get for an engine (``/`` is no part of a name)."""
    return op_id.replace("/", "_")


def remove_if_empty(folder: Path | None) -> None:
    """Remove an operation's folder that holds nothing (its hooks wrote nothing to keep)."""
    if folder is None:
        return
    try:
        folder.rmdir()
    except OSError:  # policy: not empty (an image, a log), or gone already: it stays as is
        pass


def folder_bytes(folder: Path) -> int:
    """The bytes of the files below ``folder`` (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # policy: a file removed while counted: not counted
                pass
    return total


class ImageStore:
    """The image folders below ``image_dir``. ``running(engine)`` gives the ids of the
    operations running on an engine now (their folders are in use). Thread-safe: one prune at
    a time."""

    def __init__(self, image_dir: Path, keep: int, journal: Journal,
                 running: Callable[[str], Iterable[str]],
                 on_bytes: Callable[[str, int], None] | None = None) -> None:
        self.image_dir = image_dir
        self.keep = keep
        self.journal = journal
        self.running = running
        self.on_bytes = on_bytes
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}

    # ---------------------------------------------------------------- reading

    def engines(self) -> list[str]:
        """Every engine with a folder here."""
        try:
            return sorted(e.name for e in os.scandir(self.image_dir)
                          if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []

    def images(self, engine: str, keep: int | None = None) -> list[p.ImageInfo]:
        """``engine``'s image folders, newest first, each with why retention keeps it."""
        folder = self.image_dir / engine
        try:
            entries = [e for e in os.scandir(folder) if not e.name.startswith(".")
                       and e.name != LATEST and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return []
        good = [folder_name(op) for op, _ in self.journal.captures(engine, dumped=True)]
        order = {name: i for i, name in enumerate(good)}  # the journal's: newest first
        infos = [p.ImageInfo(engine=engine, image=e.name, bytes=folder_bytes(Path(e.path)),
                             wall=e.stat(follow_symlinks=False).st_mtime,
                             dumped=e.name in order) for e in entries]
        infos.sort(key=lambda i: (-i.wall, i.image))
        self._mark_kept(engine, infos, order, self.keep if keep is None else keep)
        total = sum(i.bytes for i in infos)
        self._bytes[engine] = total
        if self.on_bytes is not None:
            self.on_bytes(engine, total)
        return infos

    def _mark_kept(self, engine: str, infos: list[p.ImageInfo], order: dict[str, int],
                   keep: int) -> None:
        try:
            latest = os.readlink(self.image_dir / engine / LATEST)
        except OSError:
            latest = None
        in_use = {folder_name(op) for op in self.running(engine)}
        dumped = sorted((i for i in infos if i.dumped), key=lambda i: order[i.image])
        newest_good = dumped[0].wall if dumped else None
        for i in dumped[:keep]:
            i.kept = "newest"
        attempts = [i for i in infos if not i.dumped and i.image not in in_use
                    and i.image != latest and (newest_good is None or i.wall > newest_good)]
        for i in attempts[:keep]:
            i.kept = "last attempt"
        for i in infos:
            if i.image == latest:
                i.kept = LATEST
            if i.image in in_use:
                i.kept = "in use"

    def images_bytes(self, engine: str) -> int:
        """The bytes ``engine``'s images take (counted once, kept until they change)."""
        known = self._bytes.get(engine)
        if known is None:
            folder = self.image_dir / engine
            known = self._bytes[engine] = folder_bytes(folder) if folder.is_dir() else 0
            if self.on_bytes is not None:
                self.on_bytes(engine, known)
        return known

    # ---------------------------------------------------------------- pruning

    def handle(self, cmd: p.ImagesCommand) -> p.ImagesReply:
        """``ckptctl images list|prune``: the request, answered."""
        engines = list(cmd.engines) or self.engines()
        keep = self.keep if cmd.keep is None else cmd.keep
        if not cmd.prune:
            return p.ImagesReply(images=[i for e in engines for i in self.images(e, keep)],
                                 keep=keep, image_dir=str(self.image_dir))
        removed = self.prune(engines, keep, dry_run=cmd.dry_run)
        gone = {(i.engine, i.image) for i in removed} if cmd.dry_run else set()
        stayed = [i for e in engines for i in self.images(e, keep)
                  if (i.engine, i.image) not in gone]
        return p.ImagesReply(images=stayed, removed=removed, keep=keep, dry_run=cmd.dry_run,
                             image_dir=str(self.image_dir))

    def prune(self, engines: Iterable[str], keep: int | None = None,
              dry_run: bool = False) -> list[p.ImageInfo]:
        """Remove the folders of ``engines`` retention does not keep; what went."""
        removed: list[p.ImageInfo] = []
        with self._lock:
            for engine in engines:
                going = [i for i in self.images(engine, keep) if i.kept is None]
                if going and not dry_run:
                    for info in going:
                        shutil.rmtree(self.image_dir / engine / info.image, ignore_errors=True)
                    self.images(engine, keep)  # counted again
                removed += going
        if removed and not dry_run:
            log.info("images: removed %d folder(s), %d bytes: %s", len(removed),
                     sum(i.bytes for i in removed),
                     ", ".join(f"{i.engine}/{i.image}" for i in removed))
        return removed

    def after_capture(self, engines: Iterable[str]) -> None:
        """After an operation that dumped ``engines``: prune them, on a thread of its own."""
        names = list(engines)
        for name in names:
            self._bytes.pop(name, None)
        if names:
            threading.Thread(target=self._prune_quietly, args=(names,), daemon=True,
                             name="image-retention").start()

    def _prune_quietly(self, engines: list[str]) -> None:
        try:
            self.prune(engines)
        except Exception:  # policy: retention never fails an operation; the log says why
            log.exception("images: pruning %s failed", ", ".join(engines))
