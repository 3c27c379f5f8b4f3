"""Control overhead: what the lifecycle machinery itself costs, with nothing to drain, no
memory and no hooks, how a cycle's time grows with the number of engines, and what CPU the
controller and the agents spend on it; every time also in bare round trips of the transport.

Agents are real ``Agent`` objects with nothing registered, hosted in separate processes
(``--per-process`` agents each, so 1,000 agents fit in memory), each on its own ipc socket.
The controller is a real ``ControllerServer`` (SQLite journal, fsync per record) alone in its
own process, driven by a ``ControllerClient`` from this one over its socket, as the CLI would.
Each engine count gets agents and a controller of its own, started for it and ended after it:
no idle agent of a larger count shares the CPUs with a smaller one's cycles (in a fleet the
other engines' agents run on other hosts).

- bare round trip: a pyzmq DEALER here and a ROUTER echo in its own process, over ipc as the
  agents are reached; ``--round-trips`` small messages, half before the cycles and half after,
  timed one by one. Its median is the unit "bare round trips" (RT) of every table;
- single: ``--repeat`` cycles of one engine, one after the other (median, p90), and its
  phases as the controller timed them (each its call to the agent: request to reply); then
  the same again with the journal in memory (``/dev/shm``, unless ``--state-dir`` chose
  where): the difference is what the journal's two fsyncs per operation cost on this disk;
- fan-out: one ``cycle`` over N engines at once (max-unavailable N) for each N,
  ``--fanout-repeat`` times but at least ``--repeat`` engine-cycles in all, and a
  least-squares line through the medians: what each additional engine adds;
- CPU: the controller's process and all agent hosts, read from their CPU clocks just before
  the first and just after the last measured cycle of each count, per engine per cycle; then
  read again over an idle interval as long, right after (heartbeats, reconciler ticks):
  "net" takes that idle rate, over the measured time, off;
- floor: the same I/O as one engine's cycle with none of this project's code (``FloorHost``:
  a request, two fsynced SQLite commits holding the operation's row and its records and
  result, two round trips to the echo as its agent, the answer), ``--floor-cycles`` times,
  its journal on disk and in memory: its wall time, its own CPU and the echo's, per cycle.
  What this project's code adds is each figure over its floor;
- goals: issue 15's goals, each measured above, against its limit.

Each controller starts with a warm-up cycle that is not measured (connections, imports).
Neighbours: ``_hosts`` (the processes and their CPU clocks), ``_common`` (tables, JSON).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import median, p90, parser, table, write
from _hosts import ControllerHost, EchoHost, FloorHost, Fleet

from ckpt_controller.vocab import OperationKind, OperationStatus

#: a file system in memory: a journal there pays no disk fsync
MEMORY_DIR = Path("/dev/shm")
#: issue 15's limits: (key, what, limit, unit)
GOALS = [("single_rt", "one engine, one cycle", 20.0, "bare RT"),
         ("fanout_slope_rt", "fan-out: each additional engine", 5.0, "bare RT"),
         ("controller_cpu_ms", "controller CPU per engine per cycle, net", 0.5, "ms"),
         ("agent_cpu_ms", "agent CPU per no-op prepare+restore, net", 0.5, "ms")]
#: the first goal again, measured with the journal in ``MEMORY_DIR``
MEMORY_ROW = ("single_memory_rt", "one engine, one cycle, less the disk's fsyncs", 20.0,
              "bare RT")


def config(d: Path, n: int, state: Path) -> str:
    engines = "".join(f'[[engine]]\nname = "a{i}"\ncontrol = "ipc://{d}/a{i}.ctl"\n'
                      for i in range(n))
    return (f'[controller]\nendpoint = "ipc://{d}/controller.sock"\nstate_dir = "{state}"\n'
            f'heartbeat_interval_s = 1.0\n[defaults]\nlevel = 0\ndrain = "abort"\n' + engines)


def run_count(d: Path, n: int, args, reps: int, state_dir: Path | None = None) -> dict:
    """``reps`` measured cycles of ``n`` engines at once, with a fleet of ``n`` agents and a
    controller of their own, all in ``d`` (the journal in ``state_dir`` when given, else in
    ``--state-dir``, else in ``d``)."""
    from ckpt_controller.controller.client import ControllerClient

    d.mkdir()
    conf = d / "controller.toml"
    conf.write_text(config(d, n, (state_dir or args.state_dir or d) / f"state-{d.name}"))
    fleet = Fleet(d, n, args.per_process)
    with contextlib.closing(fleet), ControllerHost(conf) as ctl, \
            ControllerClient(ctl.endpoint, timeout_s=120) as c:
        c.subscribe()
        names = [f"a{i}" for i in range(n)]
        r = c.cycle(names, max_unavailable=n)  # warm: connections, imports
        assert r.status == OperationStatus.SUCCEEDED, f"{n} engines, warm-up: {r.error}"
        times, results = [], []
        cpu0, start = (ctl.cpu_s(), fleet.cpu_s()), time.perf_counter()
        for _ in range(reps):
            t0 = time.perf_counter()
            r = c.cycle(names, max_unavailable=n)
            times.append(time.perf_counter() - t0)
            assert r.status == OperationStatus.SUCCEEDED, f"{n} engines: {r.error}"
            results.append(r)
        measured_s = time.perf_counter() - start
        cpu1 = (ctl.cpu_s(), fleet.cpu_s())
        time.sleep(measured_s)  # the idle interval: the same controller, client and fleet
        idle_s = time.perf_counter() - start - measured_s
        cpu2 = (ctl.cpu_s(), fleet.cpu_s())
    phases: dict[str, list[float]] = {}
    for r in results:
        for o in r.engines:
            for ph in o.phases:
                phases.setdefault(ph.name, []).append(ph.duration_s)
    row = {"engines": n, "cycles": len(times), "median_s": median(times), "p90_s": p90(times),
           "runs_s": times, "phase_median_s": {k: median(v) for k, v in phases.items()},
           "measured_s": measured_s, "idle_s": idle_s}
    print(f"{n} engines: {reps} cycles, median {row['median_s'] * 1e3:.1f} ms",
          file=sys.stderr, flush=True)  # progress: the tables come at the end
    for i, who in enumerate(("controller", "agents")):
        busy, idle = cpu1[i] - cpu0[i], cpu2[i] - cpu1[i]
        net = busy - idle / idle_s * measured_s
        row |= {f"{who}_cpu_s": busy, f"{who}_idle_cpu_s": idle,
                f"{who}_cpu_per_engine_cycle_s": busy / (n * reps),
                f"{who}_net_cpu_per_engine_cycle_s": net / (n * reps)}
    return row


def round_trip(before: list[float], after: list[float]) -> dict:
    both = before + after
    return {"round_trips": len(both), "median_s": median(both), "p90_s": p90(both),
            "median_before_s": median(before), "median_after_s": median(after)}


def in_rt(results: dict) -> None:
    """Add each time's value in bare round trips (``*_rt``) to the rows."""
    rt = results["round_trip"]["median_s"]
    for row in [results["single"]] + results["fanout"] + \
            ([results["single_memory"]] if results.get("single_memory") else []):
        row |= {"median_rt": row["median_s"] / rt, "p90_rt": row["p90_s"] / rt,
                "phase_median_rt": {k: v / rt for k, v in row["phase_median_s"].items()}}
        for who in ("controller", "agents"):
            row[f"{who}_net_cpu_per_engine_cycle_rt"] = \
                row[f"{who}_net_cpu_per_engine_cycle_s"] / rt
    for row in results.get("floor", {}).values():
        row["median_rt"] = row["median_s"] / rt


def fit(results: dict) -> dict | None:
    """The least-squares line of the fan-out's median cycle time against its engine count
    (``None`` with fewer than two counts)."""
    rows = results["fanout"]
    if len({r["engines"] for r in rows}) < 2:
        return None
    line = statistics.linear_regression([r["engines"] for r in rows],
                                        [r["median_s"] for r in rows])
    rt = results["round_trip"]["median_s"]
    return {"counts": [r["engines"] for r in rows], "slope_s": line.slope,
            "intercept_s": line.intercept, "slope_rt": line.slope / rt,
            "intercept_rt": line.intercept / rt}


def floor(d: Path, echo: EchoHost, journal_dir: Path, cycles: int) -> dict:
    """``cycles`` requests to a ``FloorHost`` whose journal is in ``journal_dir`` and whose
    agent is ``echo``: per cycle its median wall time, its CPU and the echo's."""
    host = FloorHost(f"ipc://{d}/floor-{journal_dir.name}.sock", echo.endpoint,
                     journal_dir / "floor.sqlite3", d / "floor.log")
    try:
        host.cycles(10)  # warm (and a first checkpoint of the WAL, if any, not measured)
        cpu0 = (host.cpu_s(), echo.cpu_s())
        times = host.cycles(cycles, warm=0)
        cpu1 = (host.cpu_s(), echo.cpu_s())
    finally:
        host.close()
    return {"cycles": cycles, "median_s": median(times), "p90_s": p90(times),
            "controller_cpu_per_cycle_s": (cpu1[0] - cpu0[0]) / cycles,
            "agent_cpu_per_cycle_s": (cpu1[1] - cpu0[1]) / cycles}


def plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'s' if count != 1 else ''}"


def engines(row: dict) -> str:
    return f"{plural(row['engines'], 'engine')}, {plural(row['cycles'], 'cycle')}"


def goals(results: dict) -> list[dict]:
    """Each goal's measured value: the CPU goals from the count where it is worst."""
    rows = [results["single"]] + results["fanout"]
    worst = {who: max(rows, key=lambda r: r[f"{who}_net_cpu_per_engine_cycle_s"])
             for who in ("controller", "agents")}
    measured = {
        "single_rt": (results["single"]["median_rt"], "median of "
                      + plural(results["single"]["cycles"], "cycle")),
        "fanout_slope_rt": (results["fit"]["slope_rt"], "fit over "
                            + ",".join(map(str, results["fit"]["counts"])))
        if results["fit"] else (None, "needs two counts"),
        "controller_cpu_ms": (worst["controller"]["controller_net_cpu_per_engine_cycle_s"]
                              * 1e3, f"worst: {engines(worst['controller'])}"),
        "agent_cpu_ms": (worst["agents"]["agents_net_cpu_per_engine_cycle_s"] * 1e3,
                         f"worst: {engines(worst['agents'])}")}
    memory = results.get("single_memory")
    if memory is not None:  # beside the goal: the same, less what the disk's fsyncs cost
        measured["single_memory_rt"] = (memory["median_rt"], "the same, journal in "
                                        f"{MEMORY_DIR} (no disk fsync)")
    out = []
    for key, what, limit, unit in GOALS + ([MEMORY_ROW] if memory is not None else []):
        value, where = measured[key]
        out.append({"goal": key, "what": what, "value": value, "limit": limit, "unit": unit,
                    "where": where, "met": None if value is None else value <= limit})
    return out


def fanout_cycles(n: int, args) -> int:
    """Cycles of ``n`` engines: ``--fanout-repeat``, and at least as many engine-cycles as the
    single run's ``--repeat`` (3 cycles of one engine are a few milliseconds of CPU, where
    one heartbeat more or less moved the agents' figure by a quarter; with 30, two runs of
    the same count in one run still differed by 0.39 against 0.55 ms)."""
    return max(args.fanout_repeat, -(-args.repeat // n))


def measure(args) -> dict:
    counts = [int(c) for c in args.counts.split(",")]
    results: dict = {"single": None, "fanout": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        d = Path(tmp)
        echo = EchoHost(f"ipc://{d}/echo.sock", d / "echo.log")
        try:
            before = echo.round_trips(args.round_trips // 2)
            results["single"] = run_count(d / "single", 1, args, args.repeat)
            if args.state_dir is None and MEMORY_DIR.is_dir():
                with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=MEMORY_DIR) as mem:
                    results["single_memory"] = run_count(d / "single-memory", 1, args,
                                                         args.repeat, Path(mem))
            results["floor"] = {"disk": floor(d, echo, args.state_dir or d, args.floor_cycles)}
            if args.state_dir is None and MEMORY_DIR.is_dir():
                with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=MEMORY_DIR) as mem:
                    results["floor"]["memory"] = floor(d, echo, Path(mem), args.floor_cycles)
            for n in counts:
                results["fanout"].append(run_count(d / f"fanout-{n}", n, args,
                                                   fanout_cycles(n, args)))
            after = echo.round_trips(args.round_trips - args.round_trips // 2)
        finally:
            echo.close()
    results["round_trip"] = round_trip(before, after)
    in_rt(results)
    results["fit"] = fit(results)
    results["goals"] = goals(results)
    return results


def print_tables(results: dict) -> None:
    rt = results["round_trip"]
    table(f"bare round trip: pyzmq DEALER to a ROUTER echo in another process, ipc "
          f"({rt['round_trips']} round trips, half before the cycles, half after)",
          ["median us", "p90 us", "median before us", "median after us"],
          [[rt["median_s"] * 1e6, rt["p90_s"] * 1e6, rt["median_before_s"] * 1e6,
            rt["median_after_s"] * 1e6]])
    s = results["single"]
    phases = [("whole cycle, median", "median"), ("whole cycle, p90", "p90")] + [
        (f"of which the {k} phase, median", k)
        for k in (OperationKind.PREPARE, OperationKind.CAPTURE, OperationKind.RESTORE)]
    rows = []
    for what, k in phases:
        sec = s[f"{k}_s"] if k in ("median", "p90") else s["phase_median_s"].get(k, 0.0)
        rows.append([what, sec * 1e3, sec / rt["median_s"]])
    memory = results.get("single_memory")
    if memory is not None:
        rows.append([f"whole cycle, journal in {MEMORY_DIR}, median", memory["median_s"] * 1e3,
                     memory["median_rt"]])
    table("one cycle of one engine, nothing to drain, release or hook "
          f"({s['cycles']} cycles)", ["", "ms", "bare RT"], rows)
    fan = results["fanout"]
    one = next((r for r in fan if r["engines"] == 1), fan[0])
    table("one cycle over N engines at once (median)",
          ["engines", "cycle ms", "cycle RT", "vs 1 engine", "ms per engine",
           "RT per engine"],
          [[r["engines"], r["median_s"] * 1e3, r["median_rt"], r["median_s"] / one["median_s"],
            r["median_s"] * 1e3 / r["engines"], r["median_rt"] / r["engines"]] for r in fan])
    if results["fit"]:
        f = results["fit"]
        table(f"least-squares line of the cycle time against engines ({len(f['counts'])} "
              "counts)", ["ms per engine", "RT per engine", "intercept ms", "intercept RT"],
              [[f["slope_s"] * 1e3, f["slope_rt"], f["intercept_s"] * 1e3,
                f["intercept_rt"]]])
    cpu_rows = [s] + fan + ([memory] if memory is not None else [])
    table("CPU per engine per cycle (ms; net: less the idle rate over an equally long "
          "interval; 'mem': the journal in memory, no disk fsync)",
          ["engines", "cycles", "controller", "net", "net RT", "idle ms/s",
           "agents", "net", "net RT", "idle ms/s"],
          [[f"{r['engines']} mem" if r is memory else r["engines"], r["cycles"]] + [
              x for who in ("controller", "agents") for x in (
                  r[f"{who}_cpu_per_engine_cycle_s"] * 1e3,
                  r[f"{who}_net_cpu_per_engine_cycle_s"] * 1e3,
                  r[f"{who}_net_cpu_per_engine_cycle_rt"],
                  r[f"{who}_idle_cpu_s"] / r["idle_s"] * 1e3)]
           for r in cpu_rows])
    floors = results.get("floor", {})
    ours = {"disk": s, "memory": memory}
    rows = []
    for where, f in floors.items():
        o = ours[where]
        if o is None:
            continue
        cpu = (o["controller_net_cpu_per_engine_cycle_s"], o["agents_net_cpu_per_engine_cycle_s"])
        rows.append([f"journal {'in ' + str(MEMORY_DIR) if where == 'memory' else 'on disk'}",
                     f["median_rt"], o["median_rt"] / f["median_rt"],
                     f["controller_cpu_per_cycle_s"] * 1e3,
                     cpu[0] / f["controller_cpu_per_cycle_s"],
                     f["agent_cpu_per_cycle_s"] * 1e3, cpu[1] / f["agent_cpu_per_cycle_s"]])
    if rows:
        table("floor: one engine's cycle as bare I/O, none of this project's code (two fsynced "
              f"commits, two agent round trips, the answer; {next(iter(floors.values()))['cycles']} "
              "cycles), and this project's one-engine cycle over it",
              ["journal", "floor RT", "ours / floor", "floor controller CPU ms",
               "ours / floor", "floor agent CPU ms", "ours / floor"], rows)
    table("goals (issue 15), each measured in this run",
          ["goal", "measured", "limit", "unit", "met", "from"],
          [[g["what"], "-" if g["value"] is None else g["value"], g["limit"], g["unit"],
            {True: "yes", False: "NO", None: "-"}[g["met"]], g["where"]]
           for g in results["goals"]])


def main() -> int:
    p = parser("control", __doc__)
    p.add_argument("--counts", default="1,10,100,1000", help="engine counts for the fan-out")
    p.add_argument("--per-process", type=int, default=50, help="agents per host process")
    p.add_argument("--repeat", type=int, default=100, help="single-engine cycles")
    p.add_argument("--fanout-repeat", type=int, default=3,
                   help="cycles per fan-out count (at least --repeat engine-cycles)")
    p.add_argument("--round-trips", type=int, default=4000,
                   help="bare round trips, half before the cycles and half after")
    p.add_argument("--floor-cycles", type=int, default=300,
                   help="cycles of the floor (bare I/O), each journal")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the journal's directory (default: a temp dir on disk; /dev/shm "
                        "takes the disk's fsync out)")
    args = p.parse_args()
    if args.round_trips < 2:
        p.error("--round-trips must be at least 2")
    if args.floor_cycles < 1:
        p.error("--floor-cycles must be at least 1")
    results = measure(args)
    print_tables(results)
    write(args.out, "control", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
