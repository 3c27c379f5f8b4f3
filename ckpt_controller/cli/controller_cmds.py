"""``ckptctl serve`` and the operator commands that talk to a controller:
``status``, ``prepare``, ``capture``, ``restore``, ``cycle``, ``rollback``, ``history``, ``watch``.

The controller, its client and the protocol load when a command runs, not for ``--help``.
Neighbours: ``cli.common``, ``controller.client``, ``controller.server``, ``controller.service``
(``exit_code``).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from typing import TYPE_CHECKING

from ckpt_controller import values
from ckpt_controller.cli.common import (
    EXIT_CODES,
    LIMIT_HELP,
    STATUS_COLUMNS,
    WIDE_COLUMNS,
    age,
    arg_type,
    controller_client,
    duration,
    add_accept_arg,
    goes_on_if_interrupted,
    human_bytes,
    op_id,
    operation_params,
    prepare_opts,
    status_row,
    table,
    waiting_notice,
)
from ckpt_controller.cli.logsetup import add_log_args, setup_from_args
from ckpt_controller.cli.progress import Progress, describe_hook
from ckpt_controller.cli.output import emit, iso
from ckpt_controller.errors import CkptError, UsageError
from ckpt_controller.vocab import CheckpointState, OperationKind

if TYPE_CHECKING:
    from ckpt_controller import protocol as p

#: one subcommand per operation kind, in this order
OPS = tuple(OperationKind)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    fmt = {"epilog": EXIT_CODES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    sp = sub.add_parser("serve", help="run the controller service", **fmt)
    sp.add_argument("--config", required=True, metavar="FILE", help="TOML configuration")
    sp.add_argument("--check", action="store_true",
                    help="check the configuration and what it names (directories, hooks, "
                         "endpoint, keys), say what was found, and exit without starting "
                         "(0: good; 2: what to fix), as `nginx -t`")
    add_log_args(sp)
    sp.set_defaults(run=_serve)

    def engines(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("engines", nargs="*", metavar="ENGINE", help="engine names")
        sp.add_argument("--all", action="store_true", help="every configured engine")
        sp.add_argument("--op-id", type=op_id,
                        help="operation id (1-128 letters, digits, '.', '_', '-'); repeating "
                             "it returns the first result")
        sp.add_argument("--deadline", type=duration, metavar="S",
                        help="overall deadline per engine, at most a day (default: the "
                             "configured one)")
        sp.add_argument("--json", action="store_true", help="print one JSON document")

    texts = {OperationKind.PREPARE: "drain and release engines (-> PREPARED); all-or-nothing "
                                    "for groups",
             OperationKind.CAPTURE: "run the dump hooks on PREPARED engines",
             OperationKind.RESTORE: "re-wake PREPARED (or FAILED) engines (-> RUNNING)",
             OperationKind.CYCLE: "prepare, capture and restore, rolling across engines",
             OperationKind.ROLLBACK: "return PREPARED engines to RUNNING"}
    for op in OPS:
        sp = sub.add_parser(op, help=texts[op], **fmt)
        engines(sp)
        sp.set_defaults(run=_operation, op=op)
        if op in (OperationKind.PREPARE, OperationKind.CYCLE):
            prepare_opts(sp)
        if op == OperationKind.PREPARE:
            sp.add_argument("--no-all-or-nothing", action="store_true",
                            help="keep the engines that prepared even if another failed")
        if op == OperationKind.CYCLE:
            sp.add_argument("--max-unavailable", type=arg_type(values.MAX_UNAVAILABLE),
                            metavar="N|P%", help=MAX_UNAVAILABLE_HELP)
        if op == OperationKind.ROLLBACK:
            sp.add_argument("--reason", default="", help="recorded with the transition")
        if op == OperationKind.RESTORE:
            sp.add_argument("--image", metavar="OP_ID", type=op_id,
                            help="restore the image operation OP_ID dumped (default: the one of "
                                 "the engine's generation; an older one must be named here)")
            add_accept_arg(sp, "this host")

    sp = sub.add_parser(
        "status", help="each engine's state as its agent reports it, as a table",
        description="One row per engine, as `fleet status` prints them:\n"
                    "  NAME       the engine\n"
                    "  STATE      the agent's state; UNREACHABLE when it did not answer, MOVED\n"
                    "             when the controller gave it away to another node\n"
                    "  GEN        its generation (restores so far)\n"
                    "  IN-FLIGHT  requests it is serving\n"
                    "  PID        the engine's process id, as the host sees it\n"
                    "  HELD-BY    the operation holding it now, or -\n"
                    "  LAST-OP    the newest operation on it in the journal\n"
                    "  AGE        time since its last transition (5s, 3m12s, 2h4m, 4d1h)\n"
                    "-o wide adds KIND, KEPT (requests frozen), ENDPOINT (its agent), REGISTERED\n"
                    "(memory), RELEASED (tags released), IMAGE (restored from an image, and how\n"
                    "many times), IMAGES (the disk its images take) and ERROR (why it did not\n"
                    "answer, or is FAILED). A line under the table explains each UNREACHABLE,\n"
                    "FAILED, MOVED or unsettled engine. -o name prints the names alone, -o json\n"
                    "(or --json) the status reply; -w prints the table again at each change.",
        **fmt)
    sp.add_argument("engines", nargs="*", metavar="ENGINE", help="engine names (default: all)")
    sp.add_argument("-o", "--output", choices=["wide", "json", "name"],
                    help="wide: more columns (see above); json: as --json; name: one engine "
                         "name per line")
    sp.add_argument("--json", action="store_true",
                    help="print one JSON document (the status reply)")
    sp.add_argument("-w", "--watch", action="store_true",
                    help="keep watching: the table again (a JSON line with --json) each time "
                         "an engine's row changes, until Ctrl-C")
    sp.add_argument("--interval", type=duration, metavar="S", default=2.0,
                    help="with --watch: ask this often (default 2 s)")
    sp.set_defaults(run=_status)

    sp = sub.add_parser("history", help="operations and journal records", **fmt)
    sp.add_argument("--engine", metavar="NAME", help="only this engine's operations and records")
    sp.add_argument("--op-id", metavar="OP_ID", help="only this operation, with its records")
    sp.add_argument("--limit", type=_history_limit, default=20, metavar="N",
                    help="the newest N operations (default 20)")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.set_defaults(run=_history)

    sp = sub.add_parser("watch", help="print journal records live", **fmt)
    sp.add_argument("--duration", type=duration, metavar="S",
                    help="stop after S seconds (default: until interrupted, or the controller "
                         "is lost: exit 4)")
    sp.add_argument("--json", action="store_true", help="one JSON line per record")
    sp.set_defaults(run=_watch)


def _history_limit(text: str) -> int:
    """``history --limit``: 1 to the protocol's ``MAX_HISTORY_LIMIT`` (the protocol is
    imported only when the flag is given)."""
    from ckpt_controller import protocol as p

    return arg_type(values.count(1, p.MAX_HISTORY_LIMIT))(text)


_history_limit.__name__ = "count"  # argparse's fallback message names the type


# ---------------------------------------------------------------- serve


def _serve(args: argparse.Namespace) -> int:
    from ckpt_controller.controller.config import load_config
    from ckpt_controller.serve import serve
    from ckpt_controller.sdnotify import Notifier

    notifier = Notifier.from_env()  # taken out of the environment: hooks do not inherit it
    config = load_config(args.config)
    if args.check:
        from ckpt_controller.controller.statedir import check

        seen = check(config)
        print(f"{args.config}: ok: {len(config.engines)} engine(s)"
              + (f", fleet node {config.fleet.node}" if config.fleet else "")
              + "".join(f"\n  {line}" for line in seen))
        return 0
    setup_from_args(args)
    try:
        serve(config, ready=lambda info: print(json.dumps(info), flush=True),
              notifier=notifier)
    except CkptError as err:
        raise _at_start(config, err) from None
    return 0


def _at_start(config, err: CkptError) -> CkptError:
    """A socket the running system would not let the controller bind, as the config value
    to change: the file and key named, exit 2."""
    from ckpt_controller.controller.config import key_error

    if err.details.get("file") is not None:  # named already (the state dir's checks)
        return err
    if err.details.get("endpoint") == config.endpoint and err.message.startswith("cannot bind"):
        return key_error(config, "controller.endpoint", err.message)
    if err.message.startswith("cannot serve metrics"):
        taken = "in use" in str(err.details.get("problem", ""))
        return key_error(config, "controller.metrics_port" if taken else
                         "controller.metrics_host", err.message)
    return err


# ---------------------------------------------------------------- operations


#: ``--max-unavailable``'s help of the node-local cycle
MAX_UNAVAILABLE_HELP = (f"at most N engines (or P percent of them, rounded down, at least one) "
                        f"out of service at once (default: "
                        f"{LIMIT_HELP}; 100%%: all at once)")


def _operation(args: argparse.Namespace) -> int:
    from ckpt_controller.controller.exit_codes import exit_code

    if bool(args.engines) == bool(args.all):
        raise UsageError("name the engines, or give --all (not both)")
    params = operation_params(args)
    if args.op == OperationKind.CYCLE and args.max_unavailable is not None:
        limit = args.max_unavailable
        params["max_unavailable_percent" if limit.percent else "max_unavailable"] = limit.value
    from ckpt_controller.rpc import new_op_id

    op_id = args.op_id or new_op_id()  # known here, so that Ctrl-C can name it
    progress = None if args.json else Progress()
    on_event = None if progress is None else (lambda ev: show_event(progress, ev))
    with controller_client(args, on_event=on_event) as c:
        c.subscribe()  # heartbeats bound the wait: a dead controller is noticed, not waited out
        try:
            with goes_on_if_interrupted(op_id, "controller", f"ckptctl history --op-id {op_id}"):
                result = c.operation(args.op, args.engines or None, all_engines=args.all,
                                     op_id=op_id, **params)
        finally:
            if progress is not None:
                progress.finish()
    if args.json:
        emit("operation", result)
    else:
        print(describe_result(result))
    return exit_code(result)


def show_event(progress: Progress, ev: p.EventBody) -> None:
    """A controller's event as progress: its journal records; heartbeats refresh the time
    of what is running."""
    from ckpt_controller import protocol as p

    if isinstance(ev, p.Heartbeat):
        progress.refresh()
        return
    if not isinstance(ev, p.Journaled):
        return
    r = ev.record
    d, who = r.data, r.engine or "-"
    if r.type == "drain_progress":
        progress.drain(who, d["in_flight"], d["completed"], d["aborted"], d.get("deadline_s"))
    elif r.type == "drain":
        progress.drained(who, describe_record(r) or "")
    elif r.type == "hook_start":
        progress.hook_started(who, d["point"], list(d.get("hooks", [])), d.get("timeout_s"))
    elif r.type == "hook":
        progress.hook_ended(who, d)
    else:
        line = describe_record(r)
        if line:
            progress.line(line)


def describe_record(r: p.JournalRecord) -> str | None:
    """One journal record as a line a person reads (``None`` for those not shown); never
    raw JSON."""
    d, who = r.data, r.engine or "-"
    if r.type == "transition":
        return f"{who}: {d['source']} -> {d['dest']}"
    if r.type == "phase":
        return f"{who}: {d['name']} {'done' if d['ok'] else 'FAILED'} in {d['duration_s']:.3f}s"
    if r.type == "drain_progress":
        return (f"{who}: draining, {d['in_flight']} in flight left, {d['completed']} "
                "completed")
    if r.type == "drain":
        esc = f", escalated to {d['escalated_to']}" if d.get("escalated_to") else ""
        return (f"{who}: drain {d['mode']} done: {d['completed']} completed, {d['aborted']} "
                f"aborted, {d['kept']} kept in {d['drain_s']:.3f}s{esc}")
    if r.type == "hook_start":
        return f"{who}: hook {d['point']} {', '.join(d.get('hooks', []))} started"
    if r.type == "hook":
        return describe_hook(who, d)
    if r.type == "error":
        return f"{who}: {d['kind']}: {d['message']}"
    if r.type == "operation_start":
        return (f"{r.op_id}: {d.get('kind', 'operation')} started on "
                f"{', '.join(d.get('engines', [])) or 'no engine'}")
    if r.type == "operation_end":
        took = f" in {d['duration_s']:.3f}s" if d.get("duration_s") is not None else ""
        return f"{r.op_id}: ended {d.get('status')}{took}"
    if r.type == "reconciled":
        by = f" (operation {d['by']})" if d.get("by") else ""
        return f"{who}: reconciled: found {d.get('found')}, now {d.get('now')}{by}"
    return None


def describe_result(r: p.OperationResult) -> str:
    lines = [f"{r.kind} {r.op_id}: {r.status} in {r.duration_s:.3f}s"]
    if r.max_unavailable_seen and r.kind == OperationKind.CYCLE:
        lines[0] += f" (at most {r.max_unavailable_seen} out of service at once)"
    for o in r.engines:
        phases = ", ".join(f"{ph.name} {ph.duration_s * 1000:.1f}ms" for ph in o.phases
                           if ph.duration_s >= 0.0005 or not ph.ok)
        lines.append(f"  {o.engine}: {o.status}, now {o.state or 'unknown'}"
                     + (f" [{phases}]" if phases else ""))
        if o.drain:
            dr = o.drain
            lines.append(f"    drain {dr.mode}: {dr.completed} completed, {dr.aborted} aborted, "
                         f"{dr.kept} kept in {dr.drain_s:.3f}s")
            if dr.escalated_to:  # the operator asked to wait: say plainly that it did not
                lines.append(f"    the {dr.mode} drain reached its deadline and escalated to "
                             f"{dr.escalated_to}: {dr.aborted} aborted, {dr.kept} kept of "
                             f"{dr.in_flight_at_start} in flight")
        if o.released:
            lines.append(f"    released {human_bytes(o.released.tensor_bytes)} "
                         f"(freed {human_bytes(o.released.freed_bytes)})")
        image = _image_line(r.kind, o)
        if image:
            lines.append(f"    {image}")
        if o.error:
            lines.append(f"    {o.error.kind}: {o.error.message}")
        for run in o.hooks:
            if run.timed_out or run.exit_code != 0:
                import msgspec

                text = describe_hook("", msgspec.to_builtins(run))
                lines.append("    " + text.replace("\n", "\n    "))
    if r.error and not r.engines:
        lines.append(f"  {r.error.kind}: {r.error.message}")
    return "\n".join(lines)


def _image_line(kind: str, o: p.EngineOutcome) -> str | None:
    """What a capture made and what a restore restored (the image's operation id)."""
    if o.dumped is False:
        return "no dump hook ran: nothing was captured"
    if o.image is None:
        return None
    if kind == OperationKind.CAPTURE:
        return f"captured image {o.image}"
    if kind == OperationKind.RESTORE:
        return f"restored image {o.image}"
    if kind == OperationKind.CYCLE:
        return f"captured and restored image {o.image}"
    return None


# ---------------------------------------------------------------- status, history, watch


#: seconds ``status`` waits before it says the controller has not answered: the controller
#: asks every engine first, each at most ``[deadlines] probe`` (2 s), so a silent engine
#: alone must not read as a silent controller (the engine's row says it did not answer)
STATUS_NOTICE_S = 5.0


def _status(args: argparse.Namespace) -> int:
    with controller_client(args, on_wait=waiting_notice,
                           notice_after_s=STATUS_NOTICE_S) as c:
        if args.watch:
            return _watch_status(args, c)
        reply = c.status(args.engines)
        # the same exit code for the table and --json: 4 when an engine did not answer
        code = 0 if all(v.reachable or v.moved_to for v in reply.engines) else 4
        if args.json:
            emit("status", reply)
            return code
        if args.output == "name":
            print("\n".join(v.engine for v in reply.engines))
            return code
        last = None
        if not reply.last_ops:  # a controller older than ``EngineView.last_op``: ask each
            last = {v.engine: _last_op(c, v.engine) for v in reply.engines
                    if v.moved_to is None}
    print(status_table(reply, last, wide=args.output == "wide"))
    return code


def _watch_status(args: argparse.Namespace, c) -> int:
    """``status -w``: the table (or a JSON line), then again, under the time it changed,
    each time something but the ages changed; Ctrl-C ends it (exit 0)."""
    seen = None
    try:
        while True:
            reply = c.status(args.engines)
            # the table at a fixed "now": its ages stay put unless a transition moved them
            rows = status_table(reply, wide=args.output == "wide", now=0.0)
            if rows != seen:
                if args.json:
                    emit("status", reply, stream=True)
                else:
                    if seen is not None:
                        print(f"\n{iso(time.time())}")
                    print(status_table(reply, wide=args.output == "wide"), flush=True)
                seen = rows
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _last_op(c, engine: str) -> str | None:
    """The newest operation on ``engine`` in the controller's journal, asked on its own
    (only of a controller whose status reply does not carry it)."""
    ops = c.history(engine=engine, limit=1).operations
    return ops[0].op_id if ops else None


def status_table(reply: p.ControllerStatusReply, last_ops: dict[str, str | None] | None = None,
                 wide: bool = False, now: float | None = None) -> str:
    """``ckptctl status``'s table, then a line for each engine whose row needs one: why it
    is unreachable or FAILED, where it moved, which operation left it unsettled. LAST-OP is
    each view's ``last_op``, or ``last_ops[engine]`` when given (asked of an older
    controller)."""
    now = time.time() if now is None else now
    if last_ops is None:
        last_ops = {v.engine: v.last_op.op_id for v in reply.engines if v.last_op is not None}
    rows = [STATUS_COLUMNS + (WIDE_COLUMNS if wide else ())]
    notes = []
    for v in reply.engines:
        if v.moved_to is not None:
            rows.append(status_row(v.engine, None, now=now, state="MOVED", last_op=v.moved_by,
                                   kind=v.kind, endpoint=v.control,
                                   error=f"on node {v.moved_to}", wide=wide))
            notes.append(f"{v.engine}: MOVED to node {v.moved_to} by operation {v.moved_by} "
                         "(not driven here)")
            continue
        why = v.error.message if v.error else "no answer"
        failed = failed_reason(v.status, now, last_ops.get(v.engine))
        rows.append(status_row(v.engine, v.status, now=now, holder=v.holder,
                               last_op=last_ops.get(v.engine), kind=v.kind, endpoint=v.control,
                               error=why if v.status is None else (failed or ""),
                               images=v.images_bytes, wide=wide))
        if v.status is None:
            notes.append(f"{v.engine}: UNREACHABLE ({why})")
        elif failed:
            notes.append(f"{v.engine}: {failed} (`ckptctl describe {v.engine}`; `ckptctl "
                         f"restore {v.engine}` recovers it)")
        if v.unsettled_by:
            notes.append(f"{v.engine}: unsettled since operation {v.unsettled_by} lost contact "
                         "(the reconciler settles it)")
    return table(rows) + ("\n\n" + "\n".join(notes) if notes else "")


def failed_reason(status: p.StatusReply | None, now: float, op: str | None = None) -> str | None:
    """Why a FAILED engine is: since when, in which operation (``op``, its newest), and its
    transition's reason; None for an engine in any other state."""
    if status is None or status.state != CheckpointState.FAILED:
        return None
    t = status.last_transition
    by = f" in operation {op}" if op else ""
    if t is None:  # found FAILED at its start (e.g. a sidecar beside a paused vLLM)
        return f"FAILED{by} (no transition recorded)"
    return f"FAILED {age(now - t.wall)} ago ({iso(t.wall)}){by}: {t.reason or t.trigger}"


def _history(args: argparse.Namespace) -> int:
    with controller_client(args, on_wait=waiting_notice) as c:
        reply = c.history(engine=args.engine, op_id=args.op_id, limit=args.limit)
    if args.json:
        emit("history", reply)
        return 0
    for op in reply.operations:
        when = datetime.fromtimestamp(op.wall).isoformat(timespec="seconds")
        took = f" in {op.duration_s:.3f}s" if op.duration_s is not None else ""
        print(f"{when} {op.op_id} {op.kind} {','.join(op.engines)}: {op.status}{took}")
    if args.op_id or args.engine:
        for rec in reply.records:
            line = describe_record(rec)
            if line:
                print(f"  {rec.seq:>6} {iso(rec.wall)} {line}")
    return 0


def _watch(args: argparse.Namespace) -> int:
    from ckpt_controller import protocol as p

    with controller_client(args) as c:
        c.subscribe()
        end = None if args.duration is None else time.monotonic() + args.duration
        while end is None or time.monotonic() < end:
            left = 0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))
            for ev in c.poll_events(left):
                if not isinstance(ev, p.Journaled):
                    continue
                if args.json:
                    emit("record", ev.record, stream=True)
                else:
                    line = describe_record(ev.record)
                    if line:
                        print(f"{iso(ev.record.wall)} {line}", flush=True)
            if not c.follows_heartbeats:  # else poll_events says when the controller is lost
                c.heartbeat()  # UnreachableError when the controller is gone
    return 0
