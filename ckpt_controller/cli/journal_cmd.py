"""``ckptctl journal compact|check|salvage``: the controller's journal kept small, checked, and
repaired after damage.

``compact`` asks the running controller to apply ``[journal]``'s retention now; ``check`` and
``salvage`` read the config's state directory themselves (``controller.journal_repair``):
``check`` says what SQLite's ``quick_check`` finds, ``salvage`` (the controller stopped)
copies what can be read into a new journal and keeps the damaged one beside it.
Neighbours: ``controller_cmds`` (the client), ``controller.journal_repair``, docs/journal.md.
"""

from __future__ import annotations

import argparse

from ckpt_controller.cli.common import EXIT_CODES, controller_client, waiting_notice
from ckpt_controller.cli.output import emit


def add_parser(sub) -> None:
    fmt = {"epilog": EXIT_CODES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    sp = sub.add_parser(
        "journal", help="the controller's journal: compact it now, check it, salvage it",
        description="The controller's journal ([journal] in its config). `compact` forgets "
                    "now what keep_days and keep_operations keep no longer (the controller "
                    "also does so when it starts and every hour): ended operations older "
                    "than keep_days or beyond the newest keep_operations, with their "
                    "records; never an engine's newest operation, its newest capture and "
                    "image, or a running one. `check` and `salvage` read the journal of a "
                    "config's state directory: a controller refuses to start on a damaged "
                    "one, and names them.", **fmt)
    jsub = sp.add_subparsers(dest="journal_command", metavar="COMMAND", required=True)
    jp = jsub.add_parser("compact", help="forget what [journal] keeps no longer, now", **fmt)
    jp.add_argument("--json", action="store_true", help="print one JSON document")
    jp.set_defaults(run=_compact)
    cp = jsub.add_parser("check", help="what SQLite's quick_check finds in the journal "
                                       "(exit 1 when it is damaged)", **fmt)
    cp.set_defaults(run=_check)
    vp = jsub.add_parser("salvage", help="copy what can be read into a new journal, keep the "
                                         "damaged one beside it (the controller stopped)",
                         **fmt)
    vp.set_defaults(run=_salvage)
    for p in (cp, vp):
        p.add_argument("--config", required=True, metavar="FILE",
                       help="the controller's TOML configuration (its state_dir)")


def _compact(args: argparse.Namespace) -> int:
    with controller_client(args, on_wait=waiting_notice) as c:
        reply = c.compact_journal()
    if args.json:
        emit("journal-compact", reply)
        return 0
    print(f"journal: forgot {reply.operations} operations and {reply.records} records in "
          f"{reply.duration_s:.2f}s (keep_days {reply.keep_days:g}, keep_operations "
          f"{reply.keep_operations})")
    return 0


def _journal_path(args: argparse.Namespace):
    from ckpt_controller.controller.config import load_config

    return load_config(args.config).state_dir / "journal.sqlite3"


def _check(args: argparse.Namespace) -> int:
    from ckpt_controller.controller.journal_repair import problems

    path = _journal_path(args)
    if not path.exists():
        print(f"{path}: no journal yet")
        return 0
    found = problems(path)
    if not found:
        print(f"{path}: ok")
        return 0
    print(f"{path}: damaged")
    for line in found[:50]:
        print(f"  {line}")
    print("`ckptctl journal salvage --config FILE` keeps every row that can still be read")
    return 1


def _salvage(args: argparse.Namespace) -> int:
    from ckpt_controller.controller.config import load_config
    from ckpt_controller.controller.journal_repair import salvage
    from ckpt_controller.controller.statedir import hold_lock, release_lock

    config = load_config(args.config)
    path = config.state_dir / "journal.sqlite3"
    if not path.exists():
        print(f"{path}: no journal to salvage")
        return 0
    held = hold_lock(config)  # a running controller refuses it: it must be stopped
    try:
        done = salvage(path)
    finally:
        release_lock(held)
    print(f"{path}: salvaged; the damaged journal is kept as {done['damaged_kept_as']}")
    for table, count in done["tables"].items():
        print(f"  {table}: {count['kept']} rows kept, {count['lost']} lost")
    return 0
