"""The benchmark scripts still run and measure what they claim, at sizes of a few seconds.

Figures are never asserted (these machines are noisy); what is checked is that every table's
inputs were really measured: each run present, the re-woken weights verified, requests drained
or aborted as counted. The full runs are in BENCHMARKS.md. ``capture.py`` needs CRIU (``make
criu``) and skips with the reason without it; ``fleet.py`` needs etcd (``make etcd``), skips
likewise, and is in the ``fleet`` suite, as is ``migrate.py`` (root, CRIU and etcd);
``migrate_vllm.py`` (a real vLLM moved: about three minutes) is in ``-m 'vllm and fleet'``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT
from support.timing import scaled


def bench(tmp_path: Path, script: str, *args: str) -> dict:
    out = tmp_path / f"{script}.json"
    run = subprocess.run([sys.executable, f"bench/{script}.py", *args, "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=scaled(240))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"wrote {out}" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == script and doc["command"].startswith(f"bench/{script}.py")
    return doc["results"]


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_control_overhead_and_fan_out(tmp_path):
    res = bench(tmp_path, "control", "--counts", "1,3", "--repeat", "3", "--fanout-repeat",
                "1", "--round-trips", "200", "--floor-cycles", "20")
    assert len(res["single"]["runs_s"]) == 3 and res["single"]["median_s"] > 0
    assert {"prepare", "restore"} <= set(res["single"]["phase_median_s"])
    assert [row["engines"] for row in res["fanout"]] == [1, 3]
    rt = res["round_trip"]
    assert rt["round_trips"] == 200
    assert all(positive(rt[k]) for k in ("median_s", "p90_s", "median_before_s",
                                         "median_after_s"))
    for row in [res["single"]] + res["fanout"]:  # every time also in bare round trips
        assert all(positive(row[k]) for k in (
            "median_rt", "p90_rt", "measured_s", "idle_s", "controller_cpu_s", "agents_cpu_s",
            "controller_cpu_per_engine_cycle_s", "controller_net_cpu_per_engine_cycle_s",
            "controller_net_cpu_per_engine_cycle_rt", "agents_cpu_per_engine_cycle_s",
            "agents_net_cpu_per_engine_cycle_s", "agents_net_cpu_per_engine_cycle_rt"))
        assert row["idle_s"] >= row["measured_s"]  # idle as long as the cycles measured
        assert row["controller_idle_cpu_s"] >= 0 and row["agents_idle_cpu_s"] >= 0
        assert set(row["phase_median_rt"]) == set(row["phase_median_s"])
    # the floor: the same I/O with none of the project's code, journal on disk and in memory
    assert set(res["floor"]) == {"disk", "memory"}
    for row in res["floor"].values():
        assert row["cycles"] == 20
        assert all(positive(row[k]) for k in ("median_s", "p90_s", "median_rt",
                                              "controller_cpu_per_cycle_s",
                                              "agent_cpu_per_cycle_s"))
    fit = res["fit"]
    assert fit["counts"] == [1, 3]
    # a line through two noisy counts: its sign is the machine's to say, not this test's
    assert all(math.isfinite(fit[k]) for k in ("slope_s", "intercept_s", "slope_rt",
                                               "intercept_rt"))
    goals = {g["goal"]: g for g in res["goals"]}
    assert set(goals) == {"single_rt", "fanout_slope_rt", "controller_cpu_ms", "agent_cpu_ms",
                          "single_memory_rt"}  # /dev/shm is there on every Linux we run on
    assert goals["single_rt"]["value"] == res["single"]["median_rt"]
    # the same cycle with the journal in memory: what the disk's fsyncs cost, seen beside it
    memory = res["single_memory"]
    assert len(memory["runs_s"]) == 3 and positive(memory["median_rt"])
    assert goals["single_memory_rt"]["value"] == memory["median_rt"]
    assert goals["fanout_slope_rt"]["value"] == fit["slope_rt"]
    for g in goals.values():
        assert positive(g["limit"]) and g["met"] == (g["value"] <= g["limit"])
    for key, who in (("controller_cpu_ms", "controller"), ("agent_cpu_ms", "agents")):
        assert positive(goals[key]["value"])  # the worst count's, in ms
        assert goals[key]["value"] == max(r[f"{who}_net_cpu_per_engine_cycle_s"] * 1e3
                                          for r in [res["single"]] + res["fanout"])


def test_cycle_timeline_stamps_every_step_in_order(tmp_path):
    res = bench(tmp_path, "cycle_timeline", "--repeat", "5", "--round-trips", "50")
    assert positive(res["round_trip_s"])
    assert set(res["journals"]) == {"disk", "memory"}
    steps = ["request", "op_thread", "begun", "call1_sent", "call1_back", "call2_sent",
             "call2_back", "finishing", "finished", "reply_queued", "reply_sent", "client"]
    for journal in res["journals"].values():
        assert journal["cycles"] == 5
        at = journal["median_offset_s"]
        assert list(at) == steps
        # each cycle passes the steps in this order, so their medians keep it
        offsets = [at[k] for k in steps]
        assert all(positive(t) for t in offsets) and offsets == sorted(offsets), at


def test_journal_reads_timed_at_each_journal_size(tmp_path):
    res = bench(tmp_path, "journal_growth", "--ops", "30,300", "--engines", "3", "--records",
                "4", "--repeat", "2")
    assert res["code"] == "this checkout"
    assert [r["ops"] for r in res["sizes"]] == [30, 300]
    for row in res["sizes"]:
        assert row["records"] == row["ops"] * 4
        assert positive(row["filled_s"]) and positive(row["first_start_s"])
        assert set(row["median_s"]) == {"startup", "status", "history", "captures", "lookup"}
        assert all(positive(t) for t in row["median_s"].values())


def test_status_at_many_engines(tmp_path):
    res = bench(tmp_path, "status", "--engines", "3", "--per-process", "2", "--repeat", "2",
                "--group-ops", "1", "--single-ops", "2")
    assert res["engines"] == 3 and res["operations"] == 3
    (code,) = res["codes"].values()
    assert len(code["runs_s"]) == 2 and all(positive(t) for t in code["runs_s"])
    assert positive(code["status_request_median_s"]) and code["last_op_in_reply"] is True


def test_journal_records_and_operations_share_fsyncs(tmp_path):
    res = bench(tmp_path, "journal", "--threads", "1,8", "--records", "400", "--ops", "16",
                "--repeat", "1", "--dir", str(tmp_path))
    assert [r["threads"] for r in res["records"]] == [1, 8]
    for row in res["records"]:
        assert row["records"] == 400 and row["per_s"] > 0 and row["call_median_us"] > 0
        # group commit: many records to one fsync (one each before it)
        assert 1 <= row["fsyncs"] < row["records"] / 10, row
    for row in res["operations"]:
        assert row["operations"] == 16 and row["records_per_op"] == 14 and row["per_s"] > 0
        # begin and finish are the fsyncs: at most two per operation, never one per record
        assert 0 < row["fsyncs_per_op"] <= 2, row
    assert res["summary"]["records"][0]["threads"] == 1


def test_agent_cost_of_a_no_op_prepare_and_restore(tmp_path):
    # --compare: a second agent from a source tree (here this one again), measured in turn
    res = bench(tmp_path, "agent_ops", "--pairs", "100", "--rounds", "2", "--levels", "0,2",
                "--compare", str(ROOT), "--micro", "500")
    assert [row["level"] for row in res["levels"]] == [0, 2]
    assert [row["level"] for row in res["compare"]] == [0, 2]
    assert {row["tree"] for row in res["compare"]} == {f"--compare {ROOT.name}"}
    for row in res["levels"] + res["compare"]:
        assert row["pairs"] == 100 and len(row["runs"]) == 2
        assert row["cpu_per_pair_s"] > 0 and row["wall_per_pair_s"] > 0
        for run in row["runs"]:  # the child's CPU was read: it cannot do 100 pairs for free
            assert run["raw_cpu_per_pair_s"] > 0 and run["wall_per_pair_s"] > 0
            assert run["idle_cpu_rate"] >= 0
    # the two agents' difference, round by round, for each level
    assert [d["level"] for d in res["differences"]] == [0, 2]
    for d, mine, other in zip(res["differences"], res["levels"], res["compare"]):
        assert d["rounds_s"] == [a["cpu_per_pair_s"] - b["cpu_per_pair_s"]
                                 for a, b in zip(mine["runs"], other["runs"])]
    # the lifecycle alone, each tree in its own fresh processes, in turn
    assert [row["tree"] for row in res["micro"]] == ["this checkout", f"--compare {ROOT.name}"]
    for row in res["micro"]:
        assert row["cycles"] == 500 and len(row["runs"]) == 2 and all(map(positive, row["runs"]))
        assert row["cpu_per_pair_s"] == 4 * row["cpu_per_trigger_s"]


def test_release_and_rewake_against_the_copy_limits(tmp_path):
    res = bench(tmp_path, "memory", "--sizes", "0.0625", "--repeat", "2")
    (row,) = res["sizes"]
    assert row["verified_tensors"] == 1  # the re-woken weight was checked bit-exact
    for key in ("fresh_s", "touched_s", "prefaulted_s", "release_s", "rewake_s"):
        assert len(row["runs"][key]) == 2 and all(v > 0 for v in row["runs"][key])
    assert row["rewake_vs_fresh"] > 0 and row["rewake_vs_prefaulted"] > 0


def test_level_1_is_a_gpu_measurement_and_says_so_elsewhere(tmp_path):
    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, "bench/memory.py", "--level", "1", "--sizes", "0.01",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=scaled(120))
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
    # every request in flight when the drain began completed (on a busy machine one may end
    # before the prepare arrives: then it was not in flight, and the case is run again)
    assert wait["requests"] == 2 and 1 <= wait["completed"] == wait["in_flight_at_start"]
    assert wait["in_flight_at_start"] == 2 or wait["tries"] > 1, wait
    (abort,) = res["abort"]
    assert abort["aborted"] + abort["completed_meanwhile"] == abort["requests"] == 20
    assert "abort" in abort["finish_reasons"] and abort["client_saw_all_ends_s"] > 0


def test_capture_against_an_unprepared_dump(tmp_path):
    from support.criu import criu_missing

    if (why := criu_missing()) is not None:
        pytest.skip(why)
    res = bench(tmp_path, "capture", "--repeat", "1", "--model", "tiny", "--image-dir", str(tmp_path))
    levels = [d["level"] for d in res["dumps"]]
    assert levels == [None, 1, 2] and all(d["image_bytes"] > 0 for d in res["dumps"])
    unprepared, _, level2 = res["dumps"]
    assert level2["image_bytes"] < unprepared["image_bytes"]  # releasing is what prepare is for
    assert res["restore"]["restore_to_first_token_s"] > res["restore"]["criu_restore_s"] > 0
    assert res["cold"]["start_to_first_token_s"] > 0
    # the re-wake against the fresh-copy limit, both measured in this run
    rewake = res["rewake"]
    assert len(rewake["runs"]) == 1 and rewake["verified_tensors"] > 0
    assert rewake["bytes"] > 0 and rewake["fresh_copy_s"] > 0 and rewake["fresh_copy_gbps"] > 0
    assert rewake["restore_reply_s"] > rewake["rewake_s"] > 0 and rewake["golden_prompt_s"] > 0
    assert rewake["rewake_client_s"] >= rewake["restore_reply_s"]
    assert rewake["rewake_over_fresh_copy"] == pytest.approx(
        rewake["rewake_s"] / rewake["fresh_copy_s"])
    assert rewake["goal"] == 1.25 and rewake["goal_met"] == (rewake["rewake_over_fresh_copy"]
                                                             <= 1.25)


def test_start_up_of_help_and_status(tmp_path):
    res = bench(tmp_path, "startup", "--repeat", "2")
    rows = {r["command"]: r for r in res["commands"]}
    assert {"ckptctl --help", "ckptctl status", "python (bare interpreter)"} <= set(rows)
    for row in rows.values():
        assert len(row["runs_s"]) == 2 and all(positive(t) for t in row["runs_s"])
    # status answered (a failing command would have stopped the run): it starts the CLI and
    # asks a controller, so it takes more CPU than the bare interpreter (the steadier figure:
    # two runs' wall times on a loaded machine can come out either way)
    assert rows["ckptctl status"]["cpu_median_s"] > rows["python (bare interpreter)"][
        "cpu_median_s"]
    assert isinstance(res["status_within_goal"], bool) and res["goal_help_s"] == 0.3


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


@pytest.mark.fleet
def test_fleet_cycle_against_direct_cycles_and_its_etcd_requests(tmp_path):
    from support import etcd_cluster

    if not etcd_cluster.installed():
        pytest.skip("etcd is not installed: run `make etcd`")
    res = bench(tmp_path, "fleet", "--nodes", "2", "--agents", "2", "--repeat", "1")
    assert (res["nodes"], res["agents_per_node"], res["engines"]) == (2, 2, 4)
    (r,) = res["rounds"]
    assert positive(r["direct_s"]) and positive(r["fleet_s"]) and r["fleet_op"]
    assert r["quiet_s"] >= r["fleet_s"]  # quiet as long as the fleet cycle took
    # the fleet cycle was counted in etcd: it reads and writes its parts (the direct ones too:
    # each node-local operation takes its engines' locks there)
    assert r["fleet_requests"].get("KV.Txn", 0) >= 4 and r["fleet_requests"].get("KV.Range")
    assert r["direct_requests"].get("KV.Txn", 0) >= 4
    assert sum(r["quiet_requests"].values()) > 0  # the nodes publish even when nothing moves
    for way in ("direct", "fleet"):
        assert res[way]["runs_s"] == [r[f"{way}_s"]] and res[way]["median_s"] == r[f"{way}_s"]
        rq = res["requests"][way]
        assert rq["gross_median"] == sum(r[f"{way}_requests"].values()) / 4
        assert rq["net_median"] <= rq["gross_median"]
        assert set(rq["by_method"]) == set(r[f"{way}_requests"]) | set(r["quiet_requests"])
    assert res["fleet_minus_direct_s"] == pytest.approx(r["fleet_s"] - r["direct_s"])
    assert res["fleet_over_direct"] == pytest.approx(r["fleet_s"] / r["direct_s"])
    goals = {g["goal"]: g for g in res["goals"]}
    assert set(goals) == {"requests_per_engine", "fleet_minus_direct_s"}
    assert goals["requests_per_engine"]["value"] == res["requests"]["fleet"]["net_median"]
    assert goals["fleet_minus_direct_s"]["value"] == res["fleet_minus_direct_s"]
    for g in goals.values():
        assert positive(g["limit"]) and g["met"] == (g["value"] <= g["limit"])


@pytest.mark.fleet
def test_migration_downtime_against_a_cold_start_and_the_image_it_moved(tmp_path):
    from support.criu import migration_missing

    if (why := migration_missing()) is not None:
        pytest.skip(why)
    res = bench(tmp_path, "migrate", "--quick")
    assert res["repeat"] == 1 and res["model_args"][:2] == ["--model", "tiny"]
    assert set(res["transports"]) == {"page-server", "shared"}
    for transport, t in res["transports"].items():
        (run,) = t["runs"]
        assert run["transport"] == transport
        assert run["kept_across"] >= 1  # requests were under way when the engine moved
        # the ratio against a cold start measured in the same run
        assert positive(run["downtime_over_cold"]) and positive(run["downtime_s"])
        assert run["downtime_over_cold"] == pytest.approx(run["downtime_s"] / run["cold_s"])
        assert run["cold_s"] >= run["cold_ready_s"] > 0  # ready, then the first token
        # the image, read where it landed: pages, and the rest (tens of KiB, not pages)
        assert run["pages_bytes"] > 0 and 0 < run["rest_bytes"] < run["pages_bytes"]
        assert run["image_bytes"] == run["pages_bytes"] + run["rest_bytes"]
        assert run["pages_written_bytes"] == run["pages_bytes"]  # CRIU's own count agrees
        assert positive(run["frozen_s"]) and positive(run["restore_s"])
        # each step timed from the migration record: one after the other, inside the
        # operation's life, inside the command's
        assert set(run["steps_s"]) == {"receive", "send", "adopt", "finish"}
        assert all(v >= 0 for v in run["steps_s"].values())
        assert min(run[k] for k in ("before_first_s", "between_steps_s", "after_last_s",
                                    "command_s")) >= 0
        assert t["median"]["downtime_over_cold"] == run["downtime_over_cold"]
        assert run["migrate_over_downtime"] == pytest.approx(run["migrate_s"] / run["downtime_s"])
        # after the engine's RUNNING on n2: the client moved (its watch), then heard, then
        # got a new token; each well inside the downtime
        assert run["client_moved_s"] <= run["client_wait_s"] <= run["first_token_after_ready_s"]
        assert run["first_token_after_ready_s"] < run["downtime_s"]
        # each node-local operation's phases, from the nodes' journals
        assert set(run["phases_s"]) == {"prepare", "capture", "restore"}
        assert positive(run["phases_s"]["capture"]["capture"])
        assert {"pre-restore", "rewake", "resume"} <= set(run["phases_s"]["restore"])
        # what the downtime is made of: CRIU's dump from its log, inside the capture hook's
        # run, inside the capture phase; CRIU's restore (its stats) inside its process (the
        # hook's measure), inside the criu-restore hook's run; the image checks, the hooks'
        # own work and the hook runner's; the parts and the rest add up to it
        parts, hooks = run["downtime_parts_s"], run["hooks_s"]
        assert (0 < run["criu_dump_s"] < hooks["capture"]["dump"]
                <= run["phases_s"]["capture"]["capture"])
        assert (0 < run["restore_s"] < run["criu_restore_process_s"]
                < hooks["restore"]["pre-restore"] <= run["phases_s"]["restore"]["pre-restore"])
        assert parts["criu dump"] == run["criu_dump_s"]
        assert positive(run["image_check_s"])
        assert parts["hooks' own"] > 0 and parts["hook runner"] >= 0
        assert sum(parts.values()) == pytest.approx(run["downtime_s"])
        assert t["median"]["downtime_parts_s"] == parts
    ps = res["transports"]["page-server"]["runs"][0]
    # streamed pages plus the small files packed through etcd (smaller than unpacked)
    assert 0 < ps["small_packed_bytes"] < ps["rest_bytes"]
    assert ps["moved_bytes"] == ps["pages_bytes"] + ps["small_packed_bytes"]
    assert positive(ps["moved_over_image"])
    shared = res["transports"]["shared"]["runs"][0]
    assert shared["moved_bytes"] == 0 and shared["moved_over_image"] == 0  # nothing copied


@pytest.mark.vllm
@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_a_vllm_move_against_a_vllm_cold_start_loses_nothing(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "fleet"))
    from test_vllm_migrate import _vllm_reason

    if _vllm_reason is not None:
        pytest.skip(_vllm_reason)
    out = tmp_path / "migrate_vllm.json"
    run = subprocess.run([sys.executable, "bench/migrate_vllm.py", "--clients", "2",
                          "--tokens", "8", "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=scaled(800))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    (moved,) = res["runs"]
    assert moved["outcome"] == "moved" and moved["lost"] == 0 and moved["wrong_answers"] == 0
    assert moved["answers"] >= 2 * 2 + 2  # each client twice on n1, then once on n2 at least
    assert positive(moved["downtime_s"]) and moved["cold_s"] >= moved["cold_ready_s"] > 0
    assert moved["downtime_over_cold"] == pytest.approx(moved["downtime_s"] / moved["cold_s"])
    assert set(moved["steps_s"]) == {"receive", "send", "adopt", "finish"}
    assert positive(moved["frozen_s"]) and positive(moved["restore_s"])
    # each CRIU hook's run beyond CRIU's own process: the image checks and the hooks' work
    assert positive(moved["dump_hook_beyond_criu_s"])
    assert positive(moved["restore_hook_beyond_criu_s"])
    assert moved["image_bytes"] >= sum(size for size, _ in moved["largest_files"]) > 0
