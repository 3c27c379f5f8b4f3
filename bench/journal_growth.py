"""What the controller's reads of its journal cost as the journal grows: they must not.

The journal keeps every operation and record (an engine cycled every hour adds about 8,760
operations and 120,000 records a year). For each ``--ops`` size a journal is written of that
many one-engine cycles spread over ``--engines`` engines, ``--records`` records each (one of
them a capture), straight through SQLite with the schema of the code measured (as its
controller would have left it), and then timed, each ``--repeat`` times (median):

- start-up: a ``Controller`` made on it (its journal opened, the metrics carried over from
  each engine's newest cycle and capture, the unsettled engines read), then closed;
- status: the LAST-OP of every engine and of one that never had an operation (a new one);
- history: one engine's newest 20 operations and their records, as ``ckptctl history`` asks;
- image choice: a restore's choice of one engine's image among its captures (``preflight``);
- id check: a new operation id looked up, as admitting every request does.

The last table gives each read's time in the largest journal over the smallest. ``--code
DIR`` measures the ``ckpt_controller`` in DIR instead of this checkout's (an older tree:
``git archive REV ckpt_controller | tar -x -C DIR``).
Neighbours: ``controller/journal.py`` (the reads), ``journal.py`` (its writes).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from _common import median, parser, table, write

#: the reads measured: (key, what)
READS = [("startup", "start-up (Controller made and closed)"),
         ("status", "status: LAST-OP of every engine and a new one"),
         ("history", "history of one engine (20 operations)"),
         ("captures", "a restore's image choice (one engine)"),
         ("lookup", "id check of a new operation")]
#: operations written per transaction while filling
FILL_BATCH = 5_000


def fill(path: Path, ops: int, engines: int, records: int) -> None:
    """A journal of ``ops`` finished one-engine cycles, engine ``a<i % engines>``, each with
    ``records`` records (the middle one a capture that dumped nothing), a second apart."""
    from ckpt_controller import protocol as p
    from ckpt_controller.controller import journal

    import msgspec

    enc = msgspec.msgpack.Encoder()
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(journal.SCHEMA)
    db.execute(f"PRAGMA user_version = {getattr(journal, 'SCHEMA_VERSION', 0)}")
    start, seq = time.time() - ops, 0
    rows, recs = [], []
    for i in range(ops):
        engine, op, wall = f"a{i % engines}", f"op-{i:09d}", start + i
        result = p.OperationResult(op_id=op, kind="cycle", status="succeeded", wall=wall,
                                   duration_s=0.002, engines=[p.EngineOutcome(
                                       engine=engine, status="succeeded")])
        rows.append((op, "cycle", json.dumps([engine]), "{}", "succeeded", wall, 0.0,
                     wall + 0.002, enc.encode(result)))
        for k in range(records):
            seq += 1
            capture = k == records // 2
            recs.append((seq, op, engine, "capture" if capture else "phase", wall, 0.0,
                         '{"dumped": false, "generation": 0}' if capture else '{"name": "x"}'))
        if len(rows) >= FILL_BATCH or i == ops - 1:
            db.executemany("INSERT INTO operations (op_id, kind, engines, params, status, "
                           "wall, monotonic, ended_wall, result) VALUES (?,?,?,?,?,?,?,?,?)",
                           rows)
            db.executemany(journal.INSERT_RECORD, recs)
            db.commit()
            rows, recs = [], []
    db.close()


def config_text(d: Path, engines: int) -> str:
    return (f'[controller]\nendpoint = "ipc://{d}/controller.sock"\nstate_dir = "{d}/state"\n'
            + "".join(f'[[engine]]\nname = "a{i}"\ncontrol = "ipc://{d}/a{i}.ctl"\n'
                      for i in range(engines)))


def measure(d: Path, ops: int, args) -> dict:
    """Each read's median seconds on a journal of ``ops`` operations."""
    from ckpt_controller import protocol as p
    from ckpt_controller.controller import preflight
    from ckpt_controller.controller.config import parse_config
    from ckpt_controller.controller.metrics import Metrics
    from ckpt_controller.controller.service import Controller

    d.mkdir()
    (d / "state").mkdir(mode=0o700)
    t0 = time.perf_counter()
    fill(d / "state" / "journal.sqlite3", ops, args.engines, args.records)
    filled_s = time.perf_counter() - t0
    print(f"{ops:,} operations: written in {filled_s:.1f} s", file=sys.stderr, flush=True)
    config = parse_config(config_text(d, args.engines))
    names = [f"a{i}" for i in range(args.engines)]
    times: dict[str, list[float]] = {k: [] for k, _ in READS}
    first = time.perf_counter()
    ctl = Controller(config, metrics=Metrics())  # the first open (any one-time work in it)
    first_s = time.perf_counter() - first
    ctl.close()
    for i in range(args.repeat):
        t0 = time.perf_counter()
        ctl = Controller(config, metrics=Metrics())
        ctl.close()
        times["startup"].append(time.perf_counter() - t0)
    ctl = Controller(config, metrics=Metrics())
    try:
        j = ctl.journal
        restore = p.OperationCommand(call_id=0, op_id="op-new", kind="restore", engines=["a1"])
        reads = {"status": lambda: j.last_operations(names + ["new-engine"]),
                 "history": lambda: ctl.history(p.HistoryCommand(call_id=0, engine="a1",
                                                                 limit=20)),
                 "captures": lambda: preflight.choose_images(config, j, restore, {"a1": None}),
                 "lookup": lambda: j.lookup("op-new")}
        for i in range(args.repeat):
            for key, read in reads.items():
                t0 = time.perf_counter()
                read()
                times[key].append(time.perf_counter() - t0)
        last = j.last_operations(names + ["new-engine"])
        assert len(last) == args.engines and "new-engine" not in last, sorted(last)
        assert len(j.captures("a1")) == len(range(1, ops, args.engines))
    finally:
        ctl.close()
    return {"ops": ops, "records": ops * args.records, "filled_s": filled_s,
            "first_start_s": first_s, "median_s": {k: median(v) for k, v in times.items()}}


def main() -> int:
    p = parser("journal_growth", __doc__)
    p.add_argument("--ops", default="1000,100000", help="journal sizes, in operations")
    p.add_argument("--engines", type=int, default=100, help="engines the operations are on")
    p.add_argument("--records", type=int, default=14, help="records per operation")
    p.add_argument("--repeat", type=int, default=20, help="times each read is timed")
    p.add_argument("--code", type=Path, default=None,
                   help="measure the ckpt_controller package in this directory")
    args = p.parse_args()
    sizes = [int(n) for n in args.ops.split(",")]
    if min(sizes) < 1 or args.engines < 2 or args.records < 1 or args.repeat < 1:
        p.error("--ops, --records and --repeat must be at least 1, --engines at least 2")
    if args.code is not None:
        if not (args.code / "ckpt_controller" / "__init__.py").is_file():
            p.error(f"--code {args.code}: no ckpt_controller package there")
        sys.path.insert(0, str(args.code.resolve()))
    import ckpt_controller

    measured = Path(ckpt_controller.__file__).resolve().parent.parent
    if args.code is not None and measured != args.code.resolve():
        p.error(f"--code {args.code}: ckpt_controller was imported from {measured} instead")
    results: dict = {"code": "this checkout" if args.code is None else str(args.code),
                     "sizes": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        for n in sizes:
            results["sizes"].append(measure(Path(tmp) / f"ops-{n}", n, args))
    rows = results["sizes"]
    table(f"journal reads by journal size (median of {args.repeat}; {args.engines} engines, "
          f"{args.records} records per operation)",
          ["read"] + [f"{r['ops']:,} ops ms" for r in rows]
          + [f"{rows[-1]['ops']:,} / {rows[0]['ops']:,}"],
          [[what] + [r["median_s"][key] * 1e3 for r in rows]
           + [rows[-1]["median_s"][key] / rows[0]["median_s"][key]] for key, what in READS]
          + [["first start-up on it (once)"] + [r["first_start_s"] * 1e3 for r in rows]
             + [rows[-1]["first_start_s"] / rows[0]["first_start_s"]]])
    write(args.out, "journal_growth", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
