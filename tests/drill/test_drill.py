"""``ckptctl drill``: real controller and reference-engine processes, real faults.

The 20-cycle drill and one fault of each kind run by default; every fault at every place
(about four minutes) is marked slow. Each fault's outcome is checked here against the table
in docs/drills.md, not only against the drill's own verdict."""

from __future__ import annotations

import json

import pytest

from ckpt_controller.controller.journal import Journal
from ckpt_controller.drill import faults as f
from ckpt_controller.drill import report as r
from ckpt_controller.drill import timeline as tl
from ckpt_controller.errors import UsageError
from support.cli import ckptctl


def drill(tmp_path, *args: str, timeout: float = 900) -> tuple[int, dict, str]:
    out = ckptctl("drill", *args, "--report", str(tmp_path / "rep"), timeout=timeout)
    path = tmp_path / "rep" / "report.json"
    rep = json.loads(path.read_text()) if path.exists() else {}
    return out.returncode, rep, out.stdout + out.stderr


# kind@where -> (operation status, engine right after it, what followed)
OUTCOMES = {
    "kill-engine": ("failed", "gone", "engine started again"),
    "stall-agent": ("failed", "unknown", "reconciled by the controller"),
    "kill-controller": ("interrupted", "running", "controller restarted and reconciled"),
    "corrupt-weight": ("failed", "failed", "restore (recovery from FAILED): succeeded"),
    "residual": ("rolled_back", "running", None),
}


def _check_faults(rep: dict, spec: str) -> None:
    faults = rep["summary"]["faults"]
    assert [x["fault"] for x in faults] == spec.split(",")
    for x in faults:
        kind, where = x["fault"].split("@")
        if kind in OUTCOMES:
            status, state, after = OUTCOMES[kind]
        else:
            hook_state, hook_status, _ = f._HOOK_EFFECTS[where]
            status, state = hook_status, hook_state
            after = "restore (recovery from FAILED): succeeded" if state == "failed" else None
        assert (x["status"], x["seen_state"]) == (status, state), x
        assert x["after"] == ([after] if after else []), x
        assert x["ok"], x
    for cycle in rep["cycles"]:
        for e in cycle["engines"]:
            assert e["requests"]["lost"] == 0, cycle
        assert cycle["ok"], cycle


@pytest.mark.slow  # about three minutes on 2 cores; CI runs it with the slow suites
@pytest.mark.timeout(900)  # the drill's own limit (``drill``), not the suite's 300 s
def test_twenty_cycles_under_load_lose_nothing(tmp_path):
    code, rep, out = drill(tmp_path, "d1", "d2", "--cycles", "20", "--rate", "10",
                           "--duration", "2", "--drain", "keep")
    assert code == 0, out
    s = rep["summary"]
    assert s["ok"] and s["cycles"] == 20 and not s["cycles_with_problems"]
    assert s["requests"]["lost"] == 0 and s["outputs_mismatched"] == 0
    assert s["requests"]["sent"] == 20 * 2 * 20
    assert s["requests"]["completed"] + s["requests"]["rejected"] == s["requests"]["sent"]
    assert s["outputs_compared"] == s["requests"]["completed"] > 0
    assert {m["engine"] for m in s["memory"]} == {"d1", "d2"}
    assert not any(m["leaked"] for m in s["memory"]) and all(m["cycles"] == 20
                                                           for m in s["memory"])
    for cycle in rep["cycles"]:
        assert cycle["status"] == "succeeded"
        for e in cycle["engines"]:
            assert e["state"] == "running"
            assert {ph["name"] for ph in e["phases"]} >= {"prepare", "capture", "restore"}
            assert e["drain"]["mode"] == "keep"
            assert e["memory"]["freed_bytes"] > 0 and e["memory"]["verified_tensors"] > 0
            assert e["requests"]["kept"] == e["drain"]["kept"]
    assert sum(e["requests"]["kept"] for c in rep["cycles"] for e in c["engines"]) > 0
    assert _png_size(tmp_path / "rep" / "timeline.png")[1] > 20 * 2 * 18  # a row each
    assert "20 cycles" in out and "0 lost" in out


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


SOME = ("kill-engine@release,stall-agent@drain,fail-hook@post-release,hang-hook@pre-restore,"
        "kill-controller@restoring,corrupt-weight@rewake,residual@release")


def test_one_fault_of_each_kind_ends_as_documented(tmp_path):
    code, rep, out = drill(tmp_path, "e1", "--cycles", "8", "--faults", SOME,
                           "--duration", "2", "--drain", "keep")
    assert code == 0, out
    _check_faults(rep, SOME)
    assert rep["cycles"][-1]["fault"] is None and rep["cycles"][-1]["status"] == "succeeded"
    died = sum(e["requests"]["ended_by_engine_death"] for c in rep["cycles"]
               for e in c["engines"])
    assert died > 0  # the killed engine's requests ended with an error, none lost
    # what followed the faults is timed for the timeline, which is drawn
    assert {a["kind"] for c in rep["cycles"] for a in c.get("aftermath", [])} == \
        {"restart", "reconcile", "recovery"}
    assert _png_size(tmp_path / "rep" / "timeline.png")[1] > 8 * 18


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the drill's own limit below: every fault is five minutes or more
def test_every_fault_at_every_point_ends_as_documented(tmp_path):
    spec = f.every_fault()
    n = len(spec.split(","))
    code, rep, out = drill(tmp_path, "e1", "--cycles", str(n), "--faults", "all",
                           "--duration", "2", "--drain", "keep", timeout=1800)
    assert code == 0, out
    _check_faults(rep, spec)


def test_a_lost_request_a_mismatch_or_a_leak_fails_the_drill():
    def cycle(n: int, rss: int, lost: int = 0, mismatched=(), ok=True) -> dict:
        return {"cycle": n, "fault": None, "ok": ok, "status": "succeeded", "after": [],
                "engines": [{"engine": "e", "incarnation": 1, "rss_bytes": rss,
                             "verification": {"compared": 3, "mismatched": list(mismatched)},
                             "requests": {"sent": 3, "completed": 3 - lost, "aborted": 0,
                                          "kept": 0, "rejected": 0, "errored": 0,
                                          "ended_by_engine_death": 0, "lost": lost}}]}
    mib = 1 << 20
    good = [cycle(1, 300 * mib), cycle(2, 310 * mib), cycle(3, 320 * mib)]
    assert r.build({}, good, 1.0)["summary"]["ok"]
    assert not r.build({}, good[:2] + [cycle(3, 400 * mib)], 1.0)["summary"]["ok"]  # leak
    assert not r.build({}, good[:2] + [cycle(3, 300 * mib, lost=1)], 1.0)["summary"]["ok"]
    assert not r.build({}, good[:2] + [cycle(3, 300 * mib, mismatched=["x"])],
                       1.0)["summary"]["ok"]
    assert not r.build({}, good[:2] + [cycle(3, 300 * mib, ok=False)], 1.0)["summary"]["ok"]


def test_fault_specs():
    assert [str(x) for x in f.parse_faults("kill-engine@drain#3,residual@release", 4)] == \
        ["residual@release", "kill-engine@drain"]
    assert [x.cycle for x in f.parse_faults("kill-engine@drain#3,residual@release", 4)] == [1, 3]
    for bad, words in [("kill-engine", "KIND@WHERE"), ("explode@drain", "unknown fault kind"),
                       ("kill-engine@seal", "strikes at"), ("residual@release#9", "not in 1..4"),
                       ("residual@release#2,kill-engine@drain#2", "two faults"),
                       ("residual@release," * 5, "at least as many cycles")]:
        with pytest.raises(UsageError, match=words):
            f.parse_faults(bad, 4)


@pytest.mark.parametrize("args, words", [
    (["e1", "--cycles", "0"], "argument --cycles"),
    (["e1", "--cycles", "2", "--faults", "kill-engine@nowhere"], "strikes at"),
    (["bad name!", "--cycles", "1"], "name"),
    (["e1", "e1", "--cycles", "1"], "must differ"),
    (["e1"], "required"),
])
def test_bad_drill_arguments_exit_2(tmp_path, args, words):
    code, _, out = drill(tmp_path, *args, timeout=60)
    assert code == 2 and words in out, out


@pytest.mark.slow  # two engines, a fault and its recovery: about half a minute on 2 cores
def test_recovery_from_failed_restores_only_the_failed_engine(tmp_path):
    """A corrupt weight fails the first engine's restore; the drill's recovery restore goes
    to that engine alone, never to the other one, which the cycle left RUNNING."""
    code, rep, out = drill(tmp_path, "c1", "c2", "--cycles", "1", "--faults",
                           "corrupt-weight@rewake", "--duration", "2",
                           "--drain", "keep")
    assert code == 0, out
    (fault,) = rep["summary"]["faults"]
    assert fault["ok"] and fault["after"] == ["restore (recovery from FAILED): succeeded"], fault
    (cycle,) = rep["cycles"]
    by = {e["engine"]: e for e in cycle["engines"]}
    assert (by["c1"]["state"], by["c2"]["state"]) == ("failed", "running")
    # the picture labels each row with its own engine's outcome, the fault on c1's alone
    lay = tl.layout(rep["cycles"])
    assert cycle["fault_engine"] == "c1"
    assert lay.rows == [f"c1  #1  {by['c1']['status']}  corrupt-weight@rewake",
                        f"c2  #1  {by['c2']['status']}"], lay.rows
    assert by["c2"]["status"] == "succeeded" and by["c1"]["status"] != "succeeded"
    journal = Journal(tmp_path / "rep" / "work" / "state" / "journal.sqlite3")
    try:
        (recovery,) = [o for o in journal.operations(limit=100) if o.op_id.endswith("-recover")]
        assert (recovery.kind, recovery.engines, recovery.status) == ("restore", ["c1"],
                                                                      "succeeded")
        c2 = journal.records(engine="c2", limit=1000)
    finally:
        journal.close()
    assert not [rec for rec in c2 if rec.op_id == recovery.op_id]
    assert [rec.data["dest"] for rec in c2 if rec.type == "transition"] == \
        ["preparing", "prepared", "restoring", "running"]


# ------------------------------------------------------------------------- the timeline

T0 = 1_700_000_000.0


def _phases(start: float, *spec: tuple[str, float], ok: bool = True) -> list[dict]:
    out, t = [], start
    for name, seconds in spec:
        out.append({"name": name, "wall": t, "duration_s": seconds, "ok": ok})
        t += seconds
    return out


def _tl_cycle(n: int, engine: str = "d1", *, stall_s: float = 0.0, fault=None, ok=True,
              aftermath=()) -> dict:
    wall = T0 + 100 * n
    prepare = ("prepare", 0.08 + stall_s)
    phases = _phases(wall, ("pre-prepare", 0.01), prepare, ("capture", 0.05),
                     ("pre-restore", 0.01), ("restore", 0.06), ("post-resume", 0.002),
                     ok=not stall_s)
    return {"cycle": n, "fault": fault, "ok": ok, "status": "failed" if stall_s else "succeeded",
            "wall": wall, "aftermath": [dict(a, wall=wall + a["wall"]) for a in aftermath],
            "engines": [{"engine": engine, "phases": phases,
                         "drain": {"mode": "keep", "drain_s": 0.05 + stall_s}}]}


def test_the_timeline_draws_each_phase_kind_with_a_legend_that_matches(tmp_path):
    cycles = [_tl_cycle(1), _tl_cycle(2)]
    stepwise = _tl_cycle(3, fault="fail-hook@post-restore", ok=False, aftermath=[
        {"kind": "recovery", "engine": "d1", "wall": 1.0, "duration_s": 0.3}])
    stepwise["engines"][0]["phases"] = _phases(
        stepwise["wall"], ("drain", 0.05), ("post-drain", 0.01), ("release", 0.04),
        ("seal", 0.001), ("capture", 0.05), ("rewake", 0.05), ("post-restore", 0.02),
        ("rollback", 0.03))
    stepwise["engines"][0]["phases"][-2]["ok"] = False
    cycles.append(stepwise)
    pic = tl.render(cycles, tmp_path / "t.png")
    assert pic.path.exists() and _png_size(pic.path)[0] > 1000
    assert pic.rows == ["d1  #1  succeeded", "d1  #2  succeeded",
                        "d1  #3  succeeded  fail-hook@post-restore"]
    # a one-round-trip prepare is drawn as drain then release; the recovery after the fault
    assert {"drain", "release", "seal", "capture", "rewake", "hooks", "rollback",
            "recovery"} == set(pic.kinds)
    assert pic.legend == [tl.KINDS[k][0] for k in pic.kinds] + [tl.FAILED_LABEL]
    lay = tl.layout(cycles[:1])
    drain, release = [b for b in lay.bars if b.kind in ("drain", "release")]
    assert [round(x, 6) for x in (drain.start_s, drain.end_s, release.end_s)] == [0.01, 0.06, 0.09]
    assert "seconds" in pic.xlabel and tl.layout(cycles[:2]).cut_s is None
    unsplit = _tl_cycle(4)
    unsplit["engines"][0]["drain"] = None  # a prepare that failed before its drain report
    assert [b.kind for b in tl.layout([unsplit]).bars][:2] == ["hooks", "prepare"]


def test_each_row_is_labelled_with_its_own_engine_and_red_only_for_its_problems():
    c = _tl_cycle(1, "a", fault="kill-engine@drain", ok=False)
    c["fault_engine"] = "a"
    c["engines"].append(dict(_tl_cycle(1, "b")["engines"][0]))
    c["engines"][0]["status"], c["engines"][1]["status"] = "failed", "succeeded"
    c["problems"] = ["a is failed at the end of the cycle"]
    lay = tl.layout([c])
    assert lay.rows == ["a  #1  failed  kill-engine@drain", "b  #1  succeeded"]
    assert lay.bad_rows == [0]
    c["problems"] = ["cycle failed: no error given"]  # names no engine: the whole cycle
    assert tl.layout([c]).bad_rows == [0, 1]
    c["ok"], c["problems"] = True, []
    assert tl.layout([c]).bad_rows == []


def test_a_long_stall_breaks_the_axis_instead_of_squashing_the_other_bars(tmp_path):
    cycles = [_tl_cycle(n, engine) for n in range(1, 6) for engine in ("a", "b")]
    cycles.append(_tl_cycle(6, "a", stall_s=60.0, fault="stall-agent@drain", aftermath=[
        {"kind": "reconcile", "engine": "a", "wall": 61.0, "duration_s": 9.0}]))
    cycles = [dict(c, engines=[e for e in c["engines"]]) for c in cycles]
    pic = tl.render(cycles, tmp_path / "stall.png")
    lay = tl.layout(cycles)
    assert pic.cut_s is not None and 0.2 < pic.cut_s < 1.0 and lay.end_s > 69
    assert "reconcile" in pic.kinds and "broken" in pic.xlabel
    usual = [px for b, px in zip(lay.bars, pic.bar_px)
             if not pic.rows[b.row].endswith("stall-agent@drain") and b.end_s - b.start_s > 0.01]
    # on one linear 70 s axis these would be under a pixel wide; here each is many
    assert len(usual) > 40 and min(usual) > 10
    assert _png_size(pic.path)[1] > 11 * 18
