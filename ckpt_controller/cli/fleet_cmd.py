"""``ckptctl fleet ...``: the fleet in etcd, read and driven across node controllers.

``fleet status`` shows every node and engine; one subcommand per row of the table of fleet
kinds (``fleet.kinds.KINDS``: its help and its options) records an operation in etcd and
follows it (``cli.fleet_follow``); ``fleet watch`` follows one from anywhere.

``--etcd URL[,URL...]`` (default ``$CKPT_ETCD``) names etcd's members; ``--etcd-ca``,
``--etcd-cert`` and ``--etcd-key`` (``$CKPT_ETCD_CA``, ``$CKPT_ETCD_CERT``,
``$CKPT_ETCD_KEY``) give TLS, ``--etcd-prefix`` (``$CKPT_ETCD_PREFIX``, default ``/ckpt``) the
keys' prefix, as the node controllers' ``[fleet]`` tables do. etcd unavailable: exit 4 at once
(each member is given ``CLI_TIMEOUT_S``). Neighbours: ``fleet.kinds`` (the table),
``fleet.drivers`` (submitting), ``fleet.registry`` (the view), ``cli.fleet_follow``,
``cli.common``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ckpt_controller import values
from ckpt_controller.cli.common import (
    EXIT_CODES,
    LIMIT_HELP,
    add_accept_arg,
    age,
    arg_type,
    operation_params,
    prepare_opts,
    table,
)
from ckpt_controller.cli.fleet_follow import (
    engine_now,
    follow,
    follow_migration,
    migration_exit_code,
    migration_summary,
    parts_exit_code,
)
from ckpt_controller.cli.output import emit
from ckpt_controller.errors import UnreachableError, UsageError
from ckpt_controller.fleet.kinds import KINDS, Drive, Option
from ckpt_controller.vocab import PartStatus

#: how long the command waits for one etcd member (healthy, etcd answers in milliseconds)
CLI_TIMEOUT_S = 1.5

EPILOG = """\
The fleet's node controllers register in etcd when their TOML has a [fleet] table
(docs/fleet.md); this command reads what they published. STATE is the agent's state as its
node last saw it; UNREACHABLE when the node could not reach the agent, and NODE-DOWN (with
the last state known) when the node controller itself is gone (its lease expired). AGE is the
time since the engine entered its state.

""" + EXIT_CODES + """
  (fleet status: 4 also when etcd is unavailable, or an engine is unreachable or its node down)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    fmt = {"epilog": EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
    sp = sub.add_parser("fleet", help="the fleet of node controllers, through etcd", **fmt)
    fsub = sp.add_subparsers(dest="fleet_command", metavar="COMMAND", required=True)
    st = fsub.add_parser("status", help="every node and engine in one table", **fmt)
    st.add_argument("--json", action="store_true",
                    help="one JSON document (docs/fleet.md gives its shape)")
    st.set_defaults(run=_status)
    g = fsub.add_parser(
        "gc", help="forget ended fleet operations older than --keep-days",
        description="Delete from etcd every fleet operation that ended more than --keep-days "
                    "ago, with its parts, migration record and steps (the coordinator does "
                    "this every hour with its [fleet] keep_days). Never a running one, one "
                    "that `unavailable`, a lock or moving/ names, nor an engine's newest "
                    "migration.", **fmt)
    g.add_argument("--keep-days", type=_keep_days, default=7.0, metavar="D",
                   help="keep what ended in the last D days (default 7, as [fleet] keep_days)")
    g.add_argument("--json", action="store_true", help="print one JSON document")
    g.set_defaults(run=_gc)
    fg = fsub.add_parser(
        "forget-node", help="free a node name whose controller and state dir are gone",
        description="A node's name belongs to the controller that first registered it (the "
                    "node id in its state dir, node-ids/NODE in etcd); another controller "
                    "with that name is refused, also while the first is paused past its "
                    "lease. When the first is gone for good (its state dir with it), this "
                    "frees the name: the next controller that registers it owns it. Refused "
                    "while a controller holds the name's registration.", **fmt)
    fg.add_argument("node", metavar="NODE", type=_node_name, help="the node's name")
    fg.add_argument("--json", action="store_true", help="print one JSON document")
    fg.set_defaults(run=_forget_node)
    w = fsub.add_parser("watch", help="follow a fleet operation until it ends", **fmt)
    w.add_argument("op_id", metavar="OP_ID", help="the fleet operation's id")
    w.add_argument("--json", action="store_true",
                   help="JSON lines: one per change of a part or step, then the result")
    _timeout_opt(w)
    w.set_defaults(run=_watch)
    for spec in KINDS.values():  # one subcommand per row of the table of fleet kinds
        kp = fsub.add_parser(spec.kind, help=spec.help, **fmt)
        for option in spec.options:
            OPTIONS[option](kp)
        _common_opts(kp)
        kp.set_defaults(run=RUNS[spec.drive], op=spec.local or spec.kind, kind=spec.kind)


def _common_opts(sp: argparse.ArgumentParser) -> None:
    from ckpt_controller.cli.common import arg_type
    from ckpt_controller.values import DURATION, OP_ID

    sp.add_argument("--op-id", type=arg_type(OP_ID),
                    help="operation id (1-128 letters, digits, '.', '_', '-'); repeating it "
                         "follows the first operation and returns its result")
    sp.add_argument("--deadline", type=arg_type(DURATION), metavar="S",
                    help="overall deadline of each node-local operation (default: each "
                         "node's own)")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    _timeout_opt(sp)


def _timeout_opt(sp: argparse.ArgumentParser) -> None:
    from ckpt_controller.cli.common import arg_type
    from ckpt_controller.values import DURATION

    sp.add_argument("--timeout", type=arg_type(DURATION), metavar="S",
                    help="stop following after S seconds (exit 3, saying what it waits on); "
                         "the operation goes on (default: until it ends)")


def _select_opts(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("engines", nargs="*", metavar="ENGINE", help="engine names")
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every engine in the fleet")
    which.add_argument("--selector", metavar="KEY=VALUE", action="append",
                       help="engines whose labels match (repeat: all must match)")


def _one_engine_to_opts(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("engine", metavar="ENGINE", help="the engine's name")
    sp.add_argument("--to", required=True, metavar="NODE", help="the node it moves to")
    add_accept_arg(sp, "the target")



def _max_unavailable_opts(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--max-unavailable", metavar="N|P%", type=arg_type(values.MAX_UNAVAILABLE),
                    help="at most N engines (or P percent of those named, rounded down, at "
                         "least one) out of service at once, fleet-wide, counting those out "
                         f"already (default: {LIMIT_HELP} for a cycle; a "
                         "prepare holds out all it names; 100%%: all at once)")


def _prepare_opts(sp: argparse.ArgumentParser) -> None:
    prepare_opts(sp)


def _drain_opts(sp: argparse.ArgumentParser) -> None:
    from ckpt_controller.cli.common import arg_type, word_arg
    from ckpt_controller.values import DURATION
    from ckpt_controller.vocab import DrainMode, ReleaseLevel

    sp.add_argument("--drain", **word_arg(DrainMode),
                    help="in-flight requests: kept and finished on the target (keep), "
                         "finished first (wait) or ended now (abort); default: the source "
                         "node's")
    sp.add_argument("--drain-timeout", type=arg_type(DURATION), metavar="S",
                    help="how long a wait drain may take (default: the source node's)")
    sp.add_argument("--level", **word_arg(ReleaseLevel),
                    help="what the source releases before the dump: 0 nothing (the weights "
                         "and KV cache go with the image), 1 the KV cache (weights offloaded "
                         "to host memory, in the image), 2 both (the target re-wakes the "
                         "weights from the model's file, which it must read byte for byte "
                         "the same: checked before the dump); default: the source node's")


def _reason_opts(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--reason", default="", help="recorded with the transition")


def _image_opts(sp: argparse.ArgumentParser) -> None:
    from ckpt_controller.cli.common import arg_type
    from ckpt_controller.values import OP_ID

    sp.add_argument("--image", metavar="OP_ID", type=arg_type(OP_ID),
                    help="restore the image this node-local operation id dumped")
    add_accept_arg(sp, "its node")


def _submitted(op_id: str, submit, announce, follow):
    """Submit (``submit()``: the operation), say so (``announce(op)``), then follow
    (``follow()``) to the end; Ctrl-C ends the command, never the operation, and says so
    whenever it comes; etcd gone while following says that the operation stays recorded.
    The follower's result, or an exit status (130)."""
    submitted = False
    try:
        op = submit()
        submitted = True
        announce(op)
        return follow()
    except KeyboardInterrupt:
        if submitted:
            print(f"ckptctl: interrupted; fleet operation {op_id} goes on (follow it with "
                  f"the same --op-id, or see ckptctl fleet status)", file=sys.stderr)
        else:
            print(f"ckptctl: interrupted while submitting; fleet operation {op_id} may be "
                  f"recorded and then goes on (run again with --op-id {op_id} to follow it, "
                  f"or see ckptctl fleet status)", file=sys.stderr)
        return 130
    except UnreachableError as err:
        if not submitted:
            raise
        raise UnreachableError(
            f"{err.message}; fleet operation {op_id} stays recorded and goes on when etcd is "
            f"back (follow it with the same --op-id)", op_id=op_id, **err.details) from None


def _migrate(args: argparse.Namespace) -> int:
    import uuid

    from ckpt_controller.fleet.drivers import SUBMIT
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.kinds import spec

    keys = Keys(args.etcd_prefix)
    kind = spec(args.kind)
    params = {k: v for k, v in (("drain", args.drain), ("drain_timeout_s", args.drain_timeout),
                                ("level", args.level), ("deadline_s", args.deadline))
              if v is not None}
    if args.accept:
        params["accept"] = args.accept
    op_id = args.op_id or f"fleet-{kind.kind}-{uuid.uuid4().hex[:12]}"
    def announce(op) -> None:
        if not args.json:
            print(f"fleet {op.kind} {op.op_id}: {args.engine} to {args.to}", file=sys.stderr)

    with client(args) as c:
        got = _submitted(op_id, lambda: SUBMIT[kind.drive](
            c, keys, kind, op_id=op_id, engine=args.engine, to=args.to, params=params),
            announce, lambda: follow_migration(c, keys, op_id, progress=not args.json,
                                               timeout_s=args.timeout))
        if isinstance(got, int):
            return got
        op, mig = got
        now = engine_now(c, keys, mig.engine) if not args.json else None
    if args.json:
        emit("fleet-migration", op=op, migration=mig)
    else:
        print(migration_summary(op, mig, now))
    return migration_exit_code(mig)


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


def _operations(c, keys, damaged: dict[str, str]) -> list:
    """Every fleet operation still running, with its parts (a damaged one: in ``damaged``)."""
    from ckpt_controller.errors import DamagedRecordError
    from ckpt_controller.fleet import ops

    out = []
    for op, _ in ops.running(c, keys, damaged):
        try:
            out.append((op, ops.read_parts(c, keys, op.op_id)))
        except DamagedRecordError as err:  # policy: shown as damaged; the others go on
            damaged[err.details.get("key", keys.parts(op.op_id))] = err.message
    return out


def _running_ops(found: list) -> list[dict]:
    return [{"op_id": op.op_id, "kind": op.kind, "total": len(op.engines),
             "done": sum(p.status.ended for p, _ in parts.values()),
             "started": sum(p.status is PartStatus.STARTED for p, _ in parts.values()),
             "created": op.created} for op, parts in found]


def _status(args: argparse.Namespace) -> int:
    from ckpt_controller.fleet import registry
    from ckpt_controller.fleet.keys import Keys

    with client(args) as c:
        view = registry.read(c, Keys(args.etcd_prefix))
        c_ops = _operations(c, Keys(args.etcd_prefix), view.unreadable)
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
    from ckpt_controller.fleet import records

    chosen = bool(args.engines) + bool(args.all) + bool(args.selector)
    if chosen != 1:
        raise UsageError("name the engines, or give --all or --selector (one of them)")
    if args.engines:
        return list(dict.fromkeys(args.engines))
    damaged: dict[str, str] = {}  # an engine whose record is damaged cannot be selected
    found = [rec for rec, _ in records.read_all(client, keys.engines, records.EngineRecord,
                                                damaged)]
    for key, why in damaged.items():
        print(f"ckptctl: unreadable record {key} left out: {why}", file=sys.stderr)
    if args.all:
        names = [rec.engine for rec in found]
    else:
        wanted = {}
        for item in args.selector:
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise UsageError(f"--selector wants KEY=VALUE, got {item!r}")
            wanted[key] = value
        names = [rec.engine for rec in found
                 if all(rec.labels.get(k) == v for k, v in wanted.items())]
    if not names:
        raise UsageError("no engine in the fleet matches", selector=args.selector)
    return sorted(names)


def _operation(args: argparse.Namespace) -> int:
    import uuid

    from ckpt_controller.fleet.drivers import SUBMIT
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.kinds import spec

    keys = Keys(args.etcd_prefix)
    kind = spec(args.kind)
    with client(args) as c:
        engines = _select(args, c, keys)
        limit = None if args.max_unavailable is None else args.max_unavailable.of(len(engines))
        params = {k: v for k, v in operation_params(args).items() if v is not None}
        op_id = args.op_id or f"fleet-{kind.kind}-{uuid.uuid4().hex[:12]}"

        def announce(op) -> None:
            if not args.json:
                print(f"fleet {op.kind} {op.op_id}: {len(op.engines)} engine(s), at most "
                      f"{op.max_unavailable} out of service at once", file=sys.stderr)

        got = _submitted(op_id, lambda: SUBMIT[kind.drive](
            c, keys, kind, op_id=op_id, engines=engines, params=params,
            max_unavailable=limit), announce, lambda: follow(c, keys, op_id,
                                                            progress=not args.json,
                                                            timeout_s=args.timeout))
    if isinstance(got, int):
        return got
    op, parts = got
    if args.json:
        emit("fleet-operation", op=op, parts=parts)
    else:
        rows = [("ENGINE", "NODE", "PART", "STATE", "ERROR")]
        rows += [(p.engine, p.node, p.status, p.state or "-", p.error or "") for p in parts]
        print(table(rows))
        print(f"fleet {op.kind} {op.op_id}: {op.status}")
    return parts_exit_code(op, parts)


def _node_name(text: str) -> str:
    """A node's name, by the rule ``[fleet] node`` follows."""
    from ckpt_controller.endpoints import check_name
    from ckpt_controller.errors import ConfigError

    try:
        return check_name(text)
    except ConfigError:
        raise argparse.ArgumentTypeError("must be 1-64 letters, digits, '.', '_' or '-', "
                                         f"starting with a letter or digit; got {text[:80]!r}"
                                         ) from None


def _keep_days(text: str) -> float:
    """``--keep-days``: a number of days > 0, at most 36500 (as ``[fleet] keep_days``)."""
    try:
        days = float(text)
    except ValueError:
        days = float("nan")
    if not 0 < days <= 36500:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number of days > 0 and at most 36500, "
                                         f"got {text!r}")
    return days


def _gc(args: argparse.Namespace) -> int:
    from ckpt_controller.fleet import gc
    from ckpt_controller.fleet.keys import Keys

    with client(args) as c:
        done = gc.collect(c, Keys(args.etcd_prefix), args.keep_days * 86400.0)
    if args.json:
        emit("fleet-gc", deleted=done.deleted, kept=done.kept, unreadable=done.damaged,
             keep_days=args.keep_days)
        return 0
    print(f"fleet gc: forgot {len(done.deleted)} operations ended over {args.keep_days:g} "
          f"days ago; kept {len(done.kept)} that something still names")
    for op_id, why in sorted(done.kept.items()):
        print(f"  kept {op_id}: {why}")
    for key, why in sorted(done.damaged.items()):
        print(f"  unreadable {key}: {why}", file=sys.stderr)
    return 0


def _forget_node(args: argparse.Namespace) -> int:
    from ckpt_controller.fleet import etcd as e
    from ckpt_controller.fleet.keys import Keys

    k = Keys(args.etcd_prefix)
    with client(args) as c:
        registered = c.get(k.node(args.node))
        if registered is not None:
            raise UsageError(f"node {args.node} is registered now ({k.node(args.node)} lives "
                             "under a controller's lease): stop that controller first; "
                             "forget-node frees only a name no live controller holds",
                             node=args.node)
        held = c.get(k.node_id(args.node))
        forgot = None
        if held is not None:
            ok, _ = c.txn([e.compare_modified(held.key, held.mod_revision)],
                          [e.delete_op(held.key)])
            if not ok:
                raise UsageError(f"node {args.node}'s identity changed meanwhile (a "
                                 "controller registered it): nothing forgotten",
                                 node=args.node)
            forgot = held.value.decode(errors="replace")
    if args.json:
        emit("fleet-forget-node", node=args.node, forgot=forgot)
        return 0
    if forgot is None:
        print(f"node {args.node}: no identity recorded; its name is free already")
    else:
        print(f"node {args.node}: forgot node id {forgot}; the next controller that "
              "registers this name owns it")
    return 0


def _watch(args: argparse.Namespace) -> int:
    from ckpt_controller.fleet import ops
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.kinds import Drive, spec

    keys = Keys(args.etcd_prefix)
    with client(args) as c:
        first = ops.read_op(c, keys, args.op_id)
        steps = first is not None and spec(first.kind).drive is Drive.STEPS
        try:
            if steps:  # steps on two nodes, not parts
                op, mig = follow_migration(c, keys, args.op_id, progress=not args.json,
                                           lines=args.json, timeout_s=args.timeout)
            else:
                op, parts = follow(c, keys, args.op_id, progress=not args.json,
                                   lines=args.json, timeout_s=args.timeout)
        except KeyboardInterrupt:
            return 130
        now = engine_now(c, keys, mig.engine) if steps and not args.json else None
    if steps:
        if args.json:
            emit("fleet-migration", op=op, migration=mig)
        else:
            print(migration_summary(op, mig, now))
        return migration_exit_code(mig)
    if args.json:
        emit("fleet-operation", op=op, parts=parts)
    else:
        print(f"fleet {op.kind} {op.op_id}: {op.status}" + (f": {op.error}" if op.error else ""))
    return parts_exit_code(op, parts)


#: how each option of the table of fleet kinds (``fleet.kinds.Option``) is added
OPTIONS = {
    Option.SELECT: _select_opts, Option.ONE_ENGINE_TO: _one_engine_to_opts,
    Option.MAX_UNAVAILABLE: _max_unavailable_opts, Option.PREPARE: _prepare_opts,
    Option.DRAIN: _drain_opts, Option.REASON: _reason_opts, Option.IMAGE: _image_opts,
}
#: how each way a fleet kind runs (``fleet.kinds.Drive``) is submitted and followed here
RUNS = {Drive.PARTS: _operation, Drive.STEPS: _migrate}
