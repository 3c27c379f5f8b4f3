"""ckptctl as scripts run it: a real process, --json on stdout, documented exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_controller.cli import parse_bytes
from support.cli import CKPTCTL, StreamedLines, ckptctl
from support.config import engines_toml
from support.net import ipc_connections, wait_connected
from support.timing import scaled, wait_until


@pytest.fixture
def engine(spawn_engine):
    return spawn_engine("cli", weights_mib=8, kv_mib=8, step_s=0.01)


def test_help_version_and_usage_errors():
    out = ckptctl("--help")
    assert out.returncode == 0 and "exit codes" in out.stdout and "agent" in out.stdout
    out = ckptctl("--version")
    from ckpt_controller import __version__

    assert out.returncode == 0 and out.stdout.split() == ["ckptctl", __version__]
    # the installed console script is the same program
    script = Path(sys.executable).parent / "ckptctl"
    installed = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                               timeout=scaled(60))
    assert installed.returncode == 0 and installed.stdout == out.stdout
    for bad in (["agent", "prepare"],  # --control missing
                ["agent", "prepare", "--control", "ipc:///x", "--level", "7"],
                ["agent", "prepare", "--control", "ipc:///x", "--level", "1", "--tags", "a"],
                ["agent", "prepare", "--control", "ipc:///x", "--budget", "lots"],
                ["agent", "prepare", "--control", "ipc:///x", "--deadline", "-1"],
                ["frobnicate"]):
        out = ckptctl(*bad)
        assert out.returncode == 2, (bad, out.stderr)
        assert "usage:" in out.stderr


def test_a_reader_that_went_away_ends_ckptctl_quietly():
    """stdout a pipe nobody reads any more (`ckptctl status | head -1` after head ended): exit
    141, as a shell reports a command ended by SIGPIPE, and no traceback on stderr."""
    for args in (["completion", "bash"], ["completion", "zsh"]):
        read, write = os.pipe()
        os.close(read)  # every write to the pipe now fails with EPIPE
        try:
            out = subprocess.run([*CKPTCTL, *args], stdout=write,
                                 stderr=subprocess.PIPE, text=True, timeout=scaled(60))
        finally:
            os.close(write)
        assert out.returncode == 141, (args, out.stderr)
        assert out.stderr == "", (args, out.stderr)


def test_bad_endpoint_is_a_usage_error_not_a_hang():
    out = ckptctl("agent", "status", "--control", "http://nope", "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout)["error"]["kind"] in {"ConfigError", "UsageError"}


def test_unreachable_agent_exits_4_with_json(ipc_dir):
    out = ckptctl("agent", "status", "--control", f"ipc://{ipc_dir}/none.sock", "--timeout",
                  "0.2", "--json")
    assert out.returncode == 4
    err = json.loads(out.stdout)["error"]
    assert err["kind"] == "UnreachableError" and err["details"]["attempts"] >= 1


def test_a_whole_cycle_from_the_command_line(engine):
    ctl = ["--control", engine.control, "--json"]
    status = json.loads(ckptctl("agent", "status", *ctl).stdout)
    assert status["state"] == "running" and status["registered_bytes"]["weights"] > 0
    out = ckptctl("agent", "prepare", *ctl, "--drain", "keep", "--level", "2", "--op-id", "c1")
    assert out.returncode == 0, out.stderr
    prep = json.loads(out.stdout)
    assert prep["state"] == "prepared" and prep["op_id"] == "c1"
    assert prep["memory"]["tensor_bytes"] > 0
    # the same op id returns the same result instead of preparing again
    again = json.loads(ckptctl("agent", "prepare", *ctl, "--level", "2", "--op-id", "c1").stdout)
    assert again == prep
    wrong = ckptctl("agent", "prepare", *ctl, "--op-id", "c2")
    assert wrong.returncode == 2
    assert json.loads(wrong.stdout)["error"]["details"]["allowed"] == ["restore", "rollback", "fail"]
    out = ckptctl("agent", "restore", *ctl)
    assert out.returncode == 0 and json.loads(out.stdout)["generation"] == 1
    human = ckptctl("agent", "status", "--control", engine.control)
    assert human.returncode == 0
    header, row = human.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "STATE", "GEN", "IN-FLIGHT", "PID", "HELD-BY", "LAST-OP",
                              "AGE"]
    assert row.split()[:3] == ["cli", "running", "1"]


def test_failed_prepare_exits_1_and_deadline_exits_3(engine):
    ctl = ["--control", engine.control, "--json"]
    out = ckptctl("agent", "prepare", *ctl, "--level", "2", "--budget", "1MiB")
    assert out.returncode == 1
    err = json.loads(out.stdout)["error"]
    assert err["kind"] == "ResidualOverBudgetError" and err["details"]["rolled_back"] is True
    engine.submit("slow", 100_000)
    out = ckptctl("agent", "prepare", *ctl, "--drain", "wait", "--deadline", "0.3")
    assert out.returncode == 3
    err = json.loads(out.stdout)["error"]
    assert err["kind"] == "DeadlineError" and err["details"]["state"] == "running"
    # the deadline did not abort the request: it is still running
    status = json.loads(ckptctl("agent", "status", *ctl).stdout)
    assert status["in_flight"] == 1


def test_watch_prints_events(engine):
    """Each event is printed as it happens (a line of JSON, flushed: a pipe gets it at once);
    watch runs until interrupted (exit 130), or for ``--duration`` (exit 0)."""
    before = ipc_connections(engine.pid, engine.control)
    watch = subprocess.Popen([*CKPTCTL, "agent", "watch",
                              "--control", engine.control, "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed = StreamedLines(watch.stdout)

    def changes() -> list[dict]:
        events = [json.loads(line) for line in list(printed.lines)]
        return [e for e in events if e["event"] == "state_changed"]

    try:
        wait_connected(engine.pid, engine.control, before)  # watch is there and subscribing
        assert ckptctl("agent", "prepare", "--control", engine.control, "--level", "0").returncode == 0
        assert ckptctl("agent", "rollback", "--control", engine.control, "--reason", "drill").returncode == 0
        # however long the two commands took, watch is still running and has printed all four
        wait_until(lambda: len(changes()) >= 4, 20, "the four state changes printed")
        assert watch.poll() is None
    finally:
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=scaled(20))
    printed.join()
    assert watch.returncode == 130, err
    dests = [e["transition"]["dest"] for e in changes()]
    assert dests == ["preparing", "prepared", "restoring", "running"]
    rollback = [e for e in changes() if e["transition"]["trigger"] == "rollback"]
    assert rollback[0]["transition"]["reason"].endswith("drill")
    timed = ckptctl("agent", "watch", "--control", engine.control, "--duration", "0.5",
                    "--json")
    assert timed.returncode == 0 and timed.stdout == "", timed.stderr


def _agent_state(control: str) -> str:
    return json.loads(ckptctl("agent", "status", "--control", control, "--json").stdout)["state"]


def test_ctrl_c_of_an_agent_operation_says_it_goes_on(engine):
    """Ctrl-C while ``agent prepare`` waits on a drain: exit 130 and a word on stderr, as the
    controller's commands say it (it ended silently): the agent goes on with the operation,
    named by its op id, and ``agent status`` shows where it got; the same op id again then
    returns its result. With --json, as the controller's commands: nothing on stdout."""
    prepare = [*CKPTCTL, "agent", "prepare", "--control",
               engine.control, "--drain", "wait", "--drain-timeout", "2", "--on-deadline",
               "abort", "--level", "0"]
    for op, json_flag in (("int-a", []), ("int-b", ["--json"])):
        engine.submit(f"slow-{op}", 100_000)  # in flight until the drain's deadline aborts it
        wait_until(lambda: json.loads(ckptctl("agent", "status", "--control", engine.control,
                                              "--json").stdout)["in_flight"] == 1, 10,
                   "the request in flight")
        with subprocess.Popen([*prepare, "--op-id", op, *json_flag], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as run:
            err = StreamedLines(run.stderr)
            try:
                if json_flag:  # no progress with --json: the agent says when it drains
                    wait_until(lambda: _agent_state(engine.control) == "preparing", 20,
                               "the agent draining")
                else:
                    wait_until(lambda: any("running -> preparing" in line
                                           for line in err.lines), 20, "the drain begun")
                run.send_signal(signal.SIGINT)
                assert run.wait(timeout=scaled(20)) == 130
            finally:
                run.kill()
            out = run.stdout.read()
            said = "".join(err.join())
        assert (f"interrupted: operation {op} goes on in the agent; follow it with "
                f"`ckptctl agent status --control {engine.control}`") in said, said
        assert "the same --op-id again waits for its result" in said, said
        assert "Traceback" not in said, said
        assert out == "", out  # as `ckptctl cycle --json`: no document for Ctrl-C
        # it went on: the drain's deadline aborted the request and the prepare ended
        wait_until(lambda: _agent_state(engine.control) == "prepared", 20, "the prepare done")
        again = ckptctl("agent", "prepare", "--control", engine.control, "--op-id", op,
                        "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["drain"]["aborted"] == 1
        assert ckptctl("agent", "restore", "--control", engine.control).returncode == 0


@pytest.mark.parametrize("text,value", [("1024", 1024), ("512MiB", 512 << 20), ("2GiB", 2 << 30),
                                        ("1.5 KiB", 1536), ("3GB", 3 * 10**9)])
def test_sizes(text, value):
    assert parse_bytes(text) == value


def test_flags_take_vocabulary_words_and_say_them_as_before():
    from ckpt_controller.cli import build_parser
    from ckpt_controller.vocab import DrainMode, Escalation, OperationKind, ReleaseLevel

    parse = build_parser().parse_args
    args = parse(["agent", "prepare", "--control", "ipc:///x", "--drain", "keep",
                  "--on-deadline", "fail", "--level", "2"])
    assert (args.drain, args.on_deadline, args.level) == ("keep", "fail", 2)
    assert args.drain is DrainMode.KEEP and args.on_deadline is Escalation.FAIL
    assert args.level is ReleaseLevel.DISCARD
    from ckpt_controller.cli.common import prepare_flags

    flags = prepare_flags(parse(["agent", "prepare", "--control", "ipc:///x"]), False)
    assert flags.drain is DrainMode.WAIT and flags.on_deadline is Escalation.ABORT
    args = parse(["cycle", "--all", "--drain", "abort", "--level", "0"])
    assert args.op is OperationKind.CYCLE and args.drain is DrainMode.ABORT
    assert args.level is ReleaseLevel.NOTHING
    args = parse(["drill", "a", "--cycles", "1", "--report", "r", "--drain", "keep"])
    assert args.drain is DrainMode.KEEP
    # what a person reads did not change: the wire words, in --help and in refusals
    out = ckptctl("agent", "prepare", "--help")
    assert "{wait,abort,keep}" in out.stdout and "{abort,keep,fail}" in out.stdout
    assert "{0,1,2}" in out.stdout
    for flag, value, said in (
            ("--drain", "nope", "invalid choice: 'nope' (choose from 'wait', 'abort', 'keep')"),
            ("--on-deadline", "x", "invalid choice: 'x' (choose from 'abort', 'keep', 'fail')"),
            ("--level", "7", "invalid choice: 7 (choose from 0, 1, 2)"),
            ("--level", "one", "invalid int value: 'one'")):
        out = ckptctl("agent", "prepare", "--control", "ipc:///x", flag, value)
        assert out.returncode == 2 and f"argument {flag}: {said}" in out.stderr, out.stderr


def _help_pages():
    """(the command's words, its parser) for ckptctl and every subcommand under it."""
    import argparse

    from ckpt_controller.cli import build_parser

    def walk(parser, words):
        yield words, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*words, name])
    return list(walk(build_parser(), ["ckptctl"]))


def test_every_flag_has_help_and_every_page_one_exit_code_block():
    import argparse

    from ckpt_controller.cli.common import EXIT_CODES_HEADING

    pages = _help_pages()
    assert len(pages) > 30  # the walk found the subcommands
    for words, parser in pages:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            # a deprecated name is hidden (SUPPRESS), and says so when used
            assert action.help, f"{' '.join(words)} {action.option_strings or action.dest}"
        text = parser.format_help()
        assert text.count(EXIT_CODES_HEADING) == 1, (words, text)
    # hidden: the deprecated names, and the global options each command takes again after
    # its name (``ckptctl status --controller X``), listed once, on the root's page
    root = {o for a in pages[0][1]._actions for o in a.option_strings}
    hidden = [a for _, parser in pages for a in parser._actions
              if a.help == argparse.SUPPRESS and a.option_strings[0] not in root]
    assert sorted(a.option_strings[0] for a in hidden) == ["--load", "--load-seconds"]


def test_vocabulary_choices_come_from_the_vocab_enums():
    """A flag that takes a drain mode, an escalation, a level or any other ``vocab`` word
    lists the enum's values (``common.word_arg``) and parses to its member, so a word added to
    or renamed in ``vocab`` reaches ``--help``, completion and the parsed value at once."""
    import enum

    from ckpt_controller import vocab

    words = {frozenset(str(m.value) for m in e): e for e in vars(vocab).values()
             if isinstance(e, type) and issubclass(e, enum.Enum) and e.__module__ == vocab.__name__}
    seen = []
    for page, parser in _help_pages():
        for action in parser._actions:
            if not action.option_strings or not action.choices:
                continue
            kind = words.get(frozenset(str(c) for c in action.choices))
            where = (" ".join(page), action.option_strings[-1])
            if kind is None:
                continue
            seen.append(where)
            assert list(action.choices) == [m.value for m in kind], where
            assert all(action.type(str(m.value)) is m for m in kind), where
    assert ("ckptctl prepare", "--drain") in seen and ("ckptctl cycle", "--on-deadline") in seen
    assert ("ckptctl agent prepare", "--level") in seen and ("ckptctl drill", "--drain") in seen
    assert ("ckptctl fleet migrate", "--drain") in seen


def test_drill_takes_load_flag_names_and_old_ones_warn(capsys):
    from ckpt_controller.cli import build_parser

    parse = build_parser().parse_args
    args = parse(["drill", "a", "--cycles", "2", "--report", "r", "--rate", "4",
                  "--duration", "1.5"])
    assert (args.rate, args.duration) == (4.0, 1.5)
    assert capsys.readouterr().err == ""
    args = parse(["drill", "a", "--cycles", "2", "--report", "r", "--load", "4",
                  "--load-seconds", "1.5"])
    assert (args.rate, args.duration) == (4.0, 1.5)
    err = capsys.readouterr().err
    assert "--load is deprecated" in err and "use --rate" in err
    assert "--load-seconds is deprecated" in err and "use --duration" in err
    assert "--load" not in ckptctl("drill", "--help").stdout
    out = ckptctl("drill", "a", "--cycles", "1", "--report", "r", "--load", "0")
    assert out.returncode == 2 and "--load" in out.stderr


def test_agent_prepare_drill_and_cycle_prepare_alike(tmp_path):
    """No flags: ``agent prepare`` and ``drill`` use the controller's built-in defaults, the
    ones a ``cycle`` gets from a controller whose file has no [defaults]; a flag wins in
    each."""
    from ckpt_controller.cli import build_parser
    from ckpt_controller.cli.common import prepare_flags
    from ckpt_controller.controller.config import load_config
    from ckpt_controller.vocab import DrainMode, Escalation, ReleaseLevel

    config = tmp_path / "c.toml"
    config.write_text(f'[controller]\nendpoint = "ipc://{tmp_path}/c"\n'
                      f'state_dir = "{tmp_path}/state"\n'
                      + engines_toml(("e", f"ipc://{tmp_path}/e")))
    cfg = load_config(config)
    parse = build_parser().parse_args
    cycle = prepare_flags(parse(["cycle", "e"]), controller=True)
    assert (cycle.drain, cycle.level, cycle.on_deadline, cycle.drain_timeout_s) == \
        (None, None, None, None)  # the controller decides
    applied = cfg.prepare_defaults("e")
    expected = (applied.drain, applied.level, applied.on_deadline, applied.tags,
                cfg.deadlines.drain)
    assert expected == (DrainMode.WAIT, ReleaseLevel.DISCARD, Escalation.ABORT, None, 30.0)
    agent = prepare_flags(parse(["agent", "prepare", "--control", "ipc:///x"]), False)
    drill = prepare_flags(parse(["drill", "e", "--cycles", "1", "--report", "r"]), False)
    for got in (agent, drill):
        assert (got.drain, got.level, got.on_deadline, got.tags,
                got.drain_timeout_s) == expected
    for argv in (["agent", "prepare", "--control", "ipc:///x"],
                 ["drill", "e", "--cycles", "1", "--report", "r"], ["cycle", "e"]):
        got = prepare_flags(parse([*argv, "--drain", "keep", "--level", "1"]),
                            argv[0] == "cycle")
        assert (got.drain, got.level) == (DrainMode.KEEP, ReleaseLevel.OFFLOAD)
    tags = prepare_flags(parse(["agent", "prepare", "--control", "ipc:///x", "--tags",
                                "kv_cache"]), False)
    assert (tags.level, tags.tags) == (None, ["kv_cache"])


def test_the_ckptctl_process_spares_its_exit_the_last_collection():
    """The console script and ``python -m ckpt_controller`` run ``cli.entry``: ``main``, then
    ``gc.freeze`` (the interpreter's exit does not walk every object once more); ``main``
    alone, as a test or another program calls it, leaves the collector as it was."""
    import tomllib

    from support import ROOT

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ckptctl"] == "ckpt_controller.cli:entry"
    assert "sys.exit(entry())" in (ROOT / "ckpt_controller" / "__main__.py").read_text()
    code = ("import contextlib, gc, io, sys\nfrom ckpt_controller import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert cli.main(['completion', 'bash']) == 0\n"
            "assert gc.get_freeze_count() == 0, gc.get_freeze_count()\n"
            "sys.argv = ['ckptctl', 'completion', 'bash']\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    assert cli.entry() == 0\n"
            "assert 'complete -F _ckptctl ckptctl' in out.getvalue()\n"
            "assert gc.get_freeze_count() > 1000, gc.get_freeze_count()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=scaled(120))
    assert run.returncode == 0, run.stderr
