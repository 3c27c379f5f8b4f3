"""CRIU action scripts run at CRIU's own moments: a script named in the config
(``controller.criu_action_scripts``) is handed to ``criu dump`` and ``criu restore`` by the
shipped hooks, and records CRIU's points in CRIU's order during a real dump and restore of a
reference engine; our own hook points say ``CRTOOLS_SCRIPT_ACTION`` only at ``dump`` (CRIU's
pre-dump moment). Needs CRIU (``make criu``) and root."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckpt_controller.engine.client import EngineClient
from support.config import engines_toml
from support.criu import criu_missing, required, tcp_engine
from support.hooks import CRIU_HOOKS, link_hooks, write_hook
from support.processes import kill_naming
from support.timing import scaled

_reason = required(criu_missing(), "the CRIU action-script test")
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.exec_engines]


def recording_script(folder: Path, record: Path) -> Path:
    """An action script that appends CRIU's action (and whether it came from CRIU: CRIU sets
    ``CRTOOLS_INIT_PID`` to the tree's root) to ``record``."""
    folder.mkdir(mode=0o755)
    script = folder / "record-points"
    script.write_text(f'#!/bin/sh\necho "$CRTOOLS_SCRIPT_ACTION" >> {record}\n')
    script.chmod(0o755)
    return script


def test_a_criu_action_script_records_criu_s_own_points_in_order(
        spawn_reference, spawn_controller, monkeypatch, tmp_path):
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")  # hooks get the controller's environment
    record = tmp_path / "criu-points"
    script = recording_script(tmp_path / "actions", record)
    eng = tcp_engine(spawn_reference, "cas")
    try:
        ctl = spawn_controller(engines_toml(eng, defaults='drain = "keep"\nlevel = 2'),
                               controller_keys=f'criu_action_scripts = ["{script}"]\n')
        link_hooks(ctl, CRIU_HOOKS)
        # our own points: what CRTOOLS_SCRIPT_ACTION each one says now
        for point in ("dump", "post-dump", "pre-restore", "post-restore"):
            write_hook(ctl, point, "90-say", f'echo "{point}=${{CRTOOLS_SCRIPT_ACTION-unset}}"'
                       f' >> {tmp_path / "our-points"}')
        with EngineClient(eng.api) as api:
            want = api.generate([5, 6, 7], 20).token_ids
        assert ctl.ckptctl("prepare", eng.name).returncode == 0
        out = ctl.ckptctl("capture", eng.name, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        dumped = record.read_text().split()
        eng.proc.wait(timeout=scaled(10))  # the dump ended it; its PIDs free for the restore
        out = ctl.ckptctl("restore", eng.name, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["engines"][0]["state"] == "running"
        restored = record.read_text().split()[len(dumped):]
        with EngineClient(eng.api) as api:
            assert api.generate([5, 6, 7], 20).token_ids == want
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])
    print("CRIU's points at the dump:", dumped, "at the restore:", restored)
    assert dumped[0] == "pre-dump" and dumped[-1] == "post-dump", dumped
    assert in_order(restored, ["pre-restore", "post-restore", "pre-resume", "post-resume"]), \
        restored
    ours = dict(line.split("=", 1) for line in (tmp_path / "our-points").read_text().split())
    assert ours == {"dump": "pre-dump", "post-dump": "unset", "pre-restore": "unset",
                    "post-restore": "unset"}


def in_order(seen: list[str], wanted: list[str]) -> bool:
    """Whether ``wanted`` appears in ``seen`` in that order (others between them)."""
    at = iter(seen)
    return all(any(s == w for s in at) for w in wanted)


def test_an_action_script_others_may_change_is_refused_at_check(spawn_controller, tmp_path):
    script = recording_script(tmp_path / "actions", tmp_path / "never")
    script.chmod(0o777)
    config = tmp_path / "c.toml"
    config.write_text(f'[controller]\nstate_dir = "{tmp_path}/s"\n'
                      f'criu_action_scripts = ["{script}"]\n')
    from support.cli import ckptctl

    out = ckptctl("serve", "--config", str(config), "--check")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "criu_action_scripts[0]" in out.stderr and "writable by group or others" in \
        out.stderr, out.stderr
    assert os.access(script, os.X_OK)
