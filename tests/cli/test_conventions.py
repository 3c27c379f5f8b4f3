"""The conventions an operator types without thinking (kubectl's): global flags after the
command, ``-o json|wide|name`` beside ``--json``, ``status -w``, a mistyped word answered with
the nearest one in plain words, an unknown flag with that command's usage, timestamps on
``watch`` and ``history`` lines, and error texts without Python reprs."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from ckpt_controller.errors import UsageError, described
from ckpt_controller.vocab import OperationKind
from support import ROOT
from support.cli import CKPTCTL, ckptctl
from support.config import engines_toml
from support.timing import scaled, wait_until


def test_global_flags_work_after_the_command_too(ipc_dir):
    nowhere = f"ipc://{ipc_dir}/nobody.sock"
    out = ckptctl("status", "--controller", nowhere)
    assert out.returncode == 4 and nowhere in out.stderr, out.stderr
    out = ckptctl("fleet", "status", "--etcd", "http://127.0.0.1:9")
    assert out.returncode == 4 and "127.0.0.1:9" in out.stderr, out.stderr
    # before the command, as before; and not listed in each command's own help
    assert ckptctl("--controller", nowhere, "status").returncode == 4
    assert "--controller" not in ckptctl("status", "--help").stdout


@pytest.mark.parametrize("argv,near", [
    (["prep", "e1"], "prepare"),
    (["fleet", "cyc"], "cycle"),
    (["agent", "prep", "--control", "ipc:///x"], "prepare"),
    (["cycle", "e1", "--drain", "wiat"], "wait"),
])
def test_a_mistyped_word_is_answered_with_the_nearest_in_plain_words(argv, near):
    out = ckptctl(*argv)
    assert out.returncode == 2, out.stderr
    assert f"did you mean '{near}'?" in out.stderr, out.stderr
    assert "<" not in out.stderr.splitlines()[-1], out.stderr  # no <OperationKind.X: 'x'>


def test_an_unknown_flag_gets_that_commands_usage():
    for argv, usage in ((["history", "--bogus"], "usage: ckptctl history"),
                        (["images", "prune", "--nope"], "usage: ckptctl images prune"),
                        (["fleet", "status", "-x"], "usage: ckptctl fleet status")):
        out = ckptctl(*argv)
        assert out.returncode == 2 and out.stderr.startswith(usage), out.stderr
        assert "unrecognized arguments" in out.stderr


def test_o_json_is_json_everywhere_json_is(ipc_dir):
    nowhere = f"ipc://{ipc_dir}/nobody.sock"
    for argv in (["history", "-o", "json"], ["describe", "e1", "-o", "json"],
                 ["images", "list", "--output", "json"]):
        out = ckptctl("--controller", nowhere, *argv)
        doc = json.loads(out.stdout)  # the error document, as with --json
        assert out.returncode == 4 and doc["error"]["kind"] == "UnreachableError", argv
    out = ckptctl("images", "list", "-o", "yaml")
    assert out.returncode == 2 and "choose from 'json'" in out.stderr


def test_error_texts_and_descriptions_are_plain_words():
    err = UsageError("refused", kind=OperationKind.PREPARE, engines=["a", "b"], ok=True,
                     waited_s=1.5, hint="run `ckptctl serve`", none=None, empty="")
    assert str(err) == ('refused (kind=prepare, engines=a,b, ok=true, waited_s=1.5, '
                        'hint="run `ckptctl serve`", empty="")')
    assert described(ValueError("bad level")) == "ValueError: bad level"
    assert described(KeyError()) == "KeyError"


def test_status_o_name_w_and_timestamped_lines(spawn_controller, ipc_dir):
    from ckpt_controller.agent import Agent

    agents = [Agent(n, control=f"ipc://{ipc_dir}/{n}.ctl", heartbeat_interval_s=0.2).start()
              for n in ("cv1", "cv2")]
    try:
        ctl = spawn_controller(engines_toml(*agents))
        out = ctl.ckptctl("status", "-o", "name")
        assert out.returncode == 0 and out.stdout.split() == ["cv1", "cv2"], out.stdout
        assert json.loads(ctl.ckptctl("status", "-o", "json").stdout)["kind"] == "status"
        watching = subprocess.Popen(
            [*CKPTCTL, "--controller", ctl.endpoint, "status", "-w", "--interval", "0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            time.sleep(scaled(1.0))  # the first table, and nothing new while nothing changes
            assert ctl.ckptctl("prepare", "cv1").returncode == 0
            wait_until(lambda: ctl.ckptctl("status", "-o", "json").returncode == 0, 10,
                       "status answering")
            time.sleep(scaled(1.0))
        finally:
            watching.send_signal(signal.SIGINT)
            got, err = watching.communicate(timeout=scaled(30))
        assert watching.returncode == 0, err
        tables = got.split("\n\n")
        assert 2 <= len(tables) <= 4, got  # the first, then one per change (not per poll)
        assert "running" in tables[0] and "prepared" in tables[-1], got
        assert tables[1].startswith("20"), got  # the time of the change above the table
        hist = ctl.ckptctl("history", "--engine", "cv1").stdout.splitlines()
        records = [line for line in hist if line.startswith("  ")]
        assert records and all(line.split()[1].startswith("20") for line in records), hist
    finally:
        for a in agents:
            a.close()
