"""Review reproductions: what a link knows after a repeated operation id's reply."""

from __future__ import annotations

import os
import signal
import time

from ckpt_controller.agent.client import AgentClient
from ckpt_controller.controller import links as links_mod
from tests.test_controller_links import _controller, _op


def test_a_repeated_op_ids_old_reply_does_not_make_the_link_know_a_stale_state(
        tmp_path, spawn_engine):
    """An agent answers a repeated op id with the reply it kept: its state and its
    transitions are from then, not now. The link must not take that state as current, nor
    learn a clock offset from transitions made long ago (heartbeats would then be placed in
    the future, and a silent agent would look heard-from)."""
    eng = spawn_engine("rv1", weights_mib=4, kv_mib=1)
    ctl = _controller(tmp_path, eng)
    try:
        assert ctl.run(_op("cycle", "rv1"), 60).status == "succeeded"
        link = ctl.links.take("rv1")
        link.status()
        link.prepare(op_id="dup-prepare", drain="wait", level=0)
        link.restore(op_id="dup-restore")
        time.sleep(3.0)
        again = link.prepare(op_id="dup-prepare", drain="wait", level=0)  # the kept reply
        assert again.state == "prepared"
        with AgentClient(eng.control) as agent:
            assert agent.status().state == "running"
        known = link.knows(links_mod.KNOWN_FRESH_S)
        assert known is None or known.state == "running", known
        # the clock: heartbeats read now, then the agent goes silent
        link.poll_events(0.5)
        os.kill(eng.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(links_mod.KNOWN_FRESH_S + 0.5)
            assert link.knows(links_mod.KNOWN_FRESH_S) is None, "a silent agent looks fresh"
        finally:
            os.kill(eng.proc.pid, signal.SIGCONT)
        link.close()
    finally:
        ctl.close()
