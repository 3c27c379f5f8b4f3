"""A snapshot to restore from: a reference engine started PREPARED (``--prepare-on-startup``,
as vLLM's ``--checkpoint-prepare-on-startup``) is taken over as PREPARED by the controller,
captured once with real CRIU, and that one image restored again and again (``restore
--image``), each copy serving exactly what a freshly started engine serves. Needs CRIU
(``make criu``) and root."""

from __future__ import annotations

import json

import psutil
import pytest

from ckpt_controller.engine.client import EngineClient
from support.config import engines_toml
from support.criu import criu_missing, required, tcp_engine
from support.hooks import CRIU_HOOKS, link_hooks
from support.processes import kill_naming
from support.timing import scaled, wait_until

_reason = required(criu_missing(), "the CRIU snapshot test")
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.exec_engines]

PROMPT = [7, 3, 9, 1]


def test_one_capture_of_an_engine_started_prepared_restores_again_and_again(
        spawn_reference, spawn_controller, monkeypatch):
    fresh = tcp_engine(spawn_reference, "snf")  # what a freshly started engine answers
    with EngineClient(fresh.api) as api:
        want = api.generate(PROMPT, 24).token_ids
    fresh.stop()
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")  # hooks get the controller's environment
    eng = tcp_engine(spawn_reference, "sns", "--prepare-on-startup")
    assert eng.info["state"] == "prepared"
    try:
        ctl = spawn_controller(engines_toml(eng))
        link_hooks(ctl, CRIU_HOOKS)
        status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
        assert status["state"] == "prepared" and status["released_tags"] == ["kv_cache"]
        out = ctl.ckptctl("capture", eng.name, "--op-id", "snapshot", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["engines"][0]["image"] == "snapshot"
        eng.proc.wait(timeout=scaled(10))  # the dump ended it; its PIDs free for a restore
        for copy in range(3):
            out = ctl.ckptctl("restore", eng.name, "--image", "snapshot", "--json")
            assert out.returncode == 0, (copy, out.stdout + out.stderr)
            assert json.loads(out.stdout)["engines"][0]["state"] == "running"
            with EngineClient(eng.api) as api:
                assert api.generate(PROMPT, 24).token_ids == want, copy
            # a copy of the image, not the engine brought back in place
            now = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
            assert now["restored_from_image"] is True and now["state"] == "running", now
            # this copy ends (as a replaced replica would); the same image serves the next
            pid = now["pid"]
            psutil.Process(pid).kill()
            wait_until(lambda: not psutil.pid_exists(pid) or
                       psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, scaled(10),
                       f"copy {copy} (pid {pid}) gone")
    finally:  # a restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])
