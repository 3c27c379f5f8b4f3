"""``ckptctl status`` at many engines: the command's whole time, as an operator waits for it,
with this tree's code and, with ``--before COMMIT``, an earlier commit's, on the same agents.

``--engines`` real ``Agent`` objects (``--per-process`` to a host process, each on its own ipc
socket) and, for each code, a controller of that code alone in its process (its own socket and
journal) driving all of them. Each controller's journal is filled the same way first, through
the controller itself: ``--group-ops`` cycles of every engine, each followed by
``--single-ops`` / ``--group-ops`` cycles of one engine (round robin), as a controller that
has run a while holds. Then ``ckptctl status`` runs ``--repeat`` times for each code, the codes
alternating (old, new, old, new...), each a fresh process as a person starts it (``python -m
ckpt_controller --controller ... status``, exit 0 and one row per engine checked); its wall time
is the figure. Also timed, from this process: the status request alone (``ControllerClient
.status``), what the controller spends answering it.

The earlier commit's ``ckpt_controller`` is taken with ``git archive`` into a temporary
directory; both trees are byte-compiled first, so neither pays for compiling. Neighbours:
``_hosts`` (the agents' and controllers' processes), ``_common`` (tables, JSON), ``control``
(the controller config).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, median, parser, table, write
from _hosts import ControllerHost, Fleet
from control import config

from ckpt_controller.vocab import OperationStatus


def checkout(commit: str, into: Path) -> Path:
    """``commit``'s ``ckpt_controller`` package, extracted under ``into``."""
    into.mkdir()
    archive = subprocess.run(["git", "archive", commit, "ckpt_controller"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def compiled(tree: Path) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "ckpt_controller")],
                   check=True, stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def code_of(tree: Path):
    """Child processes started inside import ``ckpt_controller`` from ``tree``."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def fill(endpoint: str, names: list[str], group_ops: int, single_ops: int) -> None:
    """The journal of a controller that has run a while (see the module's docstring)."""
    from ckpt_controller.controller.client import ControllerClient

    per_group = single_ops // max(group_ops, 1)
    k = 0
    with ControllerClient(endpoint, timeout_s=120) as c:
        c.subscribe()
        for _ in range(group_ops):
            r = c.cycle(names, max_unavailable=len(names))
            assert r.status == OperationStatus.SUCCEEDED, r.error
            for _ in range(per_group):
                r = c.cycle(names[k % len(names)])
                assert r.status == OperationStatus.SUCCEEDED, r.error
                k += 1


def status_cli(endpoint: str, tree: Path, n: int, cwd: Path) -> float:
    """One ``ckptctl status`` of ``tree``'s code, timed; exit 0, ``n`` rows and a LAST-OP in
    each checked."""
    start = time.perf_counter()
    with code_of(tree):
        run = subprocess.run([sys.executable, "-m", "ckpt_controller", "--controller",
                              endpoint, "status"], capture_output=True, text=True, cwd=cwd)
    took = time.perf_counter() - start
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [re.split(r"\s{2,}", line) for line in run.stdout.split("\n\n")[0].splitlines()]
    assert len(rows) == n + 1, run.stdout[-2000:]
    assert all(row[6] != "-" for row in rows[1:]), run.stdout[-2000:]  # LAST-OP of each
    return took


def request_s(endpoint: str, repeat: int) -> tuple[float, bool]:
    """The median time of the status request alone, from a client already connected, and
    whether the reply carried each engine's last operation (which code answered)."""
    from ckpt_controller.controller.client import ControllerClient

    with ControllerClient(endpoint, timeout_s=60) as c:
        carried = getattr(c.status(), "last_ops", False)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            c.status()
            times.append(time.perf_counter() - t0)
    return median(times), carried


def measure(args) -> dict:
    n = args.engines
    names = [f"a{i}" for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-status-") as tmp, \
            contextlib.chdir(tmp):  # a child's sys.path starts with its cwd: not this tree
        d = Path(tmp)
        codes = {"this tree": ROOT}
        if args.before:
            codes = {f"before ({args.before})": checkout(args.before, d / "before")} | codes
        for tree in codes.values():
            compiled(tree)
        fleet = Fleet(d, n, args.per_process)
        hosts: dict[str, ControllerHost] = {}
        try:
            for i, (label, tree) in enumerate(codes.items()):
                sub = d / f"c{i}"
                sub.mkdir()
                text = config(d, n, sub / "state").replace(
                    f"ipc://{d}/controller.sock", f"ipc://{sub}/controller.sock")
                (sub / "controller.toml").write_text(text)
                with code_of(tree):
                    hosts[label] = ControllerHost(sub / "controller.toml")
                fill(hosts[label].endpoint, names, args.group_ops, args.single_ops)
                print(f"{label}: controller ready, journal filled", file=sys.stderr, flush=True)
            runs: dict[str, list[float]] = {label: [] for label in codes}
            for _ in range(args.repeat):
                for label, tree in codes.items():
                    runs[label].append(status_cli(hosts[label].endpoint, tree, n, d))
            requests = {label: request_s(hosts[label].endpoint, args.repeat) for label in codes}
        finally:
            ControllerHost.close_all(list(hosts.values()))
            fleet.close()
    return {"engines": n, "operations": args.group_ops + args.single_ops,
            "codes": {label: {"median_s": median(runs[label]), "runs_s": runs[label],
                              "status_request_median_s": requests[label][0],
                              "last_op_in_reply": requests[label][1]}
                      for label in codes}}


def main() -> int:
    ap = parser("status", __doc__)
    ap.add_argument("--engines", type=int, default=200)
    ap.add_argument("--per-process", type=int, default=50, help="agents per host process")
    ap.add_argument("--repeat", type=int, default=5, help="status commands per code")
    ap.add_argument("--group-ops", type=int, default=10,
                    help="cycles of every engine in each journal")
    ap.add_argument("--single-ops", type=int, default=300,
                    help="cycles of one engine in each journal")
    ap.add_argument("--before", metavar="COMMIT",
                    help="also measure this commit's code (the controller and the command)")
    args = ap.parse_args()
    res = measure(args)
    rows = [[label, r["median_s"], " ".join(f"{t:.2f}" for t in r["runs_s"]),
             r["status_request_median_s"], "yes" if r["last_op_in_reply"] else "no"]
            for label, r in res["codes"].items()]
    table(f"ckptctl status, {res['engines']} engines, a journal of {res['operations']} "
          f"operations (seconds; median of {args.repeat}, codes alternating)",
          ["code", "command median", "runs", "status request alone", "LAST-OP in reply"],
          rows)
    write(args.out, "status", args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
