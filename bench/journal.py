"""The journal's write path: records per second and fsyncs per record, for writers on many
threads at once, and operations (``begin``, the records of a cycle, ``finish``) the same way.

A real ``Journal`` in a fresh SQLite file (default: a temp dir on disk; ``--dir /dev/shm/x``
takes the disk's fsync out). For each thread count T:

- records: T threads share RECORDS records, each calling ``record()`` as fast as it can; the
  clock stops once all of them are durable (``sync()``). Given: records per second, what one
  ``record()`` call costs its caller (median), the process's CPU per record (the writer's
  included), and fsyncs per record.
- operations: T threads share OPS operations, each ``begin``, OP_RECORDS records (a cycle of
  one engine journals about 14) and ``finish``. Given: operations per second, the median time
  from ``begin`` to ``finish`` returned, CPU per operation, fsyncs per operation.

Fsyncs are the journal's own count of commits made with ``synchronous=FULL`` (``stats()``);
SQLite's checkpoints add two about every thousand pages, not counted. A journal without
``stats()`` (one that commits each write on its own, with an fsync) counts one per write.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from _common import median, parser, table, write

#: a transition record as the controller journals it (about this size and shape)
DATA = {"from": "RUNNING", "to": "PREPARING", "trigger": "prepare", "agent_monotonic": 1234.5,
        "agent_wall": 1764612345.25}


def _syncs(journal, writes: int) -> int:
    stats = getattr(journal, "stats", None)
    return stats()["syncs"] if stats else writes


def _run_threads(n: int, target) -> float:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _share(total: int, n: int, i: int) -> int:
    return total // n + (1 if i < total % n else 0)


def records(journal_cls, d: Path, threads: int, total: int) -> dict:
    j = journal_cls(d / f"records-{threads}.sqlite3")
    calls: list[list[float]] = [[] for _ in range(threads)]
    try:
        def writer(i: int) -> None:
            for k in range(_share(total, threads, i)):
                t0 = time.perf_counter()
                j.record("transition", DATA, engine=f"e{i}", op_id=f"op{i}")
                calls[i].append(time.perf_counter() - t0)

        cpu0, syncs0 = time.process_time(), _syncs(j, 0)
        t0 = time.perf_counter()
        _run_threads(threads, writer)
        if hasattr(j, "sync"):
            j.sync()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        fsyncs = _syncs(j, total) - syncs0
        assert len(j.records(limit=total + 1)) == total, "records went missing"
    finally:
        j.close()
    per_call = [c for cs in calls for c in cs]
    return {"threads": threads, "records": total, "wall_s": wall, "per_s": total / wall,
            "call_median_us": median(per_call) * 1e6, "cpu_us_per_record": cpu / total * 1e6,
            "fsyncs": fsyncs, "fsyncs_per_record": fsyncs / total}


def operations(journal_cls, d: Path, threads: int, total: int, per_op: int) -> dict:
    from ckpt_controller.protocol import OperationResult

    j = journal_cls(d / f"ops-{threads}.sqlite3")
    spans: list[float] = []
    lock = threading.Lock()
    try:
        def worker(i: int) -> None:
            for k in range(_share(total, threads, i)):
                op = f"op-{i}-{k}"
                t0 = time.perf_counter()
                j.begin(op, "cycle", [f"e{i}"], {})
                for _ in range(per_op):
                    j.record("transition", DATA, engine=f"e{i}", op_id=op)
                j.finish(OperationResult(op_id=op, kind="cycle", status="succeeded",
                                         engines=[], wall=0.0, duration_s=0.0))
                with lock:
                    spans.append(time.perf_counter() - t0)

        cpu0, syncs0 = time.process_time(), _syncs(j, 0)
        wall = _run_threads(threads, worker)
        cpu = time.process_time() - cpu0
        fsyncs = _syncs(j, total * (per_op + 2)) - syncs0
        assert len(j.operations(limit=total + 1)) == total, "operations went missing"
        assert j.check() == []
    finally:
        j.close()
    return {"threads": threads, "operations": total, "records_per_op": per_op, "wall_s": wall,
            "per_s": total / wall, "span_median_ms": median(spans) * 1e3,
            "cpu_ms_per_op": cpu / total * 1e3, "fsyncs": fsyncs, "fsyncs_per_op": fsyncs / total}


def best(rows: list[dict], key: str) -> dict:
    """Of repeated runs, the one with the median ``key``."""
    ordered = sorted(rows, key=lambda r: r[key])
    return ordered[len(ordered) // 2]


def main() -> int:
    p = parser("journal", __doc__)
    p.add_argument("--threads", default="1,8,64", help="writer thread counts")
    p.add_argument("--records", type=int, default=5000, help="records per thread count")
    p.add_argument("--ops", type=int, default=300, help="operations per thread count")
    p.add_argument("--op-records", type=int, default=14, help="records per operation")
    p.add_argument("--repeat", type=int, default=3, help="runs per row (the median is shown)")
    p.add_argument("--dir", type=Path, default=None, help="where the journals go")
    args = p.parse_args()
    from ckpt_controller.controller.journal import Journal

    counts = [int(c) for c in args.threads.split(",")]
    results: dict = {"module": Journal.__module__, "records": [], "operations": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-journal-", dir=args.dir) as tmp:
        for run in range(args.repeat):
            for n in counts:
                d = Path(tmp) / f"run{run}"
                d.mkdir(exist_ok=True)
                results["records"].append(records(Journal, d, n, args.records))
                results["operations"].append(operations(Journal, d, n, args.ops,
                                                        args.op_records))
    recs = [best([r for r in results["records"] if r["threads"] == n], "per_s") for n in counts]
    ops = [best([r for r in results["operations"] if r["threads"] == n], "per_s")
           for n in counts]
    results["summary"] = {"records": recs, "operations": ops}
    table(f"records: {args.records} records from T threads, until durable "
          f"(median of {args.repeat})",
          ["threads", "records/s", "record() us", "CPU us/record", "fsyncs/record"],
          [[r["threads"], r["per_s"], r["call_median_us"], r["cpu_us_per_record"],
            r["fsyncs_per_record"]] for r in recs])
    table(f"operations: {args.ops} of begin + {args.op_records} records + finish from T "
          f"threads (median of {args.repeat})",
          ["threads", "ops/s", "begin..finish ms", "CPU ms/op", "fsyncs/op"],
          [[r["threads"], r["per_s"], r["span_median_ms"], r["cpu_ms_per_op"],
            r["fsyncs_per_op"]] for r in ops])
    write(args.out, "journal", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
