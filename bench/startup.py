"""Start-up time: how long a fresh process takes to show ``ckptctl --help``, to answer
``ckptctl status`` (of a controller serving one engine, started here: the process's start,
the request and the table) and to import the package and the agent client, against the bare
interpreter.

Every command runs REPEAT times in interleaved rounds (one of each per round), so a burst of
load on a shared machine hits all of them alike; the table gives the median, p90 and minimum
wall time of each, the median less the bare interpreter's, and the median CPU time (user +
system) the process used: start-up is one thread, so on an idle machine the wall time is about
the CPU time, and on a busy one the CPU time is the steadier figure. The goal for ``ckptctl
--help`` and ``ckptctl status`` is at most 0.3 s on the development machine; what each
command may import is pinned by ``tests/shape/test_light_imports.py``, not here.
"""

from __future__ import annotations

import contextlib
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import median, p90, parser, table, write

GOAL_S = 0.3


def commands(endpoint: str) -> dict[str, list[str]]:
    py = sys.executable
    script = Path(py).parent / "ckptctl"  # the console script, as a person runs it
    cli = [str(script)] if script.exists() else [py, "-m", "ckpt_controller"]
    return {
        "python (bare interpreter)": [py, "-c", "pass"],
        "import ckpt_controller": [py, "-c", "import ckpt_controller"],
        "from ckpt_controller.agent import AgentClient":
            [py, "-c", "from ckpt_controller.agent import AgentClient"],
        "ckptctl --help": [*cli, "--help"],
        "ckptctl status": [*cli, "--controller", endpoint, "status"],
    }


@contextlib.contextmanager
def controller():
    """A controller serving one in-process agent's engine (its status answered at once):
    its endpoint, while it runs."""
    from ckpt_controller.agent import Agent
    from ckpt_controller.procutil import ReadyProcess

    with tempfile.TemporaryDirectory(prefix="ckpt-startup-", dir="/tmp") as tmp:
        d = Path(tmp)
        agent = Agent("s1", control=f"ipc://{d}/s1.ctl").start()
        config = d / "c.toml"
        config.write_text(f'[controller]\nendpoint = "ipc://{d}/ctl.sock"\n'
                          f'state_dir = "{d}/state"\n[[engine]]\nname = "s1"\n'
                          f'control = "ipc://{d}/s1.ctl"\n')
        served = ReadyProcess([sys.executable, "-m", "ckpt_controller", "serve", "--config",
                               str(config)], d / "controller.log", "controller")
        try:
            yield f"ipc://{d}/ctl.sock"
        finally:
            served.stop()
            agent.close()


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``cmd``. Waited for by a blocking
    ``wait()``: with a timeout, ``subprocess`` polls at growing intervals of up to 50 ms, and
    every wall time came out on that ladder (0.0315, 0.0635, 0.1135, 0.1635 s...); a timer
    kills a run that hangs instead."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    guard = threading.Timer(60, proc.kill)
    guard.start()
    try:
        code = proc.wait()
    finally:
        guard.cancel()
    wall = time.perf_counter() - start
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = parser("startup", __doc__)
    ap.add_argument("--repeat", type=int, default=30, help="runs of each command (default 30)")
    args = ap.parse_args()
    with controller() as endpoint:
        return measure(args, commands(endpoint))


def measure(args, cmds: dict[str, list[str]]) -> int:
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
    for name, key in (("ckptctl --help", "help_within_goal"),
                      ("ckptctl status", "status_within_goal")):
        took = median(runs[name])
        print(f"{name}: median {took:.3f} s (CPU {median(cpu[name]):.3f} s), goal {GOAL_S} s: "
              f"{'met' if took <= GOAL_S else 'NOT met'}")
        results[key] = took <= GOAL_S
    write(args.out, "startup", args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
