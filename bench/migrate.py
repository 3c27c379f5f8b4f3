"""Migration between nodes (issue 17): what a client waits while its engine moves, against a
cold start of the same engine on the target node, and what moving the image costs; both
image transports (``page-server``, ``shared``) in one run.

Each repeat is two fresh nodes (``Pair`` of ``tests/fleet/test_migration.py``: two node controllers
in network namespaces of their own on one link-local segment made by
``tests/support/netns_util.py``'s ``Namespaces.segment``, etcd in the root namespace, the
criu-dump/criu-restore hooks); the migration asks for ``--level`` (0 by default: the weights
stay in the process and go with the image; 2: left behind, re-woken from the model's file on
the target, which both nodes check first). In each:

- cold start: the engine's own command (``unshare --pid --fork setsid ckptctl engine serve``,
  the same model, on other ports) started in n2's namespace; from the process's start to the
  first token of one request sent as soon as it says it is ready. Then it is killed.
- migration: the engine started on n1, RUNNING in the registry; a client that follows it
  (``EngineClient.for_engine``, polling all along, moved by its registry watch) sends
  ``--kept`` long requests and, once each has tokens, ``ckptctl fleet migrate m0 --to n2
  --drain keep --level L --json`` runs. Downtime is the time from the last output with new
  tokens the client got from n1 to the first it got after it moved to n2 (the kept requests,
  recomputed there). After the engine's RUNNING on n2 (its record's ``since``; below 0:
  before it): when the client moved there (connected, its requests sent again, seen within
  its 10 ms polls), when it first heard from n2 (the answer to its resends: the engine
  answers between two of its steps), and its first new token.
- the image, read in the target's folder after the move: pages (``pages-*.img``) and the rest
  (every other file but logs: what ``criu_images.pack_small`` ships); what was moved:
  page server, the pages streamed during the dump plus the packed small files through etcd
  (the send step's ``small_bytes``); shared, nothing. CRIU's own ``stats-dump`` gives the
  time the engine was frozen and the time the pages took to write (through the page server,
  or into the shared folder); ``stats-restore`` the restore's.
- what the downtime is made of: the source's prepare; CRIU's dump (its ``-v3`` log's last
  timestamp); CRIU's restore (``stats-restore``) and its process's start and end beyond that
  (the process's time, which criu-restore writes as ``last-restore-s``); the image checks
  (the manifest's CRC, computed by criu-dump and checked by criu-restore, and through the page
  server the pages' check, timed again on the target's folder); the two hooks' own work (each
  hook's run, from the journal, less CRIU's and the checks'); the hook runner's (the capture
  and pre-restore phases less the hooks' runs); the re-wake; the first new token after
  RUNNING; the rest (hand-offs between the nodes, the last token before the prepare).
- the re-wake (level 2): the target's, from its journal, against the same engine re-woken
  again on n2 right after (``ckptctl prepare --level 2`` and ``rollback`` there): the same
  code and bytes, into memory the process had just given back; the two differ by what the
  kernel takes to give fresh pages (docs/fleet.md, "What a move costs").
- the whole migration two ways: the command's wall time, and the migration's record from
  its creation to its end (the command's process start and submit left out).
- the steps: each ``done`` entry of the migration record (receive, send, adopt, finish),
  its end minus its start; "between steps" is the migration's wall time less their sum (the
  coordinator's rounds, the inbox watches).

The first cold start of a run is not counted (it writes the model's weight file, and warms
the page cache the later ones then find warm too, as a target that migrated would).
Compare the ratios (downtime / cold start, moved / image), not the absolute times: these
machines are shared and noisy. Needs root, ``ip``, ``nsenter``, ``unshare``, ``make criu``
and ``make etcd``; says why and exits 2 without them.
Neighbours: ``tests/fleet/test_migration.py`` (``Pair``), ``tests/support/`` (``criu``,
``netns_util``), ``ckpt_controller/fleet/migration.py`` (the record read here), ``_common``
(tables, JSON).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, median, parser, table, write

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "fleet")]  # support; the fleet tests
import test_migration as tm  # noqa: E402  (the two nodes the migration tests use)
from support.criu import migration_missing  # noqa: E402
from support.processes import kill_naming  # noqa: E402
from support.timing import wait_until  # noqa: E402

from ckpt_controller.criu_images import PAGE_SIZE, read_stats  # noqa: E402

TRANSPORTS = ("page-server", "shared")
COLD_API, COLD_CONTROL = tm.API_PORT + 20, tm.CONTROL_PORT + 20
STEPS = ("receive", "send", "adopt", "finish")
#: one migration from its start to the first token on the target, at most
MOVE_TIMEOUT_S = 240.0
#: CRIU's service images start with this magic, then the image's own (criu/include/magic.h)


class Nodes(tm.Pair):
    """The migration tests' two nodes, with the benchmark's engine (model options) and the
    level the source prepares it at."""

    def __init__(self, d: Path, model_dir: Path, transport: str, engine_args: list[str],
                 level: int, digest_ahead: bool = False) -> None:
        super().__init__(d, model_dir, transport, level=level, engine_args=tuple(engine_args),
                         digest_ahead=digest_ahead)


def digested_ahead(nodes: Nodes) -> None:
    """``--digest-ahead``: wait until n2 (``[migration] digest_ahead``) keeps the digest of
    the weight file m0 re-wakes from, so that the move's receive finds it made."""
    path = nodes.engine_record()["reload_files"]["weights"]
    table = nodes.d / "n2" / "state" / "weight-digests.json"
    wait_until(lambda: table.exists() and path in json.loads(table.read_text())["files"],
               timeout_s=60, what="n2 digesting m0's weight file ahead")


def cold_start(nodes: Nodes) -> dict:
    """The engine started on n2 (other ports): seconds from its start to its ready line and
    to the first token of a request sent then."""
    from ckpt_controller.engine.client import EngineClient

    t0 = time.monotonic()
    eng = nodes.start_engine("cold", "n2", COLD_API, COLD_CONTROL)
    ready = time.monotonic()
    try:
        with EngineClient(f"tcp://{nodes.addr['n2']}:{COLD_API}") as client:
            rid = client.submit([1, 7, 3], 4)
            deadline = ready + 60
            while client.requests[rid].first_token_at is None:
                c = client.requests[rid]
                if c.rejected is not None or c.finish_reason is not None:
                    raise RuntimeError(f"the cold engine ended its first request: "
                                       f"{c.rejected or c.error}")
                if time.monotonic() > deadline:
                    raise RuntimeError("no token from the cold engine within 60 s")
                client.poll(0.01)
            first = client.requests[rid].first_token_at
    finally:
        kill_naming(str(nodes.model_dir))  # a PID namespace's init ignores SIGTERM
        eng.stop()
        nodes.started.remove(eng)
    return {"ready_s": ready - t0, "first_token_s": first - t0}


class Stream:
    """``kept`` long requests kept under way on a followed engine: one that ends on the
    source is replaced (so some are always there to be kept, however fast the model), until
    the engine refuses one (it drains) or the client moved. Notes when new tokens came: the
    last from the source, the first after the client moved."""

    def __init__(self, client, kept: int, max_tokens: int) -> None:
        self.client, self.kept, self.max_tokens = client, kept, max_tokens
        self.ids = [self._submit() for _ in range(kept)]
        self.refill = True
        self.seen = 0
        self.last_source: float | None = None
        self.first_target: float | None = None
        self.first_target_wall: float | None = None
        #: wall time the client first heard from n2 (an answer to its resends), and when it
        #: moved there (connected, its requests sent again)
        self.heard_target_wall: float | None = None
        self.moved_wall: float | None = None
        #: the requests without an end when the client moved: the ones kept across
        self.kept_across: int | None = None

    def _submit(self) -> str:
        return self.client.submit([len(getattr(self, "ids", ())) % 50 + 1, 7, 3],
                                  self.max_tokens)

    def under_way(self) -> bool:
        return all(self.client.requests[i].steps for i in self.ids)

    def ended(self) -> bool:
        return all(self.client.requests[i].ended for i in self.ids)

    def poll(self) -> None:
        c = self.client
        c.poll(0.01)
        now = time.monotonic()
        if c.moves and self.kept_across is None:
            self.kept_across = sum(not c.requests[i].ended for i in self.ids)
            self.moved_wall = time.time()
        if c.moves and self.heard_target_wall is None and any(
                c.requests[i].heard for i in self.ids):
            self.heard_target_wall = time.time()
        # tokens, not outputs: after the move the first answer may be a resend's whole
        # output so far (the target ran the kept requests on before the client came back)
        n = sum(len(c.requests[i].token_ids) for i in self.ids)
        if n > self.seen:
            self.seen = n
            if not c.moves:
                self.last_source = now
            elif self.first_target is None:
                self.first_target, self.first_target_wall = now, time.time()
        if self.refill:
            if c.moves or any(c.requests[i].rejected is not None for i in self.ids):
                self.refill = False
            else:
                live = sum(not c.requests[i].ended for i in self.ids)
                self.ids += [self._submit() for _ in range(self.kept - live)]


def ready_at(nodes: Nodes) -> float:
    """When m0 last entered its state (its record's ``since``: the agent's last transition),
    wall time: after a move, its RUNNING on the target, the first moment it serves there."""
    from ckpt_controller.fleet.etcd import Etcd
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.records import EngineRecord, decode

    with Etcd([nodes.url]) as store:
        kv = store.get(Keys("/ckpt").engine("m0"))
        rec = decode(EngineRecord, kv.value, kv.key)
    if rec.node != "n2" or rec.since is None:
        raise RuntimeError(f"m0's record names {rec.node}, since {rec.since}")
    return rec.since


def migrate(nodes: Nodes, kept: int, max_tokens: int, follow_after_s: float,
            level: int, digest_ahead: bool = False) -> dict:
    """The engine moved n1 to n2 under a following client: downtime, the migration's wall
    time and record. ``digest_ahead``: first waits for n2's digest of its weight file."""
    from ckpt_controller.engine.client import EngineClient
    from ckpt_controller.fleet.registry import Resolver

    nodes.start_engine()
    wait_until(lambda: nodes.running_on("n1"), timeout_s=60, every_s=0.2,
               what="m0 RUNNING on n1 in the registry")
    if digest_ahead:
        digested_ahead(nodes)
    with EngineClient.for_engine("m0", Resolver(nodes.url),
                                follow_after_s=follow_after_s) as client:
        stream = Stream(client, kept, max_tokens)
        wait_until(lambda: client.poll(0.02) is not None and stream.under_way(),
                   timeout_s=60, what="every kept request under way")
        t0, t0_wall, mig_s, end_wall = time.monotonic(), time.time(), None, None
        mig = subprocess.Popen([sys.executable, "-m", "ckpt_controller", "--etcd", nodes.url,
                                "fleet", "migrate", "m0", "--to", "n2", "--drain", "keep",
                                "--level", str(level), "--op-id", "mv", "--json"],
                               stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            while stream.first_target is None or mig_s is None:
                if mig_s is None and mig.poll() is not None:
                    mig_s, end_wall = time.monotonic() - t0, time.time()
                if mig_s is not None and (mig.returncode != 0 or stream.ended()):
                    break
                if time.monotonic() - t0 > MOVE_TIMEOUT_S:
                    raise RuntimeError(f"the migration and the first token on n2 took more "
                                       f"than {MOVE_TIMEOUT_S:.0f} s")
                stream.poll()
            out, err = mig.communicate(timeout=30)
        finally:
            if mig.poll() is None:
                mig.kill()
                mig.communicate()
        if mig.returncode != 0:
            raise RuntimeError(f"fleet migrate: exit {mig.returncode}: {out[-2000:]}"
                               f"{err[-2000:]}")
        if stream.first_target is None or stream.last_source is None:
            raise RuntimeError(f"no request was kept across the move (kept across: "
                               f"{stream.kept_across}, moves: {client.moves})")
        client.abort([i for i in stream.ids if not client.requests[i].ended])
    doc = json.loads(out)
    if doc["migration"]["outcome"] != "moved":
        raise RuntimeError(f"the migration did not move the engine: {doc['migration']}")
    ready = ready_at(nodes)
    return {"downtime_s": stream.first_target - stream.last_source, "migrate_s": mig_s,
            "command_started_wall": t0_wall, "command_ended_wall": end_wall,
            "client_wait_s": stream.heard_target_wall - ready,
            "client_moved_s": stream.moved_wall - ready,
            "first_token_after_ready_s": stream.first_target_wall - ready,
            "kept_across": stream.kept_across, "requests": len(stream.ids),
            "moves": client.moves, "op": doc["op"], "migration": doc["migration"]}


def image(migration: dict) -> dict:
    """The image in the target's folder: its pages and the rest; what moving it took."""
    done = {d["step"]: d for d in migration["done"]}
    received = done["receive"]["detail"]
    folder = Path(str(received["folder"]))
    files = [p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".log")
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    pages = sum(p.stat().st_size for p in files if p.parent == folder
                and p.name.startswith("pages-") and p.name.endswith(".img"))
    rest = sum(p.stat().st_size for p in files) - pages
    small = int(done["send"]["detail"].get("small_bytes") or 0)
    dump, restore = read_stats(folder / "stats-dump"), read_stats(folder / "stats-restore")
    return {"transport": received["transport"], "pages_bytes": pages, "rest_bytes": rest,
            "image_bytes": pages + rest, "small_packed_bytes": small,
            "moved_bytes": pages + small if received["transport"] == "page-server" else 0,
            "frozen_s": dump.get("frozen_us", 0) / 1e6,
            "pages_write_s": dump.get("memwrite_us", 0) / 1e6,
            "pages_written_bytes": dump.get("pages_written", 0) * PAGE_SIZE,
            "restore_s": restore.get("restore_us", 0) / 1e6,
            "criu_restore_process_s": _float(folder.parent / "last-restore-s"),
            "image_check_s": image_check_s(folder, received["transport"])}


def _float(path: Path) -> float:
    try:
        return float(path.read_text())
    except (OSError, ValueError):  # policy: not written (an older hook): counted as 0
        return 0.0


#: the image files named as arguments summed as the hooks sum them: the pages files a cksum
#: each, as many at once as there are CPUs, beside one cksum of the rest
HOOKS_CKSUM = ("pages='^\\./pages-[^/]*\\.img$'; "
               "printf '%s\\n' \"$@\" | grep -e \"$pages\" | tr '\\n' '\\0' "
               "| xargs -0 -r -P \"$(nproc)\" -n 1 cksum & "
               "printf '%s\\n' \"$@\" | grep -v -e \"$pages\" | tr '\\n' '\\0' "
               "| xargs -0 -r cksum; wait")


def image_check_s(folder: Path, transport: str) -> float:
    """What the hooks' damaged-image checks cost on this image, timed again here on the
    target's folder (warm, as the hooks find it): the manifest's CRC of every file it lists,
    which criu-dump computes and criu-restore checks (each once), and through the page server
    the pages' check (``criu_images check``, a Python process) as well."""
    names = [line.split(" ", 2)[2] for line in
             (folder / "criu-manifest").read_text().splitlines() if line.count(" ") >= 2]
    t0 = time.monotonic()
    subprocess.run(["sh", "-c", HOOKS_CKSUM, "sh", *names], cwd=folder,
                   stdout=subprocess.DEVNULL, check=True)
    took = 2 * (time.monotonic() - t0)  # written by the dump, checked by the restore
    if transport == "page-server":
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-S", "-m", "ckpt_controller.criu_images", "check",
                        str(folder)], cwd=ROOT, stdout=subprocess.DEVNULL, check=True,
                       env={"PYTHONPATH": str(ROOT)})
        took += time.monotonic() - t0
    return took


def criu_log_s(log: Path) -> float:
    """CRIU's own time in a ``-v3`` log: its last line's timestamp (``(SS.ffffff)``, seconds
    since it started); 0 when the log has none."""
    last = 0.0
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("(") and ")" in line:
            try:
                last = float(line[1:line.index(")")])
            except ValueError:
                continue
    return last


def downtime_parts(run: dict) -> dict[str, float]:
    """What the downtime is made of, seconds: the source's prepare; CRIU's dump (its log) and
    restore (its stats), and the restore process's start and end beyond its stats; the image
    checks (the manifest's CRC both sides, the page server's pages check); the two hooks' own
    work around those (the tree walk, the PIDs, their processes); the hook runner's (the
    capture and pre-restore phases less the hooks' runs); the re-wake (weights read back and
    verified bit-exact) and resume; the client's first new token after the engine's RUNNING
    (its move, the kept requests' context computed again: level 2 left the KV cache out); and
    the rest (the hand-offs between the nodes, the last token before the prepare)."""
    ph, hooks = run["phases_s"], run["hooks_s"]
    restore = ph["restore"]
    dump_hook, restore_hook = hooks["capture"]["dump"], hooks["restore"]["pre-restore"]
    criu_restore = run["criu_restore_process_s"] or run["restore_s"]
    parts = {"prepare": ph["prepare"].get("prepare", 0.0),
             "criu dump": run["criu_dump_s"],
             "criu restore": run["restore_s"],
             "criu restore's start": criu_restore - run["restore_s"],
             "image checks": run["image_check_s"],
             "hooks' own": dump_hook - run["criu_dump_s"] + restore_hook - criu_restore
             - run["image_check_s"],
             "hook runner": ph["capture"].get("capture", 0.0) - dump_hook
             + restore.get("pre-restore", 0.0) - restore_hook,
             "re-wake": restore.get("rewake", 0.0) + restore.get("post-restore", 0.0)
             + restore.get("resume", 0.0),
             "first token after ready": run["first_token_after_ready_s"]}
    parts["rest"] = run["downtime_s"] - sum(parts.values())
    return parts


def timeline(op: dict, migration: dict, command_s: float, started: float,
             ended: float) -> dict:
    """Each step's time (its end less its start, on its node), and the rest of the
    command's time: the coordinator's waits before the first step, between steps and after
    the last (watches, rounds), and the command's own (its start, its polling): before the
    record (``started``, when it was run: its process's start, imports and submit) and after
    the record's end (``ended``, when it was seen to exit: seeing the end, the output, the
    process's exit)."""
    def at(doc: dict, name: str) -> float:  # docs/json.md: each time as seconds too
        return doc[f"{name}_at_unix"]

    done = [d for d in migration["done"] if d["step"] in STEPS]
    steps = {d["step"]: at(d, "ended") - at(d, "started") for d in done}
    recorded = at(op, "ended") - at(op, "created")
    return {"steps_s": steps, "before_first_s": at(done[0], "started") - at(op, "created"),
            "between_steps_s": sum(at(b, "started") - at(a, "ended")
                                   for a, b in zip(done, done[1:])),
            "gaps_s": {f"{a['step']}->{b['step']}": at(b, "started") - at(a, "ended")
                       for a, b in zip(done, done[1:])},
            "after_last_s": at(op, "ended") - at(done[-1], "ended"),
            "recorded_s": recorded, "command_s": command_s - recorded,
            "command_before_s": at(op, "created") - started,
            "command_after_s": ended - at(op, "ended")}


def phases(nodes: Nodes, op_id: str = "mv", engine: str = "m0"
           ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """The node-local operations of the move, phase by phase (seconds, from each node's
    journal: ``ckptctl history --op-id``): the source's prepare and capture, the target's
    restore (its pre-restore phase is the criu-restore hook); and in each, its hooks' runs
    by point (each hook process's own time, as the hook runner measured it)."""
    from ckpt_controller.fleet.migration.record import local_ids

    ids = local_ids(op_id, engine)
    out: dict[str, dict[str, float]] = {}
    hooks: dict[str, dict[str, float]] = {}
    for node, kind in (("n1", "prepare"), ("n1", "capture"), ("n2", "restore")):
        r = nodes.controllers[node].ckptctl("history", "--op-id", ids[kind], "--json",
                                            timeout=60)
        doc = json.loads(r.stdout)
        out[kind] = {rec["data"]["name"]: rec["data"]["duration_s"]
                     for rec in doc["records"] if rec["record_type"] == "phase"}
        hooks[kind] = {}
        for rec in doc["records"]:
            if rec["record_type"] == "hook":
                point = rec["data"]["point"]
                hooks[kind][point] = hooks[kind].get(point, 0.0) + rec["data"]["duration_s"]
    return out, hooks


def rewake_compared(nodes: Nodes, op_id: str = "mv", engine: str = "m0") -> dict:
    """The target's re-wake of the move (its memory record: the weights read back from their
    file, the KV cache zero-filled, both checked) against the same engine re-woken again on
    the same node right after (a level-2 ``prepare`` and a ``rollback`` through n2's
    controller): the same code and bytes, the second time into memory the process had just
    given back. Seconds each; empty where the move re-woke nothing (level 0)."""
    from ckpt_controller.fleet.migration.record import local_ids

    n2 = nodes.controllers["n2"]
    doc = json.loads(n2.ckptctl("history", "--op-id", local_ids(op_id, engine)["restore"],
                                "--json", timeout=60).stdout)
    moved = [rec["data"] for rec in doc["records"] if rec["record_type"] == "memory"]
    if not moved:
        return {}
    for verb, extra in (("prepare", ["--level", "2", "--drain", "keep"]), ("rollback", [])):
        r = n2.ckptctl(verb, engine, *extra, "--json", timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"the second re-wake's {verb} on n2 failed: {r.stdout}{r.stderr}")
    again = json.loads(r.stdout)["engines"][0]["rewoken"]
    return {"rewake_moved_s": moved[-1]["duration_s"], "rewake_again_s": again["duration_s"],
            "rewake_bytes": again["tensor_bytes"],
            "rewake_moved_over_again": moved[-1]["duration_s"] / again["duration_s"]}


def engine_args(args) -> list[str]:
    return ["--model", args.model, "--kv-blocks", str(args.kv_blocks)]


def one_repeat(base: Path, model_dir: Path, transport: str, args, count_cold: bool) -> dict:
    d = Path(tempfile.mkdtemp(prefix=f"{transport[:2]}-", dir=base))
    nodes = Nodes(d, model_dir, transport, engine_args(args), args.level, args.digest_ahead)
    try:
        if not count_cold:  # the run's first: it writes the weight file
            cold_start(nodes)
        cold = cold_start(nodes)
        moved = migrate(nodes, args.kept, args.max_tokens, args.follow_after, args.level,
                        args.digest_ahead)
        img = image(moved["migration"])
        parts, hooks = phases(nodes)
        times = timeline(moved["op"], moved["migration"], moved["migrate_s"],
                         moved["command_started_wall"], moved["command_ended_wall"])
        rewake = rewake_compared(nodes)
        img["criu_dump_s"] = criu_log_s(next(d.rglob("dump.log")))
        if img["transport"] != transport:
            raise RuntimeError(f"the target received the image by {img['transport']}, not "
                               f"{transport}")
    finally:
        nodes.close()
        if args.keep is None:  # the images are hundreds of MiB each
            shutil.rmtree(d, ignore_errors=True)
    run = {"cold_ready_s": cold["ready_s"], "cold_s": cold["first_token_s"],
           "downtime_s": moved["downtime_s"], "migrate_s": moved["migrate_s"],
           "client_wait_s": moved["client_wait_s"],
           "client_moved_s": moved["client_moved_s"],
           "first_token_after_ready_s": moved["first_token_after_ready_s"],
           "phases_s": parts, "hooks_s": hooks,
           "kept_across": moved["kept_across"], "requests": moved["requests"], **img,
           **times, **rewake}
    run["downtime_over_cold"] = run["downtime_s"] / run["cold_s"]
    run["migrate_over_downtime"] = run["migrate_s"] / run["downtime_s"]
    # the migration itself, from its record's creation to its end: the command's process
    # start and submit left out
    run["recorded_over_downtime"] = run["recorded_s"] / run["downtime_s"]
    run["moved_over_image"] = run["moved_bytes"] / run["image_bytes"]
    run["downtime_parts_s"] = downtime_parts(run)
    return run


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for transport, rows in runs.items():
        med = {k: median([r[k] for r in rows]) for k, v in rows[0].items()
               if isinstance(v, (int, float))}
        med["steps_s"] = {s: median([r["steps_s"][s] for r in rows]) for s in STEPS}
        med["phases_s"] = {op: {ph: median([r["phases_s"][op].get(ph, 0.0) for r in rows])
                                for ph in rows[0]["phases_s"][op]}
                           for op in rows[0]["phases_s"]}
        med["downtime_parts_s"] = {k: median([r["downtime_parts_s"][k] for r in rows])
                                   for k in rows[0]["downtime_parts_s"]}
        out[transport] = {"median": med, "runs": rows}
    return out


def measure(args) -> dict:
    why = migration_missing()
    if why is not None:
        raise SystemExit(f"bench/migrate.py: {why}")
    # ipc and interface names stay short: a private folder under /tmp
    with (contextlib.nullcontext(str(args.keep)) if args.keep else
          tempfile.TemporaryDirectory(prefix="ckpt-mig-", dir="/tmp")) as tmp:
        base = Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        model_dir = base / "model"
        model_dir.mkdir(exist_ok=True)
        runs: dict[str, list[dict]] = {t: [] for t in TRANSPORTS}
        first = True
        for i in range(args.repeat):
            for transport in TRANSPORTS:
                r = one_repeat(base, model_dir, transport, args, count_cold=not first)
                first = False
                runs[transport].append(r)
                print(f"{transport} {i + 1}: downtime {r['downtime_s']:.2f} s, cold start "
                      f"{r['cold_s']:.2f} s, migration {r['migrate_s']:.2f} s, image "
                      f"{r['image_bytes'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    return {"model_args": engine_args(args), "level": args.level, "kept": args.kept,
            "follow_after_s": args.follow_after, "repeat": args.repeat,
            "digest_ahead": args.digest_ahead, "transports": summarize(runs)}


def print_tables(res: dict) -> None:
    tr = res["transports"]
    mib = 2**20
    n = res["repeat"]
    table(f"downtime of a kept request against a cold start on the target (median of {n}; "
          f"{' '.join(res['model_args'])}, level {res['level']}"
          f"{', digest_ahead' if res.get('digest_ahead') else ''})",
          ["transport", "downtime s", "cold start s", "downtime / cold", "cold: ready s",
           "migration s", "migration / downtime", "recorded / downtime",
           "client moved, after ready s",
           "client heard, after ready s", "first token after ready s"],
          [[t, m["downtime_s"], m["cold_s"], m["downtime_over_cold"], m["cold_ready_s"],
            m["migrate_s"], m["migrate_over_downtime"], m["recorded_over_downtime"],
            m["client_moved_s"],
            m["client_wait_s"], m["first_token_after_ready_s"]]
           for t, m in ((t, tr[t]["median"]) for t in tr)])
    table("the image and moving it (median)",
          ["transport", "pages MiB", "rest KiB", "packed KiB", "moved MiB", "moved / image",
           "frozen s", "pages written s", "restore s"],
          [[t, m["pages_bytes"] / mib, m["rest_bytes"] / 1024, m["small_packed_bytes"] / 1024,
            m["moved_bytes"] / mib, m["moved_over_image"], m["frozen_s"], m["pages_write_s"],
            m["restore_s"]] for t, m in ((t, tr[t]["median"]) for t in tr)])
    for op in next(iter(tr.values()))["median"]["phases_s"]:
        names = list(next(iter(tr.values()))["median"]["phases_s"][op])
        table(f"the {op} of the move, phase by phase, seconds (median; from the node's "
              "journal)", ["transport", *names],
              [[t, *(m["phases_s"][op].get(n, 0.0) for n in names)]
               for t, m in ((t, tr[t]["median"]) for t in tr)])
    names = list(next(iter(tr.values()))["median"]["downtime_parts_s"])
    table("what the downtime is made of, seconds (median; each part's median: their sum "
          "need not be the downtime's)", ["transport", *names, "downtime"],
          [[t, *(m["downtime_parts_s"][n] for n in names), m["downtime_s"]]
           for t, m in ((t, tr[t]["median"]) for t in tr)])
    if "rewake_moved_s" in next(iter(tr.values()))["median"]:
        table("the re-wake of the move against the same re-wake again on n2 right after, "
              "into memory the engine had just given back (median; seconds)",
              ["transport", "MiB", "after the move", "again", "after the move / again"],
              [[t, m["rewake_bytes"] / mib, m["rewake_moved_s"], m["rewake_again_s"],
                m["rewake_moved_over_again"]] for t, m in ((t, tr[t]["median"]) for t in tr)])
    table("the migration's steps and waits, seconds (median; waits: the coordinator's "
          "before the first step, between steps, after the last; the command's own, and "
          "of it what came before the record and after its end)",
          ["transport", *STEPS, "before", "between", "after", "command", "its start",
           "its end", "whole"],
          [[t, *(m["steps_s"][s] for s in STEPS), m["before_first_s"], m["between_steps_s"],
            m["after_last_s"], m["command_s"], m["command_before_s"], m["command_after_s"],
            m["migrate_s"]]
           for t, m in ((t, tr[t]["median"]) for t in tr)])


def main() -> int:
    # a SIGTERM (``timeout``, ``kill``) ends the run through its ``finally`` blocks: the nodes'
    # network namespaces, processes and folders go with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = parser("migrate", __doc__)
    p.add_argument("--repeat", type=int, default=3, help="migrations per transport")
    p.add_argument("--model", default="small",
                   help="the reference engine's --model (tiny, small, a size like 512MiB)")
    p.add_argument("--kv-blocks", type=int, default=128,
                   help="the engine's --kv-blocks (KV pool, in the image at level 0; the "
                        "kept requests must fit: about max-tokens / 16 blocks each)")
    p.add_argument("--level", type=int, choices=[0, 2], default=0,
                   help="the level the source prepares the engine at (0: weights in the "
                        "image; 2: reloaded from the file on the target)")
    p.add_argument("--kept", type=int, default=2, help="requests kept across the move")
    p.add_argument("--max-tokens", type=int, default=1000,
                   help="each kept request's max_tokens (one that ends on the source is "
                        "replaced until the drain)")
    p.add_argument("--follow-after", type=float, default=1.0,
                   help="the client's follow_after_s: silence before it looks the engine up "
                        "again without its registry watch (default 1, the client's)")
    p.add_argument("--digest-ahead", action="store_true",
                   help="the nodes' [migration] digest_ahead: n2 digests the weight file "
                        "before the move is asked for (waited for), so the receive reads none")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="run in DIR and leave it (the nodes' logs and images, etcd's); a "
                        "short path")
    p.add_argument("--quick", action="store_true",
                   help="the test suite's size: --model tiny, one repeat")
    args = p.parse_args()
    if args.quick:
        args.model, args.repeat = "tiny", 1
    if min(args.repeat, args.kept, args.max_tokens, args.kv_blocks) < 1 \
            or args.follow_after <= 0:
        p.error("--repeat, --kept, --max-tokens and --kv-blocks must be at least 1, "
                "--follow-after more than 0")
    results = measure(args)
    print_tables(results)
    write(args.out, "migrate", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
