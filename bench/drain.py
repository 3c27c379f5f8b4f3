"""Drain: how long ``prepare`` takes to drain a reference engine, against what it waits for.

- wait: K requests of different lengths decoding; ``prepare --drain wait``. The floor is the
  longest remaining request: from the prepare to the end of the last request, as its client
  saw it. Reported: the agent's drain time, that floor, and their difference (the overhead).
  A run whose prepare found fewer than K requests in flight (one ended first) is run again.
- abort: N requests in flight (``--max-batch`` decoding, the rest queued); ``prepare --drain
  abort``. Reported: the agent's drain time (every request ended with finish reason ABORT and
  its partial output) and when the client had seen the last of those ends. A run in which a
  request ended before all N were in flight is run again, as a wait case is.

The engine is a real ``ckptctl engine serve`` process; the agent is driven directly over its
control socket, so no controller or hook time is included.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, median, parser, table, write


def start(tmp: Path, max_batch: int):
    from ckpt_controller.procutil import ReadyProcess

    return ReadyProcess([sys.executable, "-m", "ckpt_controller", "engine", "serve", "--name",
                         "drain", "--api", f"ipc://{tmp}/api", "--control", f"ipc://{tmp}/ctl",
                         "--model", "tiny", "--model-dir", str(tmp / "models"),
                         "--max-batch", str(max_batch), "--kv-blocks", "4096"],
                        tmp / "engine.log", "engine", cwd=ROOT)


def _until(c, done, what: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > end:
            states = {(x.finish_reason, x.rejected is not None, x.first_token_at is not None)
                      for x in c.requests.values()}
            raise TimeoutError(f"no {what} in {timeout_s:.0f} s; requests: {states}")
        c.poll(0.01)


#: runs of a wait case at most, until its prepare finds all its requests in flight: on a busy
#: machine a request may end before the prepare arrives, and that run drained fewer requests
#: than its row says (each run's ``tries`` tells how many it took)
WAIT_TRIES = 10


def wait_case(tmp: Path, k: int) -> dict:
    for tries in range(1, WAIT_TRIES + 1):
        run = _wait_once(tmp, k)
        if run["in_flight_at_start"] == k:
            break
    return {**run, "tries": tries}


def _wait_once(tmp: Path, k: int) -> dict:
    from ckpt_controller.agent import AgentClient
    from ckpt_controller.engine.client import EngineClient

    with EngineClient(f"ipc://{tmp}/api") as c, AgentClient(f"ipc://{tmp}/ctl",
                                                            timeout_s=120) as agent:
        agent.status()  # connected before the requests start: the prepare goes out at once
        ids = [c.submit([7, i], 40 + 60 * i) for i in range(k)]
        _until(c, lambda: all(c.requests[r].first_token_at is not None for r in ids),
               "every request decoding")
        t0 = time.monotonic()
        reply = agent.prepare(level=0, drain="wait", drain_timeout_s=300)
        drained = time.monotonic() - t0
        _until(c, lambda: all(c.requests[r].ended for r in ids), "every request ended")
        last_end = max(c.requests[r].ended_at for r in ids) - t0
        agent.restore()
    return {"requests": k, "drain_s": reply.drain.drain_s, "prepare_reply_s": drained,
            "longest_remaining_s": last_end, "completed": reply.drain.completed,
            "in_flight_at_start": reply.drain.in_flight_at_start,
            "overhead_s": reply.drain.drain_s - last_end}


def abort_case(tmp: Path, n: int) -> dict:
    for tries in range(1, WAIT_TRIES + 1):
        run = _abort_once(tmp, n)
        if run is not None:
            return {**run, "tries": tries}
    raise TimeoutError(f"{WAIT_TRIES} runs in a row: a request ended before {n} were in flight")


def _abort_once(tmp: Path, n: int) -> dict | None:
    """One abort run, or None when a request ended before all ``n`` were in flight (a busy
    machine decoded it to its end before the last was queued): that run drained fewer than its
    row says, and is run again."""
    from ckpt_controller.agent import AgentClient
    from ckpt_controller.engine.client import EngineClient

    with EngineClient(f"ipc://{tmp}/api") as c, AgentClient(f"ipc://{tmp}/ctl",
                                                            timeout_s=120) as agent:
        agent.status()  # connected before the requests start: the prepare goes out at once
        ids = [c.submit([3, i % 50], 200) for i in range(n)]
        _until(c, lambda: any(c.requests[r].ended for r in ids)
               or agent.status().in_flight >= n, f"{n} requests in flight")
        if any(c.requests[r].ended for r in ids):
            _until(c, lambda: all(c.requests[r].ended for r in ids), "every request ended")
            return None
        t0 = time.monotonic()
        reply = agent.prepare(level=0, drain="abort")
        _until(c, lambda: all(c.requests[r].ended for r in ids), "every request ended")
        seen = max(c.requests[r].ended_at for r in ids) - t0
        reasons = {c.requests[r].finish_reason for r in ids}
        agent.restore()
    return {"requests": n, "drain_s": reply.drain.drain_s, "aborted": reply.drain.aborted,
            "completed_meanwhile": reply.drain.completed, "client_saw_all_ends_s": seen,
            "finish_reasons": sorted(r or "none" for r in reasons)}


def main() -> int:
    p = parser("drain", __doc__)
    p.add_argument("--waits", default="1,4,16", help="requests in flight for the wait cases")
    p.add_argument("--aborts", default="100,1000", help="requests in flight for the abort cases")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    results: dict = {"wait": [], "abort": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        tmp = Path(tmp)
        eng = start(tmp, max_batch=16)
        try:
            for k in (int(x) for x in args.waits.split(",")):
                runs = [wait_case(tmp, k) for _ in range(args.repeat)]
                results["wait"].append({**runs[len(runs) // 2], "runs": runs,
                                        "drain_s": median([r["drain_s"] for r in runs]),
                                        "longest_remaining_s":
                                            median([r["longest_remaining_s"] for r in runs]),
                                        "overhead_s": median([r["overhead_s"] for r in runs])})
            for n in (int(x) for x in args.aborts.split(",")):
                runs = [abort_case(tmp, n) for _ in range(args.repeat)]
                results["abort"].append({**runs[len(runs) // 2], "runs": runs,
                                         "drain_s": median([r["drain_s"] for r in runs]),
                                         "client_saw_all_ends_s":
                                             median([r["client_saw_all_ends_s"] for r in runs])})
        finally:
            eng.stop()
    table(f"drain wait: prepare -> drained vs the longest remaining request (median of "
          f"{args.repeat})", ["in flight", "drain ms", "longest remaining ms", "drain - longest ms",
                              "drain / longest"],
          [[w["requests"], w["drain_s"] * 1e3, w["longest_remaining_s"] * 1e3,
            w["overhead_s"] * 1e3, w["drain_s"] / w["longest_remaining_s"]]
           for w in results["wait"]])
    table(f"drain abort: prepare -> every request ended ABORT (median of {args.repeat})",
          ["in flight", "agent drain ms", "client saw all ends ms", "ms per request"],
          [[a["requests"], a["drain_s"] * 1e3, a["client_saw_all_ends_s"] * 1e3,
            a["drain_s"] * 1e3 / a["requests"]] for a in results["abort"]])
    write(args.out, "drain", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
