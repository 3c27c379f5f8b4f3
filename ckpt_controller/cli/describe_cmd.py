"""``ckptctl describe ENGINE``: one engine in full, as ``kubectl describe`` shows one object.

Its state and since when (and why, when FAILED), the agent's own figures, its links (the
agent's endpoints, whether it answered, the operation holding it), its last operations, its
last error, the hooks of its newest operation, and its capture images: three requests to the
controller (``status``, ``history``, ``images``), nothing new on the wire. ``--json`` prints
one ``describe`` document (docs/json.md).

Neighbours: ``images_cmd`` (the images' table), ``common``, ``output``.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from ckpt_controller.cli.common import (EXIT_CODES, age, controller_client, human_bytes,
                                        waiting_notice)
from ckpt_controller.cli.output import emit, iso

if TYPE_CHECKING:
    from ckpt_controller import protocol as p

#: the operations shown
OPERATIONS = 5
#: the records that say an engine's operation failed, and why
ERROR_RECORDS = ("error", "hook_failure")


def add_parser(sub) -> None:
    sp = sub.add_parser(
        "describe", help="one engine in full: state and why, links, last operations, last "
                         "error, hooks, images",
        description="One engine as the controller knows it: its state since when (and why, "
                    "when FAILED), its agent's figures, its links, its last "
                    f"{OPERATIONS} operations, its last error, the hooks of its newest "
                    "operation and its capture images.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("engine", metavar="ENGINE", help="the engine's name")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.set_defaults(run=_describe)


def gather(c, engine: str) -> dict[str, Any]:
    """What ``describe`` shows of ``engine``, asked of the controller ``c``."""
    (view,) = c.status([engine]).engines
    hist = c.history(engine=engine, limit=OPERATIONS)
    records = sorted(hist.records, key=lambda r: r.seq)
    errors = [r for r in records if r.type in ERROR_RECORDS]
    newest = hist.operations[0].op_id if hist.operations else None
    return {"engine": view, "operations": hist.operations,
            "last_error": errors[-1] if errors else None,
            "hooks": [r for r in records if r.type == "hook" and r.op_id == newest],
            "images": c.images([engine]).images if view.moved_to is None else []}


def _describe(args: argparse.Namespace) -> int:
    from ckpt_controller.cli.controller_cmds import STATUS_NOTICE_S

    with controller_client(args, on_wait=waiting_notice, notice_after_s=STATUS_NOTICE_S) as c:
        found = gather(c, args.engine)
    view = found["engine"]
    code = 0 if view.reachable or view.moved_to else 4  # as ``status``
    if args.json:
        emit("describe", found)
    else:
        print(describe_text(found))
    return code


def describe_text(found: dict[str, Any], now: float | None = None) -> str:
    """The human page: one ``Field: value`` per line, sections indented under their title."""
    from ckpt_controller.cli.images_cmd import images_table
    from ckpt_controller.vocab import CheckpointState

    now = time.time() if now is None else now
    v: p.EngineView = found["engine"]
    s = v.status
    lines = [f"Name:          {v.engine}", f"Kind:          {v.kind}"]
    if v.moved_to is not None:
        lines.append(f"State:         MOVED to node {v.moved_to} by operation {v.moved_by} "
                     "(not driven here)")
    elif s is None:
        lines.append(f"State:         UNREACHABLE ({v.error.message if v.error else 'no answer'})")
    else:
        t = s.last_transition
        since = "" if t is None else f" since {iso(t.wall)} ({age(now - t.wall)} ago)"
        lines.append(f"State:         {s.state}{since}")
        if s.state == CheckpointState.FAILED:
            lines.append(f"Reason:        {t.reason if t is not None and t.reason else '-'}"
                         + (f" (operation {v.last_op.op_id})" if v.last_op else ""))
            lines.append(f"Recover:       ckptctl restore {v.engine}")
        elif t is not None and t.reason:
            lines.append(f"Last change:   {t.source} -> {t.dest} ({t.trigger}): {t.reason}")
        lines += [f"Generation:    {s.generation}",
                  f"PID:           {s.pid}" + (f" (restored from an image, incarnation "
                                               f"{s.incarnation})" if s.restored_from_image
                                               else ""),
                  f"In flight:     {s.in_flight} (kept {s.kept})",
                  f"API:           {s.api or '-'}" + (f" ({s.api_detail})" if s.api_detail
                                                     else ""),
                  "Memory:        " + (", ".join(
                      f"{tag} {human_bytes(n)}" + (" (released)" if tag in s.released_tags
                                                   else "")
                      for tag, n in s.registered_bytes.items()) or "-")]
    lines += ["Links:",
              f"  control:     {v.control} ("
              + ("answered" if v.reachable else "no answer" if v.moved_to is None else "moved")
              + ")"]
    if s is not None:
        lines += [f"  {name + ':':<12} {where}" for name, where in sorted(s.endpoints.items())
                  if name != "control"]
    lines.append(f"  held by:     {v.holder or '-'}")
    if v.unsettled_by:
        lines.append(f"  unsettled:   since operation {v.unsettled_by} lost contact")
    lines.append("Last operations:" + ("" if found["operations"] else " none"))
    for op in found["operations"]:
        took = f" in {op.duration_s:.2f}s" if op.duration_s is not None else ""
        lines.append(f"  {iso(op.wall)}  {op.op_id}  {op.kind}  {op.status}{took}")
    err = found["last_error"]
    if err is None:
        lines.append("Last error:    none")
    else:
        what = err.data.get("kind") or err.type
        lines.append(f"Last error:    {iso(err.wall)} in operation {err.op_id}: {what}: "
                     f"{err.data.get('message', '')}")
    lines.append("Hooks (newest operation):" + ("" if found["hooks"] else " none ran"))
    for h in found["hooks"]:
        d = h.data
        end = "timed out" if d.get("timed_out") else f"exit {d.get('exit_code')}"
        lines.append(f"  {d.get('point')}  {d.get('path')}  {end}  "
                     f"{float(d.get('duration_s') or 0):.2f}s")
    images = found["images"]
    total = human_bytes(v.images_bytes) if v.images_bytes is not None else "-"
    lines.append(f"Images:        {len(images)} ({total})")
    if images:
        lines += ["  " + row for row in images_table(images, now).splitlines()]
    return "\n".join(lines)
