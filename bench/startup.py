"""Start-up time: how long a fresh process takes to show ``ckptctl --help`` and to import the
package and the agent client, against the bare interpreter.

Every command runs REPEAT times in interleaved rounds (one of each per round), so a burst of
load on a shared machine hits all of them alike; the table gives the median, p90 and minimum
wall time of each, the median less the bare interpreter's, and the median CPU time (user +
system) the process used: start-up is one thread, so on an idle machine the wall time is about
the CPU time, and on a busy one the CPU time is the steadier figure. The goal for ``ckptctl
--help`` is at most 0.3 s on the development machine; what each command may import is pinned
by ``tests/shape/test_light_imports.py``, not here.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

from _common import median, p90, parser, table, write

GOAL_S = 0.3


def commands() -> dict[str, list[str]]:
    py = sys.executable
    script = Path(py).parent / "ckptctl"  # the console script, as a person runs it
    helps = [str(script), "--help"] if script.exists() else [py, "-m", "ckpt_controller", "--help"]
    return {
        "python (bare interpreter)": [py, "-c", "pass"],
        "import ckpt_controller": [py, "-c", "import ckpt_controller"],
        "from ckpt_controller.agent import AgentClient":
            [py, "-c", "from ckpt_controller.agent import AgentClient"],
        "ckptctl --help": helps,
    }


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   timeout=60)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = parser("startup", __doc__)
    ap.add_argument("--repeat", type=int, default=30, help="runs of each command (default 30)")
    args = ap.parse_args()
    cmds = commands()
    runs: dict[str, list[float]] = {name: [] for name in cmds}
    cpu: dict[str, list[float]] = {name: [] for name in cmds}
    for name, cmd in cmds.items():  # a first, unmeasured round warms the page cache
        timed(cmd)
    for _ in range(args.repeat):
        for name, cmd in cmds.items():
            wall, used = timed(cmd)
            runs[name].append(wall)
            cpu[name].append(used)
    bare = median(runs["python (bare interpreter)"])
    results = {"goal_help_s": GOAL_S, "commands": []}
    rows = []
    for name, times in runs.items():
        row = {"command": name, "median_s": median(times), "p90_s": p90(times),
               "min_s": min(times), "over_bare_s": median(times) - bare,
               "cpu_median_s": median(cpu[name]), "runs_s": times, "cpu_s": cpu[name]}
        results["commands"].append(row)
        rows.append([name, row["median_s"], row["p90_s"], row["min_s"], row["over_bare_s"],
                     row["cpu_median_s"]])
    table(f"start-up, {args.repeat} interleaved runs each (seconds)",
          ["command", "median", "p90", "min", "median - python", "CPU median"], rows)
    help_s = median(runs["ckptctl --help"])
    print(f"ckptctl --help: median {help_s:.3f} s (CPU {median(cpu['ckptctl --help']):.3f} s), "
          f"goal {GOAL_S} s: {'met' if help_s <= GOAL_S else 'NOT met'}")
    results["help_within_goal"] = help_s <= GOAL_S
    write(args.out, "startup", args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
