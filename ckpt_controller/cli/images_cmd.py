"""``ckptctl images list|prune``: the capture images the controller keeps on disk, per engine,
and ``[images] keep``'s retention of them (``controller.images``, docs/controller.md).

Neighbours: ``controller_cmds`` (the client it makes), ``output`` (the ``images``
document), ``common`` (tables, sizes, ages).
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from ckpt_controller.cli.common import (EXIT_CODES, age, arg_type, controller_client,
                                        human_bytes, table, waiting_notice)
from ckpt_controller.cli.output import emit
from ckpt_controller.values import COUNT

if TYPE_CHECKING:
    from ckpt_controller import protocol as p

#: the table's columns
COLUMNS = ("ENGINE", "IMAGE", "SIZE", "AGE", "DUMPED", "KEPT")


def add_parser(sub) -> None:
    fmt = {"formatter_class": argparse.RawDescriptionHelpFormatter, "epilog": EXIT_CODES}
    sp = sub.add_parser(
        "images", help="the capture images on disk: list them, prune what [images] keeps no "
                       "longer",
        description="Each operation whose hooks ran on an engine has a folder "
                    "<image_dir>/<engine>/<op>; a capture that dumped made an image there. "
                    "Retention ([images] keep, default 3) keeps per engine its newest KEEP "
                    "images, the one `latest` points at, those of operations running now, "
                    "and the folders of failed attempts since its newest image (at most "
                    "KEEP); the controller removes the rest after each capture, or now with "
                    "`prune`.", **fmt)
    isub = sp.add_subparsers(dest="images_command", metavar="COMMAND", required=True)
    lp = isub.add_parser("list", help="each engine's image folders, their size and why kept",
                         **fmt)
    pp = isub.add_parser("prune", help="remove the folders retention does not keep, now",
                         **fmt)
    pp.add_argument("--keep", type=arg_type(COUNT), metavar="N",
                    help="keep the newest N images of each engine (default: [images] keep)")
    pp.add_argument("--dry-run", action="store_true",
                    help="say what would be removed; remove nothing")
    for cp in (lp, pp):
        cp.add_argument("engines", nargs="*", metavar="ENGINE",
                        help="these engines (default: every engine with images)")
        cp.add_argument("--json", action="store_true", help="print one JSON document")
    lp.set_defaults(run=_images, prune=False, keep=None, dry_run=False)
    pp.set_defaults(run=_images, prune=True)


def _images(args: argparse.Namespace) -> int:
    with controller_client(args, on_wait=waiting_notice) as c:
        reply = c.images(args.engines or None, prune=args.prune, keep=args.keep,
                         dry_run=args.dry_run)
    if args.json:
        emit("images", reply)
        return 0
    print(images_table(reply.images) if reply.images else
          "no capture images" + (f" of {', '.join(args.engines)}" if args.engines else ""))
    if args.prune:
        verb = "would remove" if reply.dry_run else "removed"
        freed = human_bytes(sum(i.bytes for i in reply.removed))
        print(f"\n{verb} {len(reply.removed)} folder(s), {freed} (keep {reply.keep})"
              + "".join(f"\n  {i.engine}/{i.image} ({human_bytes(i.bytes)})"
                        for i in reply.removed))
    return 0


def images_table(images: list[p.ImageInfo], now: float | None = None) -> str:
    """The folders as a table, newest first per engine; KEPT says why retention keeps one
    (``-``: the next prune removes it)."""
    now = time.time() if now is None else now
    rows = [COLUMNS] + [(i.engine, i.image, human_bytes(i.bytes), age(now - i.wall),
                         "yes" if i.dumped else "no", i.kept or "-") for i in images]
    return table(rows)
