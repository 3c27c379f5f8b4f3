"""A FAILED engine says why: ``status`` (a line under the table, the ERROR column of ``-o
wide``) and ``ckptctl describe ENGINE`` (state and since when, the reason, the way back, its
links, last operations, last error, hooks, images), as ``kubectl describe`` does. A real
``ckptctl serve`` and an in-process agent whose pre-restore hook fails when told to."""

from __future__ import annotations

import json

import pytest

from support.config import engines_toml
from support.hooks import write_hook


@pytest.fixture
def agent(ipc_dir):
    from ckpt_controller.agent import Agent

    a = Agent("ds", control=f"ipc://{ipc_dir}/ds.ctl", heartbeat_interval_s=0.2).start()
    yield a
    a.close()


def test_a_failed_engine_says_why_in_status_and_describe(spawn_controller, agent):
    ctl = spawn_controller(engines_toml(agent))
    flag = ctl.dir / "fail"
    write_hook(ctl, "dump", "10-image", 'echo image > "$CKPT_IMAGE_DIR/pages-1.img"')
    write_hook(ctl, "pre-restore", "10-check",
               f'[ -e {flag} ] && {{ echo "image check: bad crc" >&2; exit 1; }}; exit 0')
    assert ctl.ckptctl("cycle", "ds", "--op-id", "ok-1").returncode == 0
    flag.touch()
    out = ctl.ckptctl("cycle", "ds", "--op-id", "bad-1", "--json")
    assert json.loads(out.stdout)["engines"][0]["state"] == "failed", out.stdout

    status = ctl.ckptctl("status")
    assert status.returncode == 0
    (note,) = [line for line in status.stdout.splitlines() if line.startswith("ds: FAILED")]
    why = "pre-restore hook 10-check exited 1: image check: bad crc"
    assert "ago (20" in note and "in operation bad-1" in note and why in note, note
    assert "ckptctl restore ds" in note, note
    wide = ctl.ckptctl("status", "-o", "wide").stdout.splitlines()
    assert why in wide[1], wide  # the ERROR column
    doc = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]
    assert why in doc["status"]["last_transition"]["reason"]

    page = ctl.ckptctl("describe", "ds")
    assert page.returncode == 0, page.stdout + page.stderr
    text = page.stdout
    assert "State:         failed since 20" in text, text
    assert f"Reason:        {why} (operation bad-1)" in text, text
    assert "Recover:       ckptctl restore ds" in text
    assert "control:     ipc://" in text and "(answered)" in text
    assert "API:           embedded\n" in text, text  # how its agent drives it
    ops = text.split("Last operations:")[1].split("Last error:")[0]
    assert ops.index("bad-1") < ops.index("ok-1") and "cycle  failed" in ops, ops
    (err,) = [line for line in text.splitlines() if line.startswith("Last error:")]
    assert "in operation bad-1" in err and "image check: bad crc" in err, err
    hooks = text.split("Hooks (newest operation):")[1].split("Images:")[0]
    assert "dump" in hooks and "pre-restore" in hooks and "exit 1" in hooks, hooks
    assert "Images:        2 (" in text and "ok-1" in text, text

    flag.unlink()
    assert ctl.ckptctl("restore", "ds").returncode == 0
    back = ctl.ckptctl("describe", "ds").stdout
    assert "State:         running since" in back and "Reason:" not in back, back
    assert "ds: FAILED" not in ctl.ckptctl("status").stdout
    missing = ctl.ckptctl("describe", "nosuch")
    assert missing.returncode == 2 and "nosuch" in missing.stderr, missing.stderr
