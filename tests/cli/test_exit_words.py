"""One exit code for one cause, and words that name who is silent: an engine that stops
answering (SIGSTOP) is exit 4 for ``status`` and for ``cycle`` alike, before or during the
operation, and the words name the engine, never the controller (which answered); a wait drain
that escalated says so in the operation's human summary, not only in JSON."""

from __future__ import annotations

import os
import signal
import threading

from ckpt_controller.agent import AgentClient
from support.config import engines_toml
from support.timing import scaled, wait_until


def _in_flight(eng, n: int) -> None:
    with AgentClient(eng.control) as agent:
        wait_until(lambda: agent.status().in_flight == n, 20, f"{n} requests in flight")


def test_a_silent_engine_is_exit_4_everywhere_and_named(spawn_engine, spawn_controller):
    eng = spawn_engine("hg")
    ctl = spawn_controller(engines_toml(eng))
    os.kill(eng.pid, signal.SIGSTOP)
    try:
        st = ctl.ckptctl("status")
        assert st.returncode == 4, st.stdout + st.stderr
        assert "hg: UNREACHABLE (no answer from" in st.stdout and "hg.ctl" in st.stdout
        assert "the controller" not in st.stderr, st.stderr  # it answered: the engine is silent
        cy = ctl.ckptctl("cycle", "hg")
        assert cy.returncode == 4, cy.stdout + cy.stderr
        assert "UnreachableError: hg did not answer" in cy.stderr, cy.stderr
    finally:
        os.kill(eng.pid, signal.SIGCONT)
    # silent in the middle of the operation: exit 4 too, naming the engine's endpoint
    eng.submit("r0", steps=600)
    _in_flight(eng, 1)
    stopper = threading.Timer(scaled(1.0), lambda: os.kill(eng.pid, signal.SIGSTOP))
    stopper.start()
    try:
        cy = ctl.ckptctl("cycle", "hg", "--drain", "wait")
    finally:
        stopper.join()
        os.kill(eng.pid, signal.SIGCONT)
    assert cy.returncode == 4, cy.stdout + cy.stderr
    assert "no answer and no heartbeat from" in cy.stdout and "hg.ctl" in cy.stdout, cy.stdout


def test_an_escalated_wait_drain_says_so_in_the_summary(spawn_engine, spawn_controller):
    eng = spawn_engine("es")
    ctl = spawn_controller(engines_toml(eng))
    for rid in ("r0", "r1"):
        eng.submit(rid, steps=600)  # 600 steps of 10 ms: in flight when the drain begins
    _in_flight(eng, 2)
    out = ctl.ckptctl("prepare", "es", "--drain", "wait", "--drain-timeout", "0.05",
                      "--on-deadline", "abort", "--level", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("the wait drain reached its deadline and escalated to abort: 2 aborted, 0 kept "
            "of 2 in flight") in out.stdout, out.stdout
    assert ctl.ckptctl("restore", "es").returncode == 0
