"""An operation's progress as ``ckptctl`` prints it: each line with its elapsed time, a drain
counting down what is in flight, a hook's start and end with its time, a failed hook's stderr
in the human output, no raw JSON; rewritten in place on a terminal (a pty here), plain lines
elsewhere. A real controller and a real step engine."""

from __future__ import annotations

import io
import os
import pty
import re
import signal
import subprocess
from pathlib import Path

from ckpt_controller.agent import AgentClient
from ckpt_controller.cli.progress import Progress
from support import ROOT
from support.cli import CKPTCTL, StreamedLines
from support.config import engines_toml
from support.hooks import write_hook
from support.timing import scaled, wait_until

STAMP = re.compile(r"^\[ *\d+\.\d\ds\] ")


def _controller(spawn_engine, spawn_controller):
    eng = spawn_engine("p1", weights_mib=4, kv_mib=4, step_s=0.01)
    ctl = spawn_controller(engines_toml(("p1", eng.control)))
    return eng, ctl


def _busy(eng) -> None:
    """Two requests in flight for about three and four seconds (a wait drain then counts
    them down): longer than ``ckptctl`` takes to start on a loaded machine, where requests of
    one second had ended before the prepare came (no countdown to see)."""
    eng.submit("r1", 300)
    eng.submit("r2", 400)
    with AgentClient(eng.control) as agent:
        wait_until(lambda: agent.status().in_flight == 2, 20, "two requests in flight")


def test_progress_lines_off_a_terminal(spawn_engine, spawn_controller):
    eng, ctl = _controller(spawn_engine, spawn_controller)
    write_hook(ctl, "dump", "10-dump", "sleep 0.3; echo dumped >&2")
    _busy(eng)
    out = ctl.ckptctl("cycle", "p1", "--drain", "wait", "--op-id", "pg-1")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert lines and all(STAMP.match(line) for line in lines), out.stderr
    assert "\r" not in out.stderr and "{" not in out.stderr + out.stdout  # no raw JSON
    said = [STAMP.sub("", line) for line in lines]
    assert said[0] == "pg-1: cycle started on p1"
    drain = [s for s in said if s.startswith("p1: draining, ")]
    left = [int(re.search(r"(\d+) in flight left", s).group(1)) for s in drain]
    assert left and left == sorted(left, reverse=True) and len(set(left)) == len(left), drain
    assert any(s.startswith("p1: drain wait done: 2 completed") for s in said), said
    start = said.index("p1: hook dump 10-dump started")
    end = [i for i, s in enumerate(said) if re.fullmatch(r"p1: hook dump 10-dump done in "
                                                         r"0\.[3-9]\ds|p1: hook dump 10-dump "
                                                         r"done in \d\.\d\ds", s)]
    assert end and end[0] > start, said
    assert said[-1].startswith("pg-1: ended succeeded in ")
    # the times only grow
    times = [float(STAMP.match(line).group(0).strip("[] s")) for line in lines]
    assert times == sorted(times)
    assert out.stdout.startswith("cycle pg-1: succeeded in ")


def test_a_failed_hook_says_why_in_the_human_output(spawn_engine, spawn_controller):
    eng, ctl = _controller(spawn_engine, spawn_controller)
    write_hook(ctl, "post-release", "20-check", "echo first >&2; echo 'disk full on /images' >&2; "
                                           "exit 3")
    out = ctl.ckptctl("prepare", "p1", "--op-id", "pf-1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "hook post-release 20-check FAILED, exit 3 in " in out.stdout
    assert "  | first\n" in out.stdout and "  | disk full on /images" in out.stdout
    assert "| disk full on /images" in out.stderr  # in the progress too, when it ended
    assert "{" not in out.stdout


def test_on_a_terminal_the_running_line_is_rewritten(spawn_engine, spawn_controller):
    eng, ctl = _controller(spawn_engine, spawn_controller)
    write_hook(ctl, "dump", "10-dump", "sleep 1")
    _busy(eng)
    leader, follower = pty.openpty()
    try:
        run = subprocess.Popen([*CKPTCTL, "--controller",
                                ctl.endpoint, "cycle", "p1", "--drain", "wait"],
                               stdout=subprocess.PIPE, stderr=follower, text=True, cwd=ROOT)
        os.close(follower)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # policy: EIO: the command closed its end of the terminal
                break
            if not chunk:
                break
            seen += chunk
        stdout, _ = run.communicate(timeout=scaled(60))
    finally:
        os.close(leader)
    assert run.returncode == 0, seen
    text = seen.decode()
    assert "\r\x1b[K" in text  # a running drain or hook, rewritten in place
    # each against its bound: the hook's timeout ([deadlines] hook), the wait drain's deadline
    assert re.search(r"p1: hook dump 10-dump running \d+ s of at most 60 s", text), text
    assert re.search(r"p1: draining, .* \d+ s of at most 30 s", text), text
    assert "p1: hook dump 10-dump done in 1." in text
    assert stdout.startswith("cycle ")


def test_progress_by_itself():
    """Off a terminal a drain prints a line only when its count changed; on one the line of
    what runs is rewritten, and cleared before the next line and at the end."""
    now = [0.0]
    plain = io.StringIO()
    pr = Progress(plain, live=False, clock=lambda: now[0])
    for t, left in ((1, 3), (2, 3), (3, 2), (4, 2), (5, 0)):
        now[0] = t
        pr.drain("e", left, 3 - left, 0)
    now[0] = 6
    pr.drained("e", "e: drain wait done")
    pr.hook_started("e", "dump", ["10-a"])
    now[0] = 7.5
    pr.refresh()
    pr.hook_ended("e", {"point": "dump", "path": "/h/dump/10-a", "exit_code": 0,
                        "duration_s": 1.5})
    pr.finish()
    assert plain.getvalue().splitlines() == [
        "[   1.00s] e: draining, 3 in flight left (0 completed, 0 aborted)",
        "[   3.00s] e: draining, 2 in flight left (1 completed, 0 aborted)",
        "[   5.00s] e: draining, 0 in flight left (3 completed, 0 aborted)",
        "[   6.00s] e: drain wait done",
        "[   6.00s] e: hook dump 10-a started",
        "[   7.50s] e: hook dump 10-a done in 1.50s"]
    # a hook that succeeded but wrote to stderr (tcp-hold past its bound) shows what it said
    warned = io.StringIO()
    Progress(warned, live=False, clock=lambda: 8.0).hook_ended(
        "e", {"point": "pre-restore", "path": "/h/pre-restore/30-b", "exit_code": 0,
              "duration_s": 0.25, "stderr_tail": "held 70.0 s, past its bound\n"})
    assert warned.getvalue().splitlines() == [
        "[   0.00s] e: hook pre-restore 30-b done in 0.25s",
        "[   0.00s]   | held 70.0 s, past its bound"]
    now = [0.0]
    tty = io.StringIO()
    pr = Progress(tty, live=True, clock=lambda: now[0], width=200)
    now[0] = 1
    pr.drain("e", 2, 0, 0)
    now[0] = 2
    pr.drain("e", 1, 1, 0)
    now[0] = 3
    pr.hook_started("f", "dump", ["10-a"])
    now[0] = 4
    pr.drained("e", "e: drain wait done")
    now[0] = 4.5
    pr.refresh()
    pr.finish()
    assert tty.getvalue() == (
        "[   1.00s] e: draining, 2 in flight left (0 completed, 0 aborted) 0.0s"
        "\r\x1b[K[   2.00s] e: draining, 1 in flight left (1 completed, 0 aborted) 1.0s"
        "\r\x1b[K[   3.00s] f: hook dump 10-a started\n"
        "[   3.00s] e: draining, 1 in flight left (1 completed, 0 aborted) 2.0s; "
        "f: hook dump 10-a running 0.0s"
        "\r\x1b[K[   4.00s] e: drain wait done\n"
        "[   4.00s] f: hook dump 10-a running 1.0s"
        "\r\x1b[K[   4.50s] f: hook dump 10-a running 1.5s"
        "\r\x1b[K")


def test_a_live_line_fits_the_terminal_and_hook_output_cannot_drive_it():
    """Many engines draining at once: the live line is cut to the terminal's width (a line
    that wraps cannot be cleared by a carriage return, and the rows pile up). A hook's stderr
    with control characters (a carriage return, an escape sequence) is shown escaped: it
    cannot rewrite or recolour the operator's terminal."""
    now = [0.0]
    tty = io.StringIO()
    pr = Progress(tty, live=True, clock=lambda: now[0], width=60)
    for i in range(50):
        pr.drain(f"engine-{i:02d}", 1000 - i, i, 0)
    pr.finish()
    shown = tty.getvalue().split("\r\x1b[K")
    assert len(shown) == 51 and all(len(part) <= 59 for part in shown), shown[-2:]
    assert shown[-2].startswith("[   0.00s] engine-00: draining, ")
    assert shown[-2].endswith("... 0.0s; +49 more"), shown[-2]
    # narrow: the name is cut, the time and its bound stay whole
    now[0] = 0.0
    tty = io.StringIO()
    pr = Progress(tty, live=True, clock=lambda: now[0], width=50)
    pr.hook_started("engine-with-a-long-name", "dump", ["10-criu-dump"], bound_s=60)
    now[0] = 12.2
    pr.refresh()
    last = tty.getvalue().split("\r\x1b[K")[-1]
    assert len(last) <= 49 and last.endswith("... 12 s of at most 60 s"), last
    assert last.startswith("[  12.20s] engine-with"), last

    plain = io.StringIO()
    pr = Progress(plain, live=False, clock=lambda: now[0])
    pr.hook_ended("e", {"point": "dump", "path": "/h/dump/10-a", "exit_code": 1,
                        "duration_s": 0.5,
                        "stderr_tail": "ok line\nfake\rREWRITTEN\n\x1b[2J\x1b[31mred\x1b[0m\n"})
    text = plain.getvalue()
    assert "\r" not in text and "\x1b" not in text, repr(text)
    assert [STAMP.sub("", line) for line in text.splitlines()[1:]] == [
        "  | ok line", "  | fake\\rREWRITTEN", "  | \\x1b[2J\\x1b[31mred\\x1b[0m"]


def test_ctrl_c_says_the_operation_goes_on(spawn_engine, spawn_controller, ipc_dir):
    """Ctrl-C while a hook runs: ckptctl exits 130 and says the operation goes on in the
    controller, naming its id and how to follow it (it ended silently, the engine left
    PREPARED and held with no word why)."""
    eng, ctl = _controller(spawn_engine, spawn_controller)
    go = Path(ipc_dir) / "go"
    write_hook(ctl, "dump", "10-wait", f"while [ ! -e {go} ]; do sleep 0.05; done")
    run = subprocess.Popen([*CKPTCTL, "--controller",
                            ctl.endpoint, "cycle", "p1", "--op-id", "int-1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    err = StreamedLines(run.stderr)
    try:
        wait_until(lambda: any("hook dump 10-wait started" in line for line in err.lines), 30,
                   "the hook running")
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=scaled(30)) == 130
        said = "".join(err.join())
        assert "interrupted: operation int-1 goes on in the controller" in said, said
        assert "ckptctl history --op-id int-1" in said, said
        assert "Traceback" not in said
    finally:
        go.touch()
        run.kill()
        run.communicate(timeout=scaled(30))
    wait_until(lambda: "succeeded" in ctl.ckptctl("history", "--op-id", "int-1").stdout, 30,
               "the operation ended in the controller, as it said")
