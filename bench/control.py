"""Control overhead: what the lifecycle machinery itself costs, with nothing to drain, no
memory and no hooks, and how a cycle's time grows with the number of engines.

Agents are real ``Agent`` objects with nothing registered, hosted in separate processes
(``--per-process`` agents each, so 1,000 agents fit in memory), each on its own ipc socket.
The controller is a real ``ControllerServer`` (SQLite journal, fsync per record) driven by a
``ControllerClient`` over its socket, as the CLI would.

- single: REPEAT cycles of one engine, one after the other (median, p90), and the agent's
  own share (the prepare and restore replies' durations);
- fan-out: one ``cycle`` over N engines at once (max-unavailable N) for each N.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import median, p90, parser, table, write

HOST = r"""
import sys, time, json
from ckpt_controller.agent import Agent
d, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
agents = [Agent(f"a{i}", control=f"ipc://{d}/a{i}.ctl", heartbeat_interval_s=1.0).start()
          for i in range(first, first + count)]
print(json.dumps({"event": "ready", "agents": count}), flush=True)
sys.stdin.read()   # until the benchmark closes our stdin
for a in agents:
    a.close()
"""


class Fleet:
    """``n`` agents in processes of at most ``per`` agents each."""

    def __init__(self, d: Path, n: int, per: int) -> None:
        self.procs = []
        for first in range(0, n, per):
            proc = subprocess.Popen([sys.executable, "-c", HOST, str(d), str(first),
                                     str(min(per, n - first))], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
        for proc in self.procs:
            line = proc.stdout.readline()
            if "ready" not in line:
                raise RuntimeError(f"an agent host did not start: {line!r}")

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def config(d: Path, n: int, state: Path) -> str:
    engines = "".join(f'[[engine]]\nname = "a{i}"\ncontrol = "ipc://{d}/a{i}.ctl"\n'
                      for i in range(n))
    return (f'[controller]\nendpoint = "ipc://{d}/ctl.sock"\nstate_dir = "{state}"\n'
            f'heartbeat_interval_s = 1.0\n[defaults]\nlevel = 0\ndrain = "abort"\n' + engines)


def main() -> int:
    p = parser("control", __doc__)
    p.add_argument("--counts", default="1,10,100,1000", help="engine counts for the fan-out")
    p.add_argument("--per-process", type=int, default=50, help="agents per host process")
    p.add_argument("--repeat", type=int, default=30, help="single-engine cycles")
    p.add_argument("--fanout-repeat", type=int, default=3, help="cycles per fan-out count")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the journal's directory (default: a temp dir on disk; /dev/shm "
                        "takes the disk's fsync out)")
    args = p.parse_args()
    from ckpt_controller.controller.client import ControllerClient
    from ckpt_controller.controller.config import parse_config
    from ckpt_controller.controller.server import ControllerServer

    counts = [int(c) for c in args.counts.split(",")]
    results: dict = {"single": None, "fanout": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        d = Path(tmp)
        fleet = Fleet(d, max(counts), args.per_process)
        try:
            for n in [1] + counts:
                state = (args.state_dir or d) / f"state-{n}"
                server = ControllerServer(parse_config(config(d, n, state))).start()
                try:
                    with ControllerClient(server.endpoint, timeout_s=120) as c:
                        c.subscribe()
                        names = [f"a{i}" for i in range(n)]
                        c.cycle(names, max_unavailable=n)  # warm: connections, imports
                        times, results_ = [], []
                        reps = args.repeat if n == 1 and results["single"] is None \
                            else args.fanout_repeat
                        for _ in range(reps):
                            t0 = time.perf_counter()
                            r = c.cycle(names, max_unavailable=n)
                            times.append(time.perf_counter() - t0)
                            assert r.status == "succeeded", r.error
                            results_.append(r)
                finally:
                    server.close()
                phases: dict[str, list[float]] = {}
                for r in results_:
                    for o in r.engines:
                        for ph in o.phases:
                            phases.setdefault(ph.name, []).append(ph.duration_s)
                row = {"engines": n, "cycles": len(times), "median_s": median(times),
                       "p90_s": p90(times), "runs_s": times,
                       "phase_median_s": {k: median(v) for k, v in phases.items()}}
                if n == 1 and results["single"] is None:
                    results["single"] = row
                else:
                    results["fanout"].append(row)
        finally:
            fleet.close()
    s = results["single"]
    table("one cycle of one engine, nothing to drain, release or hook "
          f"({s['cycles']} cycles)",
          ["median ms", "p90 ms", "prepare ms", "capture ms", "restore ms"],
          [[s["median_s"] * 1e3, s["p90_s"] * 1e3,
            s["phase_median_s"].get("prepare", 0) * 1e3,
            s["phase_median_s"].get("capture", 0) * 1e3,
            s["phase_median_s"].get("restore", 0) * 1e3]])
    one = next((r for r in results["fanout"] if r["engines"] == 1), results["fanout"][0])
    table("one cycle over N engines at once (median)",
          ["engines", "cycle ms", "vs 1 engine", "ms per engine"],
          [[r["engines"], r["median_s"] * 1e3, r["median_s"] / one["median_s"],
            r["median_s"] * 1e3 / r["engines"]] for r in results["fanout"]])
    write(args.out, "control", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
