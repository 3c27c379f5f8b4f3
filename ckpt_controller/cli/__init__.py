"""``ckptctl``: the command line. Human output by default, ``--json`` for scripts.

Exit codes (also in ``ckptctl --help``): 0 success; 1 operation failed or rolled back;
2 usage or configuration error; 3 deadline passed; 4 unreachable. They come from
``CkptError.exit_code``. Each ``*_cmds`` module adds its subcommands and a ``run`` for each;
the work itself is done by the agent, engine and controller packages, imported by the ``run``
that needs them: building the parser (``ckptctl --help``, a usage error) loads no transport,
no protocol, no engine and no torch (``tests/shape/test_light_imports.py``).

A command line that names its command (``ckptctl fleet migrate ...``) loads and builds only
that command's module (``COMMANDS``): every ``ckptctl`` start pays for one module, not for
all of them (0.04 s less here). Everything else (``--help`` at the top, ``completion``,
a word that is no command) builds the whole tree, and so does any command line the one-module
parser cannot parse: each parse ends as the whole tree would end it (``_run``). The process
(``entry``) hands its objects to no last collection at exit (``gc.freeze``).
Neighbours: ``cli.common`` and the ``*_cmds`` modules, ``endpoints`` (the default endpoint).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ckpt_controller.cli.common import (
    EXIT_CODES,
    add_curve_client_args,
    add_etcd_args,
    human_bytes,
    parse_bytes,
)
from ckpt_controller.endpoints import default_controller_endpoint
from ckpt_controller.errors import CkptError
from ckpt_controller.version import __version__

__all__ = ["build_parser", "entry", "human_bytes", "main", "parse_bytes"]

#: the exit code when stdout's reader went away (128 + SIGPIPE, as a shell reports it)
EXIT_PIPE = 141

#: the modules that add the commands (``add_parser`` or ``add_parsers``), in the order
#: ``ckptctl --help`` lists them
MODULES = ("controller_cmds", "images_cmd", "journal_cmd", "describe_cmd", "agent_cmds",
           "engine_cmds", "demo", "drill_cmd", "keys_cmd", "lifecycle_cmd", "fleet_cmd",
           "completion")
#: each command and the module that adds it: a command line naming one builds only that
#: module's parsers (``completion`` is not here: it walks the whole tree);
#: ``tests/cli/test_one_command_parser.py`` holds this to what the modules add
COMMANDS = {
    **dict.fromkeys(("serve", "prepare", "capture", "restore", "cycle", "rollback", "status",
                     "history", "watch"), "controller_cmds"),
    "images": "images_cmd", "journal": "journal_cmd", "describe": "describe_cmd",
    "agent": "agent_cmds", **dict.fromkeys(("engine", "generate", "load"), "engine_cmds"),
    "demo": "demo", "drill": "drill_cmd", "keys": "keys_cmd", "lifecycle": "lifecycle_cmd",
    "fleet": "fleet_cmd",
}


def default_controller() -> str:
    return default_controller_endpoint()


class _Parser(argparse.ArgumentParser):
    """argparse's parser, for ``ckptctl`` and (``add_subparsers`` makes its own kind) every
    subcommand: a usage error of a command line with ``--json`` also prints an ``error``
    document on stdout (docs/json.md), before argparse's usage and exit 2."""

    #: set by ``main`` for the command line it parses
    json_errors = False
    #: set by ``_run`` while it tries a tree of one command's module: an error there is
    #: not said, the whole tree parses the line again (``_Whole``)
    partial = False

    def error(self, message: str):
        if _Parser.partial:
            raise _Whole(message)
        message = _with_nearest(message)
        if _Parser.json_errors:
            import json

            from ckpt_controller.cli.output import SCHEMA_VERSION

            print(json.dumps({"version": SCHEMA_VERSION, "kind": "error", "error": {
                "kind": "UsageError", "message": f"{self.prog}: {message}", "exit_code": 2,
                "details": {}}}), flush=True)
        super().error(message)


class _Whole(Exception):
    """The tree of one command's module could not parse a command line: the whole tree
    parses it, and says what is wrong with it if anything is."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """``ckptctl``'s parser: every command, or with ``only`` (a module of ``MODULES``) that
    module's commands alone, with the same root options."""
    parser = _root()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in (only,) if only else MODULES:
        module = importlib.import_module(f"ckpt_controller.cli.{name}")
        (getattr(module, "add_parsers", None) or module.add_parser)(sub)
    parser.set_defaults(root_parser=parser)  # what ``completion`` walks
    _conventions(parser)
    return parser


def _root() -> argparse.ArgumentParser:
    """The root parser and its options (those every command takes too), no commands."""
    parser = _Parser(
        prog="ckptctl",
        description="Drive LLM inference engines through checkpoint/restore: "
                    "RUNNING -> PREPARING -> PREPARED -> RESTORING -> RUNNING.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ckptctl {__version__}")
    parser.add_argument("--controller", metavar="ENDPOINT", default=default_controller(),
                        help="the controller's endpoint (default: $CKPT_CONTROLLER, else "
                             "ipc://<runtime dir>/controller.sock)")
    add_curve_client_args(parser, "controller")
    add_etcd_args(parser)
    return parser


def named_module(argv: Sequence[str]) -> str | None:
    """The module of the command ``argv`` names (``COMMANDS``): its first word that is
    neither an option of the root nor the value of one; None when that word is no command
    (or the root's ``--help`` comes before it), which builds the whole tree."""
    takes = {o for a in _root()._actions if a.nargs != 0 for o in a.option_strings}
    words = iter(argv)
    for word in words:
        if word in ("-h", "--help") or word == "--":
            return None
        if word in takes:
            next(words, None)
        elif not word.startswith("-"):
            return COMMANDS.get(word)
    return None


def _conventions(root: argparse.ArgumentParser) -> None:
    """What every command gets from the root, as kubectl's users expect: the global options
    (``--controller``, ``--etcd``...) after the command too (``ckptctl status --controller
    X``; left out of each command's own help), ``-o json`` wherever ``--json`` is, a
    command's name as a plain word in messages, and its own parser named in the namespace (an
    unknown flag is answered with that command's usage: ``_run``)."""
    shared = [a for a in root._actions if a.option_strings and a.default is not argparse.SUPPRESS
              and a.dest not in ("help", "version")]

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                named = list(action.choices.items())  # the same dict argparse looks names up in
                action.choices.clear()
                action.choices.update((str(k), v) for k, v in named)
                for child in {id(c): c for c in action.choices.values()}.values():
                    walk(child)
        opts = parser._option_string_actions
        if "--json" in opts and "-o" not in opts and "--output" not in opts:
            parser.add_argument("-o", "--output", choices=["json"],
                                help="json: as --json (kubectl's spelling)")
        if parser is not root:
            for g in shared:
                if not any(o in parser._option_string_actions for o in g.option_strings):
                    parser.add_argument(*g.option_strings, dest=g.dest, type=g.type,
                                        metavar=g.metavar, default=argparse.SUPPRESS,
                                        help=argparse.SUPPRESS)
            parser.set_defaults(command_parser=parser)

    walk(root)


def _with_nearest(message: str) -> str:
    """argparse's message and, for a mistyped choice, the nearest one: ``did you mean
    'prepare'?`` (the choices are plain words: ``_conventions`` names commands so)."""
    import difflib
    import re

    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m:
        words = re.findall(r"'([^']*)'", m.group(2))
        near = difflib.get_close_matches(m.group(1), words, n=1, cutoff=0.6)
        if near:
            message += f"; did you mean '{near[0]}'?"
    return message


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args, extra = parser.parse_known_args(argv)
    if extra:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def entry() -> int:
    """The ``ckptctl`` process (the console script, ``python -m ckpt_controller``): ``main``,
    then everything the command made is moved out of the cyclic collector's sight
    (``gc.freeze``), so the interpreter's exit does not walk it all once more (0.02 s of a
    fleet command's exit here). Only here: ``main`` may be called many times in a process
    that goes on (a test, another program)."""
    code = main()
    import gc

    gc.freeze()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, where a reader that went away is still caught
    except BrokenPipeError:
        # policy: stdout's reader went away (`ckptctl status | head -1`): end quietly with
        # 141, as a shell reports a command that SIGPIPE ended; nothing more goes to the pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    return code


def _run(argv: Sequence[str] | None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_errors = "--json" in words or any(
        a in ("-o", "--output") and b == "json" for a, b in zip(words, words[1:])) or any(
        w in ("-ojson", "--output=json") for w in words)
    # --help, a usage error: argparse's SystemExit; a flag the command does not know is
    # answered with that command's usage, not the root's
    args = None
    only = named_module(words)
    if only is not None:
        try:
            _Parser.partial = True
            args = _parse(build_parser(only), argv)
        except _Whole:  # policy: the whole tree parses it again and says why not
            args = None
        finally:
            _Parser.partial = False
    if args is None:
        args = _parse(build_parser(), argv)
    if getattr(args, "output", None) == "json":
        args.json = True
    try:
        return args.run(args)
    except CkptError as err:
        if getattr(args, "json", False):
            from ckpt_controller.cli.output import emit_error

            emit_error(err)
        if getattr(args, "log_format", None) == "json":  # stderr stays JSON lines
            from ckpt_controller.cli.logsetup import fatal_line

            print(fatal_line(f"{err.kind}: {err}"), file=sys.stderr)
        else:
            print(f"ckptctl: {err.kind}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
