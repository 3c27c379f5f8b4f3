"""The drill's verdict: ``report.json`` from the cycles' records, and the exit code.

A drill fails (exit 1) when any request was lost, any completed output differed from an
uninterrupted run, memory leaked (an engine's RSS after the last cycle more than
``max(LEAK_MARGIN_BYTES, LEAK_MARGIN_RATIO x RSS)`` above its RSS after the first cycle of
the same process), or any cycle broke its fault's documented outcome or left an engine not
RUNNING. Neighbours: ``runner`` (the records), ``timeline`` (the picture).
"""

from __future__ import annotations

import json
from pathlib import Path

LEAK_MARGIN_BYTES = 64 << 20
LEAK_MARGIN_RATIO = 0.05


def leaks(cycles: list[dict]) -> list[dict]:
    """Per engine: RSS after the first and the last cycle of its latest process that ran at
    least two cycles, and whether the growth is over the margin."""
    out = []
    names = dict.fromkeys(e["engine"] for c in cycles for e in c["engines"])
    for name in names:
        runs: dict[int, list[int]] = {}
        for c in cycles:
            for e in c["engines"]:
                if e["engine"] == name and e["rss_bytes"] is not None:
                    runs.setdefault(e["incarnation"], []).append(e["rss_bytes"])
        longest = [rss for rss in runs.values() if len(rss) >= 2]
        if not longest:
            continue
        rss = longest[-1]
        margin = max(LEAK_MARGIN_BYTES, int(LEAK_MARGIN_RATIO * rss[0]))
        out.append({"engine": name, "cycles": len(rss), "rss_first_bytes": rss[0],
                    "rss_last_bytes": rss[-1], "growth_bytes": rss[-1] - rss[0],
                    "margin_bytes": margin, "leaked": rss[-1] - rss[0] > margin})
    return out


def build(options: dict, cycles: list[dict], duration_s: float) -> dict:
    # .get: "shed" came later than the other counts; cycles recorded before it have none
    total = {k: sum(e["requests"].get(k, 0) for c in cycles for e in c["engines"])
             for k in ("sent", "completed", "aborted", "kept", "rejected", "shed", "errored",
                       "ended_by_engine_death", "lost")}
    mismatched = sum(len(e["verification"]["mismatched"]) for c in cycles for e in c["engines"])
    compared = sum(e["verification"]["compared"] for c in cycles for e in c["engines"])
    leak = leaks(cycles)
    bad_cycles = [c["cycle"] for c in cycles if not c["ok"]]
    ok = (total["lost"] == 0 and mismatched == 0 and not any(x["leaked"] for x in leak)
          and not bad_cycles)
    return {
        "options": options, "duration_s": duration_s,
        "summary": {"ok": ok, "cycles": len(cycles), "cycles_with_problems": bad_cycles,
                    "requests": total, "outputs_compared": compared,
                    "outputs_mismatched": mismatched, "memory": leak,
                    "faults": [{"cycle": c["cycle"], "fault": c["fault"], "ok": c["ok"],
                                "status": c["status"], "seen_state": c.get("seen_state"),
                                "error": c.get("error"), "after": c["after"]}
                               for c in cycles if c["fault"]]},
        "cycles": cycles,
    }


def write(report: dict, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "report.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def describe(report: dict) -> str:
    s = report["summary"]
    r = s["requests"]
    lines = [
        f"{s['cycles']} cycles in {report['duration_s']:.1f} s: "
        + ("all good" if s["ok"] else f"PROBLEMS in cycles {s['cycles_with_problems']}"),
        f"requests: {r['sent']} sent, {r['completed']} completed, {r['aborted']} aborted, "
        f"{r['kept']} kept across cycles, {r['rejected']} rejected (while not RUNNING, or "
        f"{r['shed']} of them shed by a full engine), "
        f"{r['ended_by_engine_death']} ended with their engine's death, {r['lost']} lost",
        f"outputs: {s['outputs_compared'] - s['outputs_mismatched']} of "
        f"{s['outputs_compared']} identical to an uninterrupted run",
    ]
    for m in s["memory"]:
        lines.append(f"memory {m['engine']}: RSS {m['rss_first_bytes'] >> 20} MiB after its "
                     f"first cycle, {m['rss_last_bytes'] >> 20} MiB after its last "
                     f"({m['cycles']} cycles; margin {m['margin_bytes'] >> 20} MiB)"
                     + (": LEAK" if m["leaked"] else ""))
    for f in s["faults"]:
        lines.append(f"fault #{f['cycle']} {f['fault']}: {f['status']}, engine {f['seen_state']}"
                     + (f", then {'; '.join(f['after'])}" if f["after"] else "")
                     + ("" if f["ok"] else "  <- not as documented"))
    return "\n".join(lines)
