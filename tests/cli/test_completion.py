"""``ckptctl completion bash|zsh``: scripts generated from the real argparse tree. The bash
script, sourced in ``bash -c``, completes commands, flags and flag choices through the
function it registers (driven with COMP_WORDS/COMP_CWORD as bash would); every subcommand and
flag of the parser is in the tables, so the script cannot drift. The zsh script is checked with
``zsh -n`` where zsh is installed, else only as text (same tables, the compdef line)."""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess

import pytest

from ckpt_controller.cli import build_parser
from ckpt_controller.cli.completion import walk
from support.cli import ckptctl
from support.timing import scaled


def _script(shell: str) -> str:
    out = ckptctl("completion", shell)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("completion") / "ckptctl.bash"
    path.write_text(_script("bash"))
    return path


def complete(script, *words: str, nounset: bool = False) -> list[str]:
    """What bash offers for the command line ``words`` (the last one being typed); with
    ``nounset``, in a shell that runs with ``set -u``."""
    array = " ".join(shlex.quote(w) for w in words)
    code = (("set -u; " if nounset else "") + f"source {shlex.quote(str(script))}; "
            f"fn=$(complete -p ckptctl | sed -E 's/.*-F ([^ ]+).*/\\1/'); "
            f"COMP_WORDS=({array}); COMP_CWORD={len(words) - 1}; COMP_LINE={shlex.quote(' '.join(words))}; "
            f"$fn ckptctl {shlex.quote(words[-1])} {shlex.quote(words[-2])}; "
            "printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=scaled(30))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return [w for w in out.stdout.splitlines() if w]


def test_bash_completes_in_a_shell_with_set_u(bash_script):
    """``set -u`` in the user's shell: a table lookup of a word that is no key was an
    "unbound variable" error printed at each Tab, and no completion."""
    assert complete(bash_script, "ckptctl", "agent", "pre", nounset=True) == ["prepare"]
    assert complete(bash_script, "ckptctl", "cycle", "e1", "--json", "--dr", nounset=True) == \
        ["--drain", "--drain-timeout"]
    assert complete(bash_script, "ckptctl", "cycle", "--drain", "", nounset=True) == \
        ["wait", "abort", "keep"]
    assert complete(bash_script, "ckptctl", "status", "e1", "", nounset=True)[:2] == \
        ["-h", "--help"]


def test_bash_completes_commands_flags_and_choices(bash_script):
    assert complete(bash_script, "ckptctl", "st") == ["status"]
    assert complete(bash_script, "ckptctl", "cycle", "--max") == ["--max-unavailable"]
    assert "--drain-timeout" in complete(bash_script, "ckptctl", "cycle", "--dr")
    assert complete(bash_script, "ckptctl", "cycle", "--drain", "") == ["wait", "abort", "keep"]
    # a global flag's value is skipped, not taken for a command
    assert complete(bash_script, "ckptctl", "--controller", "ipc:///x", "st") == ["status"]
    assert complete(bash_script, "ckptctl", "agent", "v") == ["vllm", "vllm-launch"]
    assert complete(bash_script, "ckptctl", "agent", "vllm", "--log-format", "") == \
        ["text", "json"]
    assert complete(bash_script, "ckptctl", "engine", "serve", "--log-l") == ["--log-level"]
    assert complete(bash_script, "ckptctl", "completion", "z") == ["zsh"]
    assert complete(bash_script, "ckptctl", "lif") == ["lifecycle"]
    assert complete(bash_script, "ckptctl", "lifecycle", "--format", "") == ["text", "mermaid"]
    # an unknown word leads nowhere: the top level's flags, not cycle's
    assert complete(bash_script, "ckptctl", "nosuch", "--max") == []
    assert complete(bash_script, "ckptctl", "nosuch", "--contr") == ["--controller"]


def _every_flag(parser: argparse.ArgumentParser, path: str, out: dict) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out.setdefault(path, set()).add(name)
                _every_flag(child, f"{path} {name}", out)
        elif action.option_strings and action.help != argparse.SUPPRESS:
            out.setdefault(path, set()).update(action.option_strings)
    return out


def test_the_tables_hold_the_whole_parser():
    parser = build_parser()
    tree = walk(parser, "ckptctl")
    want = _every_flag(parser, "ckptctl", {})
    assert set(want) <= set(tree.words)
    for path, names in want.items():
        assert names <= {w for w, _ in tree.words[path]}, path
    assert tree.choices["ckptctl serve|--log-level"] == ["debug", "info", "warning", "error"]
    assert "ckptctl cycle|--deadline" in tree.takes and "ckptctl cycle|--json" not in tree.takes


def test_zsh_script():
    text = _script("zsh")
    assert text.startswith("#compdef ckptctl\n") and "compdef _ckptctl ckptctl" in text
    assert "[ckptctl]=" in text and "\nstatus:" in text  # word:help, one a line
    assert "\n--log-level:the least severe records written" in text
    assert "['ckptctl cycle|--drain']='wait abort keep'" in text
    zsh = shutil.which("zsh")
    if zsh is not None:  # else checked as text only (no skip: CI need not install zsh)
        out = subprocess.run([zsh, "-n"], input=text, capture_output=True, text=True,
                             timeout=scaled(30))
        assert out.returncode == 0, out.stderr


def test_a_shell_it_does_not_know_is_a_usage_error():
    out = ckptctl("completion", "fish")
    assert out.returncode == 2 and "invalid choice: 'fish'" in out.stderr
