"""A real vLLM moved between two nodes (issue 29): what its clients wait, against a vLLM cold
start on the target, and whether any request is lost.

Two nodes as in ``tests/fleet/test_vllm_migrate.py`` (``VllmPair``: network namespaces of one
host, etcd in the root namespace, the criu hooks, the shared image folder; vLLM and its
sidecar under ``ckptctl agent vllm-launch`` in a PID namespace of their own; a tiny random
Llama, ``--enforce-eager``, float32, on the CPU). In each repeat:

- cold start: the same launcher command started in n2's namespace (other ports); from its
  start to the answer of one completion sent when it says it is ready. Then it is killed.
- migration: vLLM on n1; ``--clients`` clients (``FollowingVllm``, each following the engine
  through the registry, with its watch) send short greedy completions (``--tokens`` each)
  one after another; ``ckptctl fleet migrate v0 --to n2 --drain DRAIN --json`` runs while
  they do. Downtime: from the last answer a client got from n1 to the first any got from n2
  (every answer's time and URL recorded). Lost: completions that ended with an error (each
  is sent again while the engine moves, for up to four minutes). Every answer is compared
  with what the engine answered that prompt before the move.

vLLM's own cold start on this machine is tens of seconds (its imports, the model, the CPU
backend's set-up); the move keeps the process, so the client waits for the dump, the restore
and the re-wake instead. Needs what the vLLM migration tests need (root, ``make criu etcd
vllm``, a writable ``kernel.io_uring_disabled``); says why and exits 2 without it.
Neighbours: ``tests/fleet/test_vllm_migrate.py`` (``VllmPair``), ``_common``.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import ROOT, median, parser, table, write

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "fleet")]
import test_vllm_migrate as tv  # noqa: E402  (the two nodes the vLLM migration test uses)
from migrate import criu_log_s, phases  # noqa: E402  (phases, hook runs; CRIU's log)
from support.processes import kill_naming  # noqa: E402
from support.timing import wait_until  # noqa: E402
from support.vllm import make_tiny_llama  # noqa: E402

from ckpt_controller.criu_images import read_stats  # noqa: E402

PROMPTS = ["the engine moved to", "a second node answers", "checkpoints carry", "four"]
COLD_HTTP, COLD_CONTROL = tv.HTTP_PORT + 20, tv.CONTROL_PORT + 20
MOVE_TIMEOUT_S = 600.0


def cold_start(pair: tv.VllmPair, tokens: int) -> dict:
    from ckpt_controller.adapters.vllm import VllmHttp

    t0 = time.monotonic()
    eng = pair.start_vllm("n2", COLD_HTTP, COLD_CONTROL)
    ready = time.monotonic()
    try:
        VllmHttp(f"http://{pair.addr['n2']}:{COLD_HTTP}", timeout_s=120).complete(
            PROMPTS[0], tokens, retry_for_s=60)
        first = time.monotonic()
    finally:
        kill_naming(f"--port {COLD_HTTP}")
        eng.stop()
        pair.started.remove(eng)
    return {"ready_s": ready - t0, "first_answer_s": first - t0}


class Client(threading.Thread):
    """Completions one after another until ``stop``; each answer's time, URL and text."""

    def __init__(self, url: str, prompt: str, tokens: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        from ckpt_controller.adapters.vllm.follow import FollowingVllm
        from ckpt_controller.fleet.registry import Resolver

        self.client = FollowingVllm("v0", Resolver(url), follow_for_s=240)
        self.prompt, self.tokens, self.stop = prompt, tokens, stop
        self.answers: list[tuple[float, str, str]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    text = self.client.complete(self.prompt, self.tokens).text
                except Exception as err:  # policy: counted as lost, and sent again
                    self.errors.append(repr(err))
                    continue
                self.answers.append((time.monotonic(), self.client.http.url, text))
        finally:
            self.client.close()


def migrate(pair: tv.VllmPair, args) -> dict:
    from ckpt_controller.adapters.vllm import VllmHttp

    pair.start_vllm()
    wait_until(lambda: pair.running_on("n1", "v0"), timeout_s=120, every_s=0.2,
               what="v0 RUNNING on n1 in the registry")
    n1, n2 = (f"http://{pair.addr[n]}:{tv.HTTP_PORT}" for n in ("n1", "n2"))
    direct = VllmHttp(n1, timeout_s=120)
    want = {p: direct.complete(p, args.tokens).text for p in PROMPTS[:args.clients]}
    stop = threading.Event()
    clients = [Client(pair.url, PROMPTS[i % len(PROMPTS)], args.tokens, stop)
               for i in range(args.clients)]
    for c in clients:
        c.start()
    wait_until(lambda: all(len(c.answers) >= 2 for c in clients), timeout_s=120,
               what="every client answered twice by n1")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "ckpt_controller", "--etcd", pair.url, "fleet", "migrate",
           "v0", "--to", "n2", "--drain", args.drain, "--level", str(args.level),
           "--op-id", "mvv", "--json"]
    for _ in range(5):  # vLLM on both CPUs may starve etcd: exit 4, the same --op-id goes on
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                              timeout=MOVE_TIMEOUT_S)
        if done.returncode != 4:
            break
    mig_s = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"fleet migrate: exit {done.returncode}: {done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")
    wait_until(lambda: all(any(u == n2 for _, u, _ in c.answers) for c in clients),
               timeout_s=MOVE_TIMEOUT_S, what="every client answered by n2")
    time.sleep(1.0)
    stop.set()
    for c in clients:
        c.join(120)
    answers = sorted(a for c in clients for a in c.answers)
    last_n1 = max(t for t, u, _ in answers if u == n1)
    first_n2 = min(t for t, u, _ in answers if u == n2)
    wrong = sum(text != want[c.prompt] for c in clients for _, _, text in c.answers)
    doc = json.loads(done.stdout)
    folder = pair.shared / "v0" / "mvv"
    dump, restore = read_stats(folder / "stats-dump"), read_stats(folder / "stats-restore")
    parts, hooks = phases(pair, "mvv", "v0")
    try:
        restore_process_s = float((folder.parent / "last-restore-s").read_text())
    except (OSError, ValueError):  # policy: not written: the hooks' split is not shown
        restore_process_s = 0.0
    criu_dump_s = criu_log_s(folder / "dump.log")
    return {"downtime_s": first_n2 - last_n1, "migrate_s": mig_s,
            "phases_s": parts, "hooks_s": hooks,
            # each CRIU hook's run beyond CRIU's own process (its log; the restore's time as
            # criu-restore measured it): the image checks and the hooks' own work
            "dump_hook_beyond_criu_s": hooks["capture"].get("dump", 0.0) - criu_dump_s,
            "restore_hook_beyond_criu_s": hooks["restore"].get("pre-restore", 0.0)
            - restore_process_s,
            "image_bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
            "largest_files": sorted(((p.stat().st_size, p.name) for p in folder.rglob("*")
                                     if p.is_file()), reverse=True)[:6],
            "frozen_s": dump.get("frozen_us", 0) / 1e6,
            "pages_write_s": dump.get("memwrite_us", 0) / 1e6,
            "restore_s": restore.get("restore_us", 0) / 1e6,
            "answers": len(answers), "lost": sum(len(c.errors) for c in clients),
            "errors": [e for c in clients for e in c.errors][:5],
            "wrong_answers": wrong, "outcome": doc["migration"]["outcome"],
            "steps_s": {d["step"]: d["ended_at_unix"] - d["started_at_unix"]
                        for d in doc["migration"]["done"]}}


def measure(args) -> dict:
    why = tv._vllm_reason
    if why is not None:
        raise SystemExit(f"bench/migrate_vllm.py: {why}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="ckpt-migv-", dir=args.base) as tmp:
        base = Path(tmp)
        model = make_tiny_llama(base / "tinyllama")
        for i in range(args.repeat):
            d = base / f"r{i}"
            d.mkdir()
            pair = tv.VllmPair(d, model, "shared")
            try:
                cold = cold_start(pair, args.tokens)
                moved = migrate(pair, args)
            finally:
                pair.close()
                shutil.rmtree(d, ignore_errors=True)
            run = {"cold_ready_s": cold["ready_s"], "cold_s": cold["first_answer_s"], **moved}
            run["downtime_over_cold"] = run["downtime_s"] / run["cold_s"]
            runs.append(run)
            print(f"repeat {i + 1}: downtime {run['downtime_s']:.2f} s, cold start "
                  f"{run['cold_s']:.1f} s, lost {run['lost']}", file=sys.stderr, flush=True)
    med = {k: median([r[k] for r in runs]) for k, v in runs[0].items()
           if isinstance(v, (int, float))}
    return {"drain": args.drain, "level": args.level, "base": str(args.base),
            "clients": args.clients, "tokens": args.tokens,
            "repeat": args.repeat, "median": med, "runs": runs}


def print_tables(res: dict) -> None:
    m = res["median"]
    table(f"a vLLM moved n1 -> n2 under {res['clients']} clients (median of {res['repeat']}; "
          f"drain {res['drain']}, level {res['level']}, {res['tokens']}-token completions, "
          f"images under {res['base']})",
          ["downtime s", "vLLM cold start s", "downtime / cold", "cold: ready s",
           "migration s", "answers", "lost", "wrong answers"],
          [[m["downtime_s"], m["cold_s"], m["downtime_over_cold"], m["cold_ready_s"],
            m["migrate_s"], m["answers"], m["lost"], m["wrong_answers"]]])
    table("the image (median)", ["image MiB", "frozen s", "pages written s", "CRIU restore s",
                                 "dump hook beyond CRIU s", "restore hook beyond CRIU s"],
          [[m["image_bytes"] / 2**20, m["frozen_s"], m["pages_write_s"], m["restore_s"],
            m["dump_hook_beyond_criu_s"], m["restore_hook_beyond_criu_s"]]])
    last = res["runs"][-1]
    table("the steps and the node-local operations' phases of the last move, seconds",
          ["step or operation", "phases"],
          [[step, f"{s:.2f}"] for step, s in last["steps_s"].items()]
          + [[op, ", ".join(f"{k} {v:.2f}" for k, v in ph.items())]
             for op, ph in last["phases_s"].items()])


def main() -> int:
    # a SIGTERM (``timeout``, ``kill``) ends the run through its ``finally`` blocks: the nodes'
    # network namespaces, processes and folders go with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = parser("migrate_vllm", __doc__)
    p.add_argument("--repeat", type=int, default=1, help="moves (each with its cold start)")
    p.add_argument("--clients", type=int, default=4, help="clients sending all along (1-4)")
    p.add_argument("--tokens", type=int, default=16, help="each completion's max_tokens")
    p.add_argument("--drain", choices=["keep", "wait", "abort"], default="wait",
                   help="the migration's drain (default wait: the short completions in "
                        "flight end on n1 before the dump)")
    p.add_argument("--level", type=int, choices=[0, 1, 2], default=1,
                   help="what the source releases before the dump (default 1, as the vLLM "
                        "migration test)")
    p.add_argument("--base", type=Path, default=Path("/tmp"),
                   help="where the nodes' folders and the shared image folder go (default "
                        "/tmp; not under /dev/shm: a copy restored beside its original gets "
                        "a /dev/shm of its own, so criu-restore refuses an engine that "
                        "writes below it)")
    args = p.parse_args()
    if not (1 <= args.clients <= len(PROMPTS)) or min(args.repeat, args.tokens) < 1:
        p.error(f"--clients 1 to {len(PROMPTS)}; --repeat and --tokens at least 1")
    res = measure(args)
    print_tables(res)
    write(args.out, "migrate_vllm", args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
