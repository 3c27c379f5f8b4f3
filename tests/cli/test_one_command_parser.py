"""A command line that names its command builds only that command's module (``cli.COMMANDS``):
the table says what the modules really add, a line parses to what the whole tree parses it to,
and whatever the one-module tree cannot parse is parsed, and refused, by the whole tree."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from ckpt_controller import cli
from shape.test_light_imports import loaded_by


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def _plain(ns: argparse.Namespace) -> dict:
    """A parse's values, less the parser objects and functions (one per tree)."""
    return {k: v for k, v in vars(ns).items()
            if k not in ("root_parser", "command_parser", "run")}


def test_the_table_names_each_command_by_the_module_that_adds_it():
    whole = _commands(cli.build_parser())
    by_module = {m: _commands(cli.build_parser(m)) for m in cli.MODULES}
    assert [c for m in cli.MODULES for c in by_module[m]] == whole  # --help's order
    for module, commands in by_module.items():
        for command in commands:
            assert cli.COMMANDS.get(command, "completion") == module, command
    assert set(cli.COMMANDS) == set(whole) - {"completion"}


LINES = [
    ["status"], ["status", "-o", "wide", "vk"], ["--controller", "ipc:///x", "status", "--json"],
    ["prepare", "vk", "--drain", "keep", "--level", "2", "--controller", "tcp://h:1"],
    ["cycle", "--all", "--drain-timeout", "3"], ["history", "--limit", "5"],
    ["agent", "prepare", "--control", "ipc:///x", "--drain", "abort"],
    ["--etcd", "http://e:2379", "fleet", "migrate", "m0", "--to", "n2", "--level", "2"],
    ["fleet", "--etcd-prefix", "/p", "status", "-o", "json"],
    ["--etcd-prefix", "status", "fleet", "status"],  # a root option's value named as a command
    ["generate", "--api", "tcp://h:1", "--prompt-ids", "1,2", "--max-tokens", "4"], ["journal", "check", "--config", "/tmp/c.toml"],
]


@pytest.mark.parametrize("argv", LINES, ids=[" ".join(a) for a in LINES])
def test_a_line_parses_as_the_whole_tree_parses_it(argv):
    only = cli.named_module(argv)
    assert only is not None and only != "completion"
    mine, extra = cli.build_parser(only).parse_known_args(argv)
    whole, whole_extra = cli.build_parser().parse_known_args(argv)
    assert (_plain(mine), extra) == (_plain(whole), whole_extra)
    assert mine.run.__qualname__ == whole.run.__qualname__


@pytest.mark.parametrize("argv", [["--help"], ["-h", "status"], ["completion", "bash"],
                                  ["statu"], ["--", "status"], [], ["--version"]])
def test_these_build_the_whole_tree(argv):
    assert cli.named_module(argv) is None


def _main(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_what_one_module_cannot_parse_the_whole_tree_parses_or_refuses():
    # an abbreviated root option takes "status" as its value: the command is "prepare"
    code, out, _ = _main(["--contr", "status", "prepare", "--help"])
    assert code == 0 and out.startswith("usage: ckptctl prepare"), out
    # the root's help lists every command, wherever --help stands before it
    code, out, _ = _main(["-h", "status"])
    assert code == 0 and "fleet" in out and "completion" in out
    # a usage error is said once, by the command's own usage, with its JSON document
    code, out, err = _main(["status", "--nope", "--json"])
    assert code == 2 and err.count("error:") == 1 and "usage: ckptctl status" in err
    assert out.count('"kind": "error"') == 1 and "--nope" in out
    code, _, err = _main(["fleet", "migrat"])
    assert code == 2 and "did you mean 'migrate'?" in err


def test_a_fleet_command_loads_no_other_command():
    code = ("import contextlib, io\nfrom ckpt_controller.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        main(['fleet', 'migrate', '--help'])\n"
            "    except SystemExit as e:\n        assert e.code == 0, e.code")
    modules = loaded_by(code)
    assert "ckpt_controller.cli.fleet_cmd" in modules
    others = {f"ckpt_controller.cli.{m}" for m in cli.MODULES} - {
        "ckpt_controller.cli.fleet_cmd"}
    assert sorted(modules & others) == []
