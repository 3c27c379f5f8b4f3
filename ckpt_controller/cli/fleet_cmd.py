"""``ckptctl fleet ...``: the fleet in etcd, read (and, later, driven) across node controllers.

``--etcd URL[,URL...]`` (default ``$CKPT_ETCD``) names etcd's members; ``--etcd-ca``,
``--etcd-cert`` and ``--etcd-key`` (``$CKPT_ETCD_CA``, ``$CKPT_ETCD_CERT``,
``$CKPT_ETCD_KEY``) give TLS, ``--etcd-prefix`` (``$CKPT_ETCD_PREFIX``, default ``/ckpt``) the
keys' prefix, as the node controllers' ``[fleet]`` tables do. etcd unavailable: exit 4 at once
(each member is given ``REQUEST_TIMEOUT_S``). Neighbours: ``fleet.registry`` (the view),
``cli.common``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ckpt_controller.cli.common import EXIT_CODES, age, table
from ckpt_controller.cli.output import emit
from ckpt_controller.errors import UnreachableError, UsageError

#: how long the command waits for one etcd member (healthy, etcd answers in milliseconds)
CLI_TIMEOUT_S = 1.5
#: while following an operation that goes on without the command, how long etcd may leave
#: every read unanswered before the command gives up (a busy member can miss CLI_TIMEOUT_S
#: now and then; a first read, before anything is submitted, still fails fast)
FOLLOW_PATIENCE_S = 10.0
#: the pause between two tries of a read etcd did not answer
FOLLOW_RETRY_S = 0.5

EPILOG = """\
The fleet's node controllers register in etcd when their TOML has a [fleet] table
(docs/fleet.md); this command reads what they published. STATE is the agent's state as its
node last saw it; UNREACHABLE when the node could not reach the agent, and NODE-DOWN (with
the last state known) when the node controller itself is gone (its lease expired). AGE is the
time since the engine entered its state.

""" + EXIT_CODES + """
  (fleet status: 4 also when etcd is unavailable, or an engine is unreachable or its node down)"""


def add_global_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--etcd", metavar="URL[,URL...]", default=env("CKPT_ETCD"),
                        help="etcd's client URLs, for `fleet` (default: $CKPT_ETCD)")
    parser.add_argument("--etcd-ca", metavar="FILE", default=env("CKPT_ETCD_CA"),
                        help="CA certificate etcd's certificate is checked against "
                             "(default: $CKPT_ETCD_CA)")
    parser.add_argument("--etcd-cert", metavar="FILE", default=env("CKPT_ETCD_CERT"),
                        help="TLS client certificate for etcd (default: $CKPT_ETCD_CERT)")
    parser.add_argument("--etcd-key", metavar="FILE", default=env("CKPT_ETCD_KEY"),
                        help="its key (default: $CKPT_ETCD_KEY)")
    parser.add_argument("--etcd-prefix", metavar="PREFIX",
                        default=env("CKPT_ETCD_PREFIX") or "/ckpt",
                        help="where the fleet's keys are (default: $CKPT_ETCD_PREFIX, else "
                             "/ckpt)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    fmt = {"epilog": EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
    sp = sub.add_parser("fleet", help="the fleet of node controllers, through etcd", **fmt)
    fsub = sp.add_subparsers(dest="fleet_command", metavar="COMMAND", required=True)
    st = fsub.add_parser("status", help="every node and engine in one table", **fmt)
    st.add_argument("--json", action="store_true",
                    help="one JSON document (docs/fleet.md gives its shape)")
    st.set_defaults(run=_status)
    w = fsub.add_parser("watch", help="follow a fleet operation until it ends", **fmt)
    w.add_argument("op_id", metavar="OP_ID", help="the fleet operation's id")
    w.add_argument("--json", action="store_true",
                   help="JSON lines: one per change of a part, then the result")
    w.set_defaults(run=_watch)
    _add_operations(fsub, fmt)


OP_TEXTS = {
    "prepare": "drain and release engines across nodes (they stay out of service, counted by "
               "--max-unavailable, until restored or rolled back)",
    "capture": "run the dump hooks on PREPARED engines, each on its node",
    "restore": "re-wake PREPARED (or FAILED) engines, each on its node",
    "cycle": "prepare, capture and restore, rolling across the fleet under --max-unavailable",
    "rollback": "return PREPARED engines to RUNNING, each on its node",
}


def _add_operations(fsub, fmt: dict) -> None:
    from ckpt_controller.cli.common import arg_type
    from ckpt_controller.cli.controller_cmds import prepare_opts
    from ckpt_controller.values import DURATION, OP_ID

    for kind, text in OP_TEXTS.items():
        sp = fsub.add_parser(kind, help=text, **fmt)
        sp.add_argument("engines", nargs="*", metavar="ENGINE", help="engine names")
        which = sp.add_mutually_exclusive_group()
        which.add_argument("--all", action="store_true", help="every engine in the fleet")
        which.add_argument("--selector", metavar="KEY=VALUE", action="append",
                           help="engines whose labels match (repeat: all must match)")
        sp.add_argument("--max-unavailable", metavar="N|P%", type=_max_unavailable,
                        help="at most N engines (or P percent of those named) out of service "
                             "at once, fleet-wide, counting those out already (default: all "
                             "named)")
        sp.add_argument("--op-id", type=arg_type(OP_ID),
                        help="operation id (1-128 letters, digits, '.', '_', '-'); repeating "
                             "it follows the first operation and returns its result")
        sp.add_argument("--deadline", type=arg_type(DURATION), metavar="S",
                        help="overall deadline per engine (default: each node's own)")
        sp.add_argument("--json", action="store_true", help="print one JSON document")
        if kind in ("prepare", "cycle"):
            prepare_opts(sp)
        if kind == "rollback":
            sp.add_argument("--reason", default="", help="recorded with the transition")
        if kind == "restore":
            sp.add_argument("--image", metavar="OP_ID", type=arg_type(OP_ID),
                            help="restore the image this node-local operation id dumped")
        sp.set_defaults(run=_operation, op=kind)
    m = fsub.add_parser("migrate", help="move a RUNNING engine to another node with CRIU "
                        "(docs/fleet.md, Migration)", **fmt)
    m.add_argument("engine", metavar="ENGINE", help="the engine's name")
    m.add_argument("--to", required=True, metavar="NODE", help="the node it moves to")
    m.add_argument("--drain", choices=["keep", "wait", "abort"],
                   help="in-flight requests: kept and finished on the target (keep), finished "
                        "first (wait) or ended now (abort); default: the source node's")
    m.add_argument("--drain-timeout", type=arg_type(DURATION), metavar="S",
                   help="how long a wait drain may take (default: the source node's)")
    m.add_argument("--deadline", type=arg_type(DURATION), metavar="S",
                   help="overall deadline of each node-local step (default: each node's own)")
    m.add_argument("--op-id", type=arg_type(OP_ID),
                   help="operation id; repeating it follows the first migration")
    m.add_argument("--json", action="store_true", help="print one JSON document")
    m.set_defaults(run=_migrate)


def _migrate(args: argparse.Namespace) -> int:
    import uuid

    from ckpt_controller.fleet import migration
    from ckpt_controller.fleet.keys import Keys

    keys = Keys(args.etcd_prefix)
    params = {k: v for k, v in (("drain", args.drain), ("drain_timeout_s", args.drain_timeout),
                                ("deadline_s", args.deadline)) if v is not None}
    op_id = args.op_id or f"fleet-migrate-{uuid.uuid4().hex[:12]}"
    with client(args) as c:
        submitted = False
        try:
            migration.submit(c, keys, op_id=op_id, engine=args.engine, to=args.to,
                             params=params)
            submitted = True
            if not args.json:
                print(f"fleet migrate {op_id}: {args.engine} to {args.to}", file=sys.stderr)
            op, mig = _follow_migration(c, keys, op_id, progress=not args.json)
        except KeyboardInterrupt:
            print(f"ckptctl: interrupted; migration {op_id} "
                  + ("goes on" if submitted else "may be recorded and then goes on")
                  + f" (follow it with --op-id {op_id}, or see ckptctl fleet status)",
                  file=sys.stderr)
            return 130
        except UnreachableError as err:
            if not submitted:
                raise
            raise UnreachableError(
                f"{err.message}; migration {op_id} stays recorded and goes on when etcd is "
                f"back (follow it with the same --op-id)", op_id=op_id, **err.details) from None
    if args.json:
        emit("fleet-migration", op=op, migration=mig)
    else:
        where = {"moved": f"RUNNING on {mig.target}", "stayed": f"RUNNING on {mig.source}",
                 "lost": "lost (the engine died)", "failed": "not RUNNING"}.get(mig.outcome, "")
        print(f"fleet migrate {op.op_id}: {op.status}: {mig.engine} {mig.outcome}, {where}"
              + (f" ({mig.error})" if mig.error else ""))
    if mig.outcome == "moved":
        return 0
    return 4 if mig.outcome == "lost" else 1


def _follow_migration(c, keys, op_id: str, progress: bool, every_s: float = 0.2,
                      lines: bool = False):
    """Wait for migration ``op_id`` to end: (its operation, its record); prints each step's
    start and end on stderr with ``progress``, or each ended step as a JSON line on stdout
    with ``lines``."""
    from ckpt_controller.fleet import migration, ops

    start = time.monotonic()
    said: set[tuple] = set()
    patient = Patient(op_id)
    while True:
        op = patient.read(lambda: ops.read_op(c, keys, op_id))
        mig, _ = patient.read(lambda: migration.read(c, keys, op_id))
        if op is None or mig is None:
            raise UsageError(f"no migration {op_id}", op_id=op_id)
        if lines:
            for end in mig.done:
                key = ("line", end.step, end.ended)
                if key not in said:
                    said.add(key)
                    emit("fleet-step", op_id=op_id, elapsed_s=round(
                        time.monotonic() - start, 3), step=end, stream=True)
        if progress:
            for end in mig.done:
                key = (end.step, end.status, end.ended)
                if key not in said:
                    said.add(key)
                    took = f" in {end.ended - end.started:.2f}s" if end.started else ""
                    why = f": {end.error}" if end.error else ""
                    print(f"[{time.monotonic() - start:6.1f}s] {end.step} on {end.node}: "
                          f"{end.status}{took}{why}", file=sys.stderr, flush=True)
            if mig.started and ("start", mig.step, mig.step_started) not in said:
                said.add(("start", mig.step, mig.step_started))
                node = mig.source if migration.RUNS_ON[mig.step] == "source" else mig.target
                print(f"[{time.monotonic() - start:6.1f}s] {mig.step} on {node} ...",
                      file=sys.stderr, flush=True)
        if op.status != "running":
            return op, mig
        time.sleep(every_s)


class Patient:
    """Reads of an operation being followed: one that etcd leaves unanswered is tried again,
    for up to ``FOLLOW_PATIENCE_S`` of silence, said once on stderr (and that etcd answers
    again); past that the last ``UnreachableError`` goes to the caller (exit 4: the operation
    goes on, ``fleet watch`` follows it again)."""

    def __init__(self, op_id: str, patience_s: float | None = None) -> None:
        self.op_id = op_id
        self.patience_s = FOLLOW_PATIENCE_S if patience_s is None else patience_s
        self._silent_since: float | None = None

    def read(self, fn):
        while True:
            try:
                value = fn()
            except UnreachableError as err:  # policy: wait for etcd, then give up typed
                now = time.monotonic()
                if self._silent_since is None:
                    self._silent_since = now
                    print(f"etcd did not answer ({err.message}); still following {self.op_id}, "
                          f"for up to {self.patience_s:.0f}s", file=sys.stderr, flush=True)
                elif now - self._silent_since >= self.patience_s:
                    raise
                time.sleep(FOLLOW_RETRY_S)
                continue
            if self._silent_since is not None:
                print(f"etcd answers again after {time.monotonic() - self._silent_since:.1f}s",
                      file=sys.stderr, flush=True)
                self._silent_since = None
            return value


def _max_unavailable(text: str) -> tuple[int, bool]:
    """``N`` or ``P%``: (the number, whether it is a percentage)."""
    percent = text.endswith("%")
    body = text[:-1] if percent else text
    try:
        value = int(body)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not N or P%: {text!r}") from None
    if value < 1 or (percent and value > 100) or value > 1_000_000:
        raise argparse.ArgumentTypeError(f"must be 1..1000000, or 1%..100%: {text!r}")
    return value, percent


def client(args: argparse.Namespace):
    from ckpt_controller.fleet.etcd import Etcd

    if not args.etcd:
        raise UsageError("no etcd given: --etcd URL or $CKPT_ETCD")
    urls = [u.strip() for u in args.etcd.split(",") if u.strip()]
    files = {}
    for name in ("ca", "cert", "key"):
        value = getattr(args, f"etcd_{name}")
        if value:
            path = Path(value)
            if not path.is_file():
                raise UsageError(f"--etcd-{name}: {path} is not a readable file")
            files[name] = path
    if ("cert" in files) != ("key" in files):
        raise UsageError("--etcd-cert and --etcd-key go together")
    # a command fails fast when etcd is away: each member gets CLI_TIMEOUT_S
    return Etcd(urls, ca_cert=files.get("ca"), cert=files.get("cert"), key=files.get("key"),
                timeout_s=CLI_TIMEOUT_S)


def _operations(c, keys) -> list:
    """Every fleet operation still running, with its parts."""
    from ckpt_controller.fleet import ops

    out = []
    for kv in c.get_prefix(keys.ops):
        op = ops._op_dec.decode(kv.value)
        if op.status == "running":
            out.append((op, ops.read_parts(c, keys, op.op_id)))
    return out


def _running_ops(found: list) -> list[dict]:
    return [{"op_id": op.op_id, "kind": op.kind, "total": len(op.engines),
             "done": sum(p.status not in ("pending", "started") for p, _ in parts.values()),
             "started": sum(p.status == "started" for p, _ in parts.values()),
             "created": op.created} for op, parts in found]


def _status(args: argparse.Namespace) -> int:
    from ckpt_controller.fleet import registry
    from ckpt_controller.fleet.keys import Keys

    with client(args) as c:
        view = registry.read(c, Keys(args.etcd_prefix))
        c_ops = _operations(c, Keys(args.etcd_prefix))
    now = time.time()
    healthy = all(r.node_up and r.engine.reachable for r in view.engines)
    if args.json:
        from ckpt_controller.cli.output import document, wall_time

        doc = document("fleet-status", view)
        for row in doc["engines"]:
            rec = row["engine"]
            rec["age_s"] = None if rec["since_at_unix"] is None else round(
                now - rec["since_at_unix"], 3)
        doc["operations"] = [{k: v for k, v in op.items() if k != "created"}
                             | wall_time("created_at", op["created"])
                             for op in _running_ops(c_ops)]
        print(json.dumps(doc))
        return 0 if healthy else 4
    rows = [("NODE", "NAME", "STATE", "GEN", "HELD-BY", "LAST-OP", "AGE")]
    for r in view.engines:
        e = r.engine
        state = (f"NODE-DOWN ({e.state or 'unknown'})" if not r.node_up
                 else (e.state or "UNKNOWN") if e.reachable else "UNREACHABLE")
        rows.append((e.node, e.engine, state, "-" if e.generation is None else str(e.generation),
                     e.holder or "-", e.last_op or "-",
                     "-" if e.since is None else age(now - e.since)))
    print(table(rows))
    up = {n.node for n in view.nodes}
    down = sorted({r.engine.node for r in view.engines} - up)
    print(f"\n{len(view.nodes)} node(s) up" + (f"; down: {', '.join(down)}" if down else "")
          + f"; {len(view.engines)} engine(s)")
    for op in _running_ops(c_ops):
        print(f"fleet {op['kind']} {op['op_id']} running: {op['done']}/{op['total']} done, "
              f"{op['started']} running now")
    for key, why in view.unreadable.items():
        print(f"ckptctl: unreadable record {key}: {why}", file=sys.stderr)
    return 0 if healthy else 4


def _select(args: argparse.Namespace, client, keys) -> list[str]:
    from ckpt_controller.fleet.keys import decode_engine

    chosen = bool(args.engines) + bool(args.all) + bool(args.selector)
    if chosen != 1:
        raise UsageError("name the engines, or give --all or --selector (one of them)")
    if args.engines:
        return list(dict.fromkeys(args.engines))
    records = [decode_engine(kv.value) for kv in client.get_prefix(keys.engines)]
    if args.all:
        names = [r.engine for r in records]
    else:
        wanted = {}
        for item in args.selector:
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise UsageError(f"--selector wants KEY=VALUE, got {item!r}")
            wanted[key] = value
        names = [r.engine for r in records
                 if all(r.labels.get(k) == v for k, v in wanted.items())]
    if not names:
        raise UsageError("no engine in the fleet matches", selector=args.selector)
    return sorted(names)


def _operation(args: argparse.Namespace) -> int:
    import uuid

    from ckpt_controller.cli.controller_cmds import operation_params
    from ckpt_controller.fleet import ops
    from ckpt_controller.fleet.keys import Keys

    keys = Keys(args.etcd_prefix)
    with client(args) as c:
        engines = _select(args, c, keys)
        limit = None
        if args.max_unavailable is not None:
            value, percent = args.max_unavailable
            limit = max(1, len(engines) * value // 100) if percent else value
        params = {k: v for k, v in operation_params(args).items() if v is not None}
        op_id = args.op_id or f"fleet-{args.op}-{uuid.uuid4().hex[:12]}"
        submitted = False
        try:
            op = ops.submit(c, keys, op_id=op_id, kind=args.op, engines=engines,
                            params=params, max_unavailable=limit)
            submitted = True
            if not args.json:
                print(f"fleet {op.kind} {op.op_id}: {len(op.engines)} engine(s), at most "
                      f"{op.max_unavailable} out of service at once", file=sys.stderr)
            op, parts = follow(c, keys, op.op_id, progress=not args.json)
        except KeyboardInterrupt:
            # Ctrl-C ends the command, never the operation: say so whenever it comes, even
            # between the submit and the first line of progress
            if submitted:
                print(f"ckptctl: interrupted; fleet operation {op_id} goes on (follow it with "
                      f"the same --op-id, or see ckptctl fleet status)", file=sys.stderr)
            else:
                print(f"ckptctl: interrupted while submitting; fleet operation {op_id} may be "
                      f"recorded and then goes on (run again with --op-id {op_id} to follow "
                      f"it, or see ckptctl fleet status)", file=sys.stderr)
            return 130
        except UnreachableError as err:
            if not submitted:
                raise
            raise UnreachableError(
                f"{err.message}; fleet operation {op_id} stays recorded and goes on when "
                f"etcd is back (follow it with the same --op-id)", op_id=op_id,
                **err.details) from None
    if args.json:
        emit("fleet-operation", op=op, parts=parts)
    else:
        rows = [("ENGINE", "NODE", "PART", "STATE", "ERROR")]
        rows += [(p.engine, p.node, p.status, p.state or "-", p.error or "") for p in parts]
        print(table(rows))
        print(f"fleet {op.kind} {op.op_id}: {op.status}")
    if op.status == "succeeded":
        return 0
    return 4 if any(p.status == "lost" for p in parts) else 1


def follow(c, keys, op_id: str, progress: bool, every_s: float = 0.2, lines: bool = False):
    """Wait for the fleet operation ``op_id`` to end: (its record, its parts); prints each
    part's changes on stderr with ``progress``, or as JSON lines on stdout with ``lines``."""
    from ckpt_controller.fleet import ops

    seen: dict[str, str] = {}
    start = time.monotonic()
    patient = Patient(op_id)
    while True:
        op = patient.read(lambda: ops.read_op(c, keys, op_id))
        if op is None:
            raise UsageError(f"no fleet operation {op_id}", op_id=op_id)
        if not (lines or progress) and op.status == "running":
            time.sleep(every_s)  # nothing to print: the parts are read once, at the end
            continue
        parts = patient.read(lambda: ops.read_parts(c, keys, op_id))
        if lines:
            for name in op.engines:
                part = parts[name][0]
                if seen.get(name) != part.status:
                    seen[name] = part.status
                    emit("fleet-part", op_id=op_id, elapsed_s=round(
                        time.monotonic() - start, 3), part=part, stream=True)
        if progress:
            for name in op.engines:
                part = parts[name][0]
                if seen.get(name) != part.status:
                    seen[name] = part.status
                    more = f" ({part.state})" if part.state else ""
                    why = f": {part.error}" if part.error and part.status != "succeeded" else ""
                    print(f"[{time.monotonic() - start:6.1f}s] {name} on {part.node}: "
                          f"{part.status}{more}{why}", file=sys.stderr, flush=True)
        if op.status != "running":
            return op, [parts[n][0] for n in op.engines]
        time.sleep(every_s)


def _watch(args: argparse.Namespace) -> int:
    from ckpt_controller.fleet.keys import Keys

    from ckpt_controller.fleet import ops

    keys = Keys(args.etcd_prefix)
    with client(args) as c:
        first = ops.read_op(c, keys, args.op_id)
        if first is not None and first.kind == "migrate":  # steps on two nodes, not parts
            try:
                op, mig = _follow_migration(c, keys, args.op_id, progress=not args.json,
                                            lines=args.json)
            except KeyboardInterrupt:
                return 130
            if args.json:
                emit("fleet-migration", op=op, migration=mig)
            else:
                print(f"fleet migrate {op.op_id}: {op.status}: {mig.engine} {mig.outcome}"
                      + (f" ({mig.error})" if mig.error else ""))
            return 0 if mig.outcome == "moved" else 4 if mig.outcome == "lost" else 1
        try:
            op, parts = follow(c, keys, args.op_id, progress=not args.json, lines=args.json)
        except KeyboardInterrupt:
            return 130
    if args.json:
        emit("fleet-operation", op=op, parts=parts)
    else:
        print(f"fleet {op.kind} {op.op_id}: {op.status}" + (f": {op.error}" if op.error else ""))
    if op.status == "succeeded":
        return 0
    return 4 if any(p.status == "lost" for p in parts) else 1
