"""``ckptctl images list|prune|inspect``: the capture images the controller keeps on disk, per
engine, ``[images] keep``'s retention of them (``controller.images``, docs/controller.md), and
what one needs of its host (its manifest beside this host: ``controller.manifest``).

Neighbours: ``controller_cmds`` (the client it makes), ``output`` (the ``images``
document), ``common`` (tables, sizes, ages).
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from ckpt_controller.cli.common import (EXIT_CODES, age, arg_type, controller_client,
                                        human_bytes, table, waiting_notice)
from ckpt_controller.cli.output import emit, iso
from ckpt_controller.errors import UsageError
from ckpt_controller.values import COUNT

if TYPE_CHECKING:
    from ckpt_controller import protocol as p

#: the table's columns
COLUMNS = ("ENGINE", "IMAGE", "SIZE", "AGE", "DUMPED", "KEPT")


def add_parser(sub) -> None:
    fmt = {"formatter_class": argparse.RawDescriptionHelpFormatter, "epilog": EXIT_CODES}
    sp = sub.add_parser(
        "images", help="the capture images on disk: list them, prune what [images] keeps no "
                       "longer, inspect what one needs of its host",
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
    ip = isub.add_parser(
        "inspect", help="an image's manifest: what its restore needs, against this host",
        description="What the capture recorded of the host and the engine (CRIU, kernel, CPU, "
                    "the engine's files and packages, the model files, GPUs), beside what "
                    "this host has now: a restore of it here is refused (exit 2) where a "
                    "checked field differs, unless accepted (restore --accept FIELD,...).",
        **fmt)
    ip.add_argument("image", metavar="IMAGE",
                    help="the image's folder, or its operation id (ENGINE/OP_ID when two "
                         "engines have one): the controller says where its images are")
    ip.add_argument("--json", action="store_true", help="print one JSON document")
    ip.add_argument("-o", "--output", choices=("json",), help="json: as --json")
    ip.set_defaults(run=_inspect)


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


def _inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ckpt_controller.controller import manifest

    folder = Path(args.image)
    if folder.name == manifest.FILE:
        folder = folder.parent
    if not folder.is_dir():
        folder = _folder_of(args, args.image)
    found = manifest.read(folder)
    if found is None:
        raise UsageError(f"{folder} has no manifest ({manifest.FILE}): not an image a capture "
                         "dumped, or one from before manifests", folder=str(folder))
    now = manifest.here(found)
    diffs = manifest.differences(found, now)
    if args.json or args.output == "json":
        emit("image-manifest", {"folder": str(folder), "manifest": found, "here": now,
                                "differences": diffs, "restores_here": not diffs})
        return 0
    print(manifest_text(folder, found, now, diffs))
    return 0


def _folder_of(args: argparse.Namespace, image: str):
    """The folder of image ``[ENGINE/]OP_ID``, where the controller keeps its images."""
    from pathlib import Path

    engine, _, op = image.rpartition("/")
    with controller_client(args, on_wait=waiting_notice) as c:
        reply = c.images([engine] if engine else None)
    mine = [i for i in reply.images if i.image == op.replace("/", "_")]
    if len(mine) != 1 or reply.image_dir is None:
        raise UsageError(f"no image {image} " + ("(give ENGINE/OP_ID: " + ", ".join(
            i.engine for i in mine) + " have one)" if mine else "among the controller's images"),
            image=image)
    return Path(reply.image_dir) / mine[0].engine / mine[0].image


def manifest_text(folder, found, now: dict, diffs: list[dict]) -> str:
    """A manifest beside this host, as a person reads it."""
    from ckpt_controller.controller import manifest

    def show(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, list):
            return ",".join(map(str, value)) or "-"
        return str(value)

    wrong = {d["field"] for d in diffs}
    rows = [("FIELD", "IMAGE", "HERE", "")]
    for field in manifest.CHECKED:
        if field == "model":
            for path, digest in sorted((found.checked.get("model") or {}).items()):
                got = (now.get("model") or {}).get(path)
                rows.append((f"model {path}", show(digest)[:16], show(got)[:16],
                             "DIFFERS" if got != digest else ""))
        elif field == "cpu_isa":  # dozens of flags: their count, and what this CPU lacks
            want, got = found.checked.get(field) or [], now.get(field) or []
            lacks = sorted(set(want) - set(got))
            rows.append((field, f"{len(want)} extensions", f"{len(got)} extensions",
                         f"DIFFERS: lacks {','.join(lacks)}" if lacks else ""))
        elif field in found.checked:
            rows.append((field, show(found.checked[field])[:32], show(now.get(field))[:32],
                         "DIFFERS" if field in wrong else ""))
    info = found.info
    lines = [f"Image:     {folder}",
             f"Engine:    {found.engine} ({found.checked.get('engine_kind') or '-'}), captured "
             f"{iso(found.wall)} ({age(time.time() - found.wall)} ago) by operation "
             f"{found.image}, {human_bytes(int(info.get('image_bytes') or 0))}",
             f"Host:      {info.get('hostname') or '-'} (id {info.get('host_id') or '-'})",
             f"Command:   {' '.join(info.get('argv') or []) or '-'}", "", table(rows), ""]
    if diffs:
        fields = sorted(wrong)
        lines.append(f"Restores here: no: {'; '.join(manifest.describe(d) for d in diffs)} "
                     f"(restore --accept {','.join(fields)} to restore it anyway)")
    else:
        lines.append("Restores here: yes")
    return "\n".join(lines)

