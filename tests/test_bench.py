"""The benchmark scripts still run and measure what they claim, at sizes of a few seconds.

Figures are never asserted (these machines are noisy); what is checked is that every table's
inputs were really measured: each run present, the re-woken weights verified, requests drained
or aborted as counted. The full runs are in BENCHMARKS.md. ``capture.py`` needs CRIU (``make
criu``) and skips with the reason without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench(tmp_path: Path, script: str, *args: str) -> dict:
    out = tmp_path / f"{script}.json"
    run = subprocess.run([sys.executable, f"bench/{script}.py", *args, "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"wrote {out}" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == script and doc["command"].startswith(f"bench/{script}.py")
    return doc["results"]


def test_control_overhead_and_fan_out(tmp_path):
    res = bench(tmp_path, "control", "--counts", "1,3", "--repeat", "3", "--fanout-repeat", "1")
    assert len(res["single"]["runs_s"]) == 3 and res["single"]["median_s"] > 0
    assert {"prepare", "restore"} <= set(res["single"]["phase_median_s"])
    assert [row["engines"] for row in res["fanout"]] == [1, 3]


def test_agent_cost_of_a_no_op_prepare_and_restore(tmp_path):
    # --compare: a second agent from a source tree (here this one again), measured in turn
    res = bench(tmp_path, "agent_ops", "--pairs", "100", "--rounds", "2", "--levels", "0,2",
                "--compare", str(ROOT))
    assert [row["level"] for row in res["levels"]] == [0, 2]
    assert [row["level"] for row in res["compare"]] == [0, 2]
    assert {row["tree"] for row in res["compare"]} == {f"--compare {ROOT.name}"}
    for row in res["levels"] + res["compare"]:
        assert row["pairs"] == 100 and len(row["runs"]) == 2
        assert row["cpu_per_pair_s"] > 0 and row["wall_per_pair_s"] > 0
        for run in row["runs"]:  # the child's CPU was read: it cannot do 100 pairs for free
            assert run["raw_cpu_per_pair_s"] > 0 and run["wall_per_pair_s"] > 0
            assert run["idle_cpu_rate"] >= 0


def test_release_and_rewake_against_the_copy_limits(tmp_path):
    res = bench(tmp_path, "memory", "--sizes", "0.25", "--repeat", "2")
    (row,) = res["sizes"]
    assert row["verified_tensors"] == 1  # the re-woken weight was checked bit-exact
    for key in ("fresh_s", "touched_s", "prefaulted_s", "release_s", "rewake_s"):
        assert len(row["runs"][key]) == 2 and all(v > 0 for v in row["runs"][key])
    assert row["rewake_vs_fresh"] > 0 and row["rewake_vs_prefaulted"] > 0


def test_level_1_is_a_gpu_measurement_and_says_so_elsewhere(tmp_path):
    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, "bench/memory.py", "--level", "1", "--sizes", "0.01",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--device cuda" in run.stderr and not out.exists()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_level_1_offload_and_rewake_against_pinned_copies(tmp_path):
    res = bench(tmp_path, "memory", "--device", "cuda", "--level", "1", "--sizes", "0.5",
                "--repeat", "2")
    (row,) = res["sizes"]
    assert row["verified_tensors"] == row["weight_bytes"] // (256 << 20)  # every weight checked
    assert row["offloaded_bytes"] == row["weight_bytes"] and row["freed_bytes"] > 0
    for key in ("d2h_s", "h2d_s", "release_s", "rewake_s"):
        assert len(row["runs"][key]) == 2 and all(v > 0 for v in row["runs"][key])
    assert row["release_vs_d2h"] > 0 and row["rewake_vs_h2d"] > 0


def test_fresh_memory_fills(tmp_path):
    res = bench(tmp_path, "pages", "--gib", "0.125", "--repeat", "1", "--idle", "0")
    assert set(res["ways"]) == {"4 KiB faults", "pre-faulted", "huge pages"}
    for way in res["ways"].values():
        assert way["hot_gbps"] > 0 and way["idle_gbps"] > 0


def test_drain_wait_and_abort(tmp_path):
    res = bench(tmp_path, "drain", "--waits", "2", "--aborts", "20", "--repeat", "1")
    (wait,) = res["wait"]
    assert wait["completed"] == wait["requests"] == 2
    (abort,) = res["abort"]
    assert abort["aborted"] + abort["completed_meanwhile"] == abort["requests"] == 20
    assert "abort" in abort["finish_reasons"] and abort["client_saw_all_ends_s"] > 0


def test_capture_against_an_unprepared_dump(tmp_path):
    from test_criu import _reason

    if _reason is not None:
        pytest.skip(_reason)
    res = bench(tmp_path, "capture", "--repeat", "1", "--image-dir", str(tmp_path))
    levels = [d["level"] for d in res["dumps"]]
    assert levels == [None, 1, 2] and all(d["image_bytes"] > 0 for d in res["dumps"])
    unprepared, _, level2 = res["dumps"]
    assert level2["image_bytes"] < unprepared["image_bytes"]  # releasing is what prepare is for
    assert res["restore"]["restore_to_first_token_s"] > res["restore"]["criu_restore_s"] > 0
    assert res["cold"]["start_to_first_token_s"] > 0


def test_safetensors_writer_against_a_plain_write(tmp_path):
    res = bench(tmp_path, "safetensors_write", "--mib", "4", "--tensors", "2", "--repeat", "2",
                "--dir", str(tmp_path))
    assert res["bytes"] == 4 << 20 and res["tensors"] == 2
    for key in ("save_file_s", "plain_write_s"):
        assert len(res["runs"][key]) == 2 and all(v > 0 for v in res["runs"][key])
    assert res["save_file_vs_plain_write"] > 0


def test_checksum_against_torch_sum(tmp_path):
    res = bench(tmp_path, "checksum", "--mib", "8", "--repeat", "2")
    assert res["bytes"] == 8 << 20
    for way in ("checksum", "sum"):
        assert len(res[way]["runs_s"]) == 2 and res[way]["gbps"] > 0
