"""The agent's own cost of a no-op cycle: CPU and wall time per prepare+restore pair.

One real ``Agent`` with nothing registered (no engine hooks, no memory: ``NoMemory``) runs in
a child process on an ipc socket, as in ``control.py``; an ``AgentClient`` in this process
asks it for PAIRS prepare (drain abort) + restore pairs, one after the other, at each release
level given. The child's CPU time (user + system, all its threads, from ``/proc`` through
psutil) is read before and after; what it spends idle (heartbeats, its poll loop) over an
interval as long as the run is measured just after and subtracted. The agent logs at INFO
as ``ckpt-controller engine serve`` sets it up (to /dev/null; ``--log none`` for none), and the
client subscribes to its events as a controller's session does. Wall time is the
client's, per pair (two round trips and the agent's work). ``--compare DIR`` measures an
agent from another source tree beside this checkout's, round by round in turn (the order
alternating from round to round), so a before and an after see the same machine load; their
difference is also given round by round, with its median (issue 27's goal for the lifecycle
on ``transitions``: under 0.1 ms a pair).

The lifecycle alone (``--micro CYCLES``, 0 for none): a fresh child process per tree and
round fires ``prepare, seal, restore, resume`` on a ``Lifecycle`` CYCLES times (the four
moves of a pair, no sockets, no listener) and reports its CPU per trigger and per pair, the
trees in turn as above.

The goal (issue 15): at most 0.5 ms of agent CPU per no-op pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _common import ROOT, median, parser, table, write

HOST = r"""
import sys, json, os, logging
if sys.argv[3]:  # --compare: that tree's ckpt_controller, not this checkout's
    sys.path.insert(0, sys.argv[3])
if sys.argv[2] == "info":  # as ``ckpt-controller engine serve`` configures it
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
from ckpt_controller.agent import Agent
agent = Agent("bench", control=sys.argv[1], heartbeat_interval_s=1.0).start()
import ckpt_controller
print(json.dumps({"event": "ready", "pid": os.getpid(), "src": ckpt_controller.__file__}),
      flush=True)
sys.stdin.read()   # until the benchmark closes our stdin
agent.close()
"""


MICRO = r"""
import sys, json, time
sys.path.insert(0, sys.argv[1])
from ckpt_controller.lifecycle import Lifecycle
from ckpt_controller.vocab import Trigger
import ckpt_controller
cycle = (Trigger.PREPARE, Trigger.SEAL, Trigger.RESTORE, Trigger.RESUME)
n = int(sys.argv[2])
lc = Lifecycle()
for _ in range(max(10, n // 10)):  # warm
    for t in cycle:
        lc.fire(t)
c0 = time.process_time()
for _ in range(n):
    for t in cycle:
        lc.fire(t)
cpu = time.process_time() - c0
assert lc.state == "running" and lc.generation > n, (lc.state, lc.generation)
print(json.dumps({"src": ckpt_controller.__file__, "cpu_per_trigger_s": cpu / (4 * n)}))
"""


def micro(trees: list[tuple[str, Path]], cycles: int, rounds: int) -> list[dict]:
    """The lifecycle alone: ``rounds`` fresh processes per tree, in turn, each firing the four
    moves of a pair ``cycles`` times; CPU per trigger and per pair, median over the rounds."""
    runs: list[list[float]] = [[] for _ in trees]
    for _ in range(rounds):
        for (tree, src), out in zip(trees, runs):
            line = subprocess.run([sys.executable, "-c", MICRO, str(src), str(cycles)],
                                  capture_output=True, text=True, check=True).stdout
            row = json.loads(line.splitlines()[-1])
            if not out:
                print(f"lifecycle ({tree}) from {row['src']}", flush=True)
            out.append(row["cpu_per_trigger_s"])
    return [{"tree": tree, "cycles": cycles, "rounds": rounds, "cpu_per_trigger_s": median(out),
             "cpu_per_pair_s": 4 * median(out), "runs": out}
            for (tree, _), out in zip(trees, runs)]


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def pairs(client, level: int, n: int) -> list[float]:
    """``n`` prepare+restore pairs; the wall time of each."""
    from ckpt_controller.vocab import DrainMode

    walls = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.prepare(level=level, drain=DrainMode.ABORT)
        client.restore()
        walls.append(time.perf_counter() - t0)
    return walls


class Host:
    """One agent in a child process (from this checkout, or from ``src``), and a client of
    it subscribed to its events as a controller's session is."""

    def __init__(self, endpoint: str, log: str, src: Path | None) -> None:
        from ckpt_controller.agent import AgentClient

        self.tree = "this checkout" if src is None else f"--compare {src.name}"
        self.host = subprocess.Popen(
            [sys.executable, "-c", HOST, endpoint, log, str(src.resolve()) if src else ""],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.host.stdout.readline()
        if "ready" not in line:
            self.close()
            raise RuntimeError(f"the agent host did not start: {line!r}")
        ready = json.loads(line)
        self.proc = psutil.Process(ready["pid"])
        print(f"agent {ready['pid']} ({self.tree}) from {ready['src']}", flush=True)
        self.client = AgentClient(endpoint, timeout_s=30)
        self.client.subscribe()

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        self.host.stdin.close()
        try:
            self.host.wait(30)
        except subprocess.TimeoutExpired:
            self.host.kill()


def measure(hosts: list[Host], level: int, n: int, rounds: int) -> list[dict]:
    """``rounds`` runs of ``n`` pairs on each host in turn (so a compared tree sees the same
    machine load; the order alternates from round to round, so neither is always first),
    each run followed by an idle interval as long as itself."""
    for h in hosts:
        pairs(h.client, level, max(10, n // 10))  # warm: imports, first allocations
    rows: list[list[dict]] = [[] for _ in hosts]
    for r in range(rounds):
        turn = list(zip(hosts, rows))
        for h, out in (turn if r % 2 == 0 else turn[::-1]):
            c0 = cpu_s(h.proc)
            t0 = time.perf_counter()
            walls = pairs(h.client, level, n)
            busy_s = time.perf_counter() - t0
            busy_cpu = cpu_s(h.proc) - c0
            c1, t1 = cpu_s(h.proc), time.perf_counter()
            time.sleep(busy_s)
            idle_rate = (cpu_s(h.proc) - c1) / (time.perf_counter() - t1)
            out.append({"cpu_per_pair_s": max(0.0, busy_cpu - idle_rate * busy_s) / n,
                        "raw_cpu_per_pair_s": busy_cpu / n, "idle_cpu_rate": idle_rate,
                        "wall_per_pair_s": median(walls)})
    return [{"tree": h.tree, "level": level, "pairs": n, "rounds": rounds, "runs": out,
             "cpu_per_pair_s": median([r["cpu_per_pair_s"] for r in out]),
             "wall_per_pair_s": median([r["wall_per_pair_s"] for r in out]),
             "idle_cpu_rate": median([r["idle_cpu_rate"] for r in out])}
            for h, out in zip(hosts, rows)]


def main() -> int:
    p = parser("agent_ops", __doc__)
    p.add_argument("--pairs", type=int, default=2000, help="prepare+restore pairs per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per level (median reported)")
    p.add_argument("--levels", default="0,2", help="release levels to ask for")
    p.add_argument("--log", choices=["info", "none"], default="info",
                   help="the agent's logging: INFO as the engine CLI sets it, or none")
    p.add_argument("--compare", type=Path, default=None, metavar="DIR",
                   help="also measure an agent imported from this source tree (e.g. another "
                        "commit: git archive COMMIT ckpt_controller | tar -x -C DIR), round "
                        "by round in turn with this checkout's")
    p.add_argument("--micro", type=int, default=20000, metavar="CYCLES",
                   help="also time the lifecycle alone: CYCLES prepare+restore cycles of "
                        "Lifecycle.fire per round and tree (0: skip)")
    args = p.parse_args()

    levels = [int(x) for x in args.levels.split(",")]
    results: dict = {"levels": [], "compare": [], "micro": [], "differences": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        hosts: list[Host] = []
        try:
            hosts.append(Host(f"ipc://{tmp}/agent.ctl", args.log, None))
            if args.compare is not None:
                hosts.append(Host(f"ipc://{tmp}/compare.ctl", args.log, args.compare))
            for level in levels:
                mine, *other = measure(hosts, level, args.pairs, args.rounds)
                results["levels"].append(mine)
                results["compare"] += other
                if other:
                    results["differences"].append(difference(level, mine, other[0]))
        finally:
            for h in hosts:
                h.close()
    if args.micro > 0:
        trees = [("this checkout", ROOT)]
        if args.compare is not None:
            trees.append((f"--compare {args.compare.name}", args.compare.resolve()))
        results["micro"] = micro(trees, args.micro, args.rounds)
        table(f"the lifecycle alone: Lifecycle.fire, CPU ({args.micro} cycles of 4 triggers "
              f"x {args.rounds} rounds, median)",
              ["lifecycle", "CPU us/trigger", "CPU ms/pair"],
              [[r["tree"], r["cpu_per_trigger_s"] * 1e6, r["cpu_per_pair_s"] * 1e3]
               for r in results["micro"]])
    rows = sorted(results["levels"] + results["compare"], key=lambda r: r["level"])
    table(f"agent cost of one no-op prepare (drain abort) + restore pair "
          f"(nothing registered, log {args.log}; {args.pairs} pairs x {args.rounds} rounds, "
          "median)",
          ["level", "agent", "agent CPU ms/pair", "wall ms/pair", "idle CPU %",
           "vs 0.5 ms goal"],
          [[r["level"], r["tree"], r["cpu_per_pair_s"] * 1e3, r["wall_per_pair_s"] * 1e3,
            r["idle_cpu_rate"] * 100, r["cpu_per_pair_s"] / 0.5e-3] for r in rows])
    if results["differences"]:
        table("this checkout's agent less the compared one, CPU per pair, round by round "
              "(both measured in each round)",
              ["level", "median ms/pair", "lowest", "highest", "rounds"],
              [[d["level"], d["median_s"] * 1e3, min(d["rounds_s"]) * 1e3,
                max(d["rounds_s"]) * 1e3, len(d["rounds_s"])] for d in results["differences"]])
    write(args.out, "agent_ops", args, results)
    return 0


def difference(level: int, mine: dict, other: dict) -> dict:
    """This checkout's agent CPU per pair less the compared one's, in each round (measured
    minutes apart at most, under the same load), and their median."""
    rounds = [a["cpu_per_pair_s"] - b["cpu_per_pair_s"]
              for a, b in zip(mine["runs"], other["runs"])]
    return {"level": level, "rounds_s": rounds, "median_s": median(rounds)}


if __name__ == "__main__":
    raise SystemExit(main())
