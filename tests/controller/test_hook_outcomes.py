"""What a hook failure leaves behind, end to end: a real reference engine, a real controller,
real hooks. A failure the table only logs (post-resume, on-fail) is in the engine's outcome
(its hook runs, with the exit code), in the journal (the run, and the table's decision:
``hook_failure``), in the log, and counted (``ckpt_hook_failures_total``); a refused hook is
its point's failure as an exit is, decided by the same table; and the states the table says
each point runs in are those its hooks see. (The table itself, and that it is applied in one
place: test_policy.)"""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from ckpt_controller.controller import policy
from ckpt_controller.vocab import HookCondition, HookPoint
from support.config import engines_toml
from support.hooks import write_hook
from support.timing import wait_until


def config(eng) -> str:
    return "metrics_port = 0\n" + engines_toml(eng)


def cycle(ctl, engine: str, op_id: str) -> tuple[int, dict, dict]:
    """(exit code, the operation's document, the engine's outcome in it)."""
    out = ctl.ckptctl("cycle", engine, "--json", "--op-id", op_id)
    doc = json.loads(out.stdout)
    return out.returncode, doc, doc["engines"][0]


def decisions(ctl, op_id: str) -> list[dict]:
    """The table's decisions journaled for ``op_id`` (``hook_failure`` records)."""
    out = ctl.ckptctl("history", "--op-id", op_id, "--json")
    return [r["data"] for r in json.loads(out.stdout)["records"]
            if r["record_type"] == "hook_failure"]


def hook_failures(ctl) -> dict[str, float]:
    """``ckpt_hook_failures_total`` by point, scraped from the controller's endpoint: the
    points that counted any (every point's series is there at 0 for a configured engine)."""
    url = f"http://127.0.0.1:{ctl.info['metrics_port']}/metrics"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as reply:
        text = reply.read().decode()
    return {s.labels["point"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "ckpt_hook_failures_total" and s.value}


def test_a_failure_only_logged_is_recorded_and_counted(spawn_reference, spawn_controller):
    eng = spawn_reference("lo")
    ctl = spawn_controller(config(eng))
    write_hook(ctl, "post-resume", "50-check", 'echo "health check: slow" >&2; exit 3')
    code, doc, o = cycle(ctl, "lo", "resume-logged")
    assert code == 0 and doc["status"] == "succeeded", doc  # the operation went on
    assert o["state"] == "running" and o["error"] is None
    (run,) = [h for h in o["hooks"] if h["point"] == "post-resume"]
    assert run["exit_code"] == 3 and "health check: slow" in run["stderr_tail"]
    (said,) = decisions(ctl, "resume-logged")
    assert (said["point"], said["condition"], said["action"]) == ("post-resume", "plain", "log")
    assert said["kind"] == "HookError" and "exited 3: health check: slow" in said["message"]
    log = (ctl.dir / "controller.log").read_text()
    assert f"lo: post-resume hook failed (logged only): {said['message']}" in log
    wait_until(lambda: hook_failures(ctl) == {"post-resume": 1.0}, 10, "the failure counted")

    # on-fail runs after a failure the table marks FAILED: its own failure is only logged,
    # the operation's error stays the one that failed it
    (ctl.dir / "hooks" / "post-resume" / "50-check").unlink()
    write_hook(ctl, "post-restore", "50-verify", "exit 7")
    write_hook(ctl, "on-fail", "50-page", "exit 5")
    code, doc, o = cycle(ctl, "lo", "fail-logged")
    assert code == 1 and o["state"] == "failed"
    assert o["error"]["details"]["point"] == "post-restore"
    assert [(h["point"], h["exit_code"]) for h in o["hooks"]] == [("post-restore", 7),
                                                                  ("on-fail", 5)]
    said = decisions(ctl, "fail-logged")
    assert [(d["point"], d["action"]) for d in said] == [("post-restore", "fail"),
                                                         ("on-fail", "log")]
    assert "lo: on-fail hook failed (logged only)" in (ctl.dir / "controller.log").read_text()
    counted = {"post-resume": 1.0, "post-restore": 1.0, "on-fail": 1.0}
    wait_until(lambda: hook_failures(ctl) == counted, 10, "both failures counted")
    (ctl.dir / "hooks" / "post-restore" / "50-verify").unlink()
    assert ctl.ckptctl("restore", "lo").returncode == 0  # recovery from FAILED


def test_a_refused_hook_is_its_points_failure(spawn_reference, spawn_controller):
    """A hook that is not executable is refused, and the table says what that means at its
    point, as for a hook that exits non-zero."""
    eng = spawn_reference("rf")
    ctl = spawn_controller(config(eng))
    write_hook(ctl, "post-resume", "50-check", "exit 0")
    (ctl.dir / "hooks" / "post-resume" / "50-check").chmod(0o644)
    code, doc, o = cycle(ctl, "rf", "resume-refused")
    assert code == 0 and doc["status"] == "succeeded" and o["state"] == "running", doc
    (said,) = decisions(ctl, "resume-refused")
    assert (said["point"], said["action"], said["kind"]) == ("post-resume", "log", "ConfigError")
    assert "not an executable file" in said["message"]
    (ctl.dir / "hooks" / "post-resume" / "50-check").unlink()

    write_hook(ctl, "pre-restore", "50-bring-back", "exit 0")
    (ctl.dir / "hooks" / "pre-restore" / "50-bring-back").chmod(0o644)
    code, doc, o = cycle(ctl, "rf", "restore-refused")
    assert code == 2 and o["state"] == "failed" and o["error"]["kind"] == "ConfigError", doc
    (said,) = decisions(ctl, "restore-refused")
    assert (said["point"], said["action"]) == ("pre-restore", "fail")
    (ctl.dir / "hooks" / "pre-restore" / "50-bring-back").unlink()
    assert ctl.ckptctl("restore", "rf").returncode == 0  # recovery once the hook is fixed


def test_each_point_runs_in_the_states_its_row_names(spawn_reference, spawn_controller):
    """The states the table says each point runs in (what its action must be allowed in) are
    the states its hooks really see (``CKPT_STATE``): a good cycle, a failed dump undone and
    rolled back, a failed post-restore (on-fail), and the restore that recovers it."""
    eng = spawn_reference("st")
    ctl = spawn_controller(config(eng))
    seen = ctl.dir / "seen.log"
    for point in HookPoint:
        write_hook(ctl, point, "10-note",
                   f'echo "$CKPT_ACTION $CKPT_STATE ${{CKPT_UNDO_CAPTURE:-0}}" >> {seen}')
    assert cycle(ctl, "st", "good")[0] == 0
    write_hook(ctl, "dump", "20-fail", "exit 1")
    assert cycle(ctl, "st", "undone")[2]["status"] == "rolled_back"
    (ctl.dir / "hooks" / "dump" / "20-fail").unlink()
    write_hook(ctl, "post-restore", "20-fail", "exit 7")
    assert cycle(ctl, "st", "failed")[2]["state"] == "failed"
    (ctl.dir / "hooks" / "post-restore" / "20-fail").unlink()
    assert ctl.ckptctl("restore", "st").returncode == 0
    lines = [line.split() for line in seen.read_text().splitlines()]
    assert {HookPoint(point) for point, _, _ in lines} == set(HookPoint)  # each one ran
    for point, state, undo in lines:
        condition = HookCondition.UNDOING_CAPTURE if undo == "1" else HookCondition.PLAIN
        assert state in policy.row(point, condition).runs_in, (point, state, undo)
