"""``ckptctl serve`` and the operator commands that talk to a controller:
``status``, ``prepare``, ``capture``, ``restore``, ``cycle``, ``rollback``, ``history``, ``watch``.

The controller, its client and the protocol load when a command runs, not for ``--help``.
Neighbours: ``cli.common``, ``controller.client``, ``controller.server``, ``controller.service``
(``exit_code``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING

from ckpt_controller import values
from ckpt_controller.cli.common import (
    EXIT_CODES,
    arg_type,
    count,
    curve_client,
    duration,
    human_bytes,
    op_id,
    parse_bytes,
    word_arg,
)
from ckpt_controller.cli.output import emit
from ckpt_controller.errors import CkptError, UsageError
from ckpt_controller.vocab import DrainMode, Escalation, OperationKind, ReleaseLevel

if TYPE_CHECKING:
    from ckpt_controller import protocol as p

#: one subcommand per operation kind, in this order
OPS = tuple(OperationKind)


def prepare_opts(sp: argparse.ArgumentParser) -> None:
    """The prepare parameters (``prepare``, ``cycle``, and their ``fleet`` twins)."""
    sp.add_argument("--drain", **word_arg(DrainMode),
                    help="wait | abort | keep (default: configured, else wait)")
    sp.add_argument("--drain-timeout", type=duration, metavar="S")
    sp.add_argument("--on-deadline", **word_arg(Escalation))
    what = sp.add_mutually_exclusive_group()
    what.add_argument("--level", **word_arg(ReleaseLevel))
    what.add_argument("--tags", metavar="TAG,...")
    sp.add_argument("--budget", type=parse_bytes, metavar="SIZE",
                    help="largest residual memory allowed after release")


def operation_params(args: argparse.Namespace) -> dict:
    """An operation's parameters from its flags (``OperationCommand`` fields)."""
    params: dict = {"deadline_s": args.deadline}
    if args.op in (OperationKind.PREPARE, OperationKind.CYCLE):
        tags = [t for t in args.tags.split(",") if t] if args.tags else None
        params.update(drain=args.drain, drain_timeout_s=args.drain_timeout,
                      on_deadline=args.on_deadline, level=args.level, tags=tags,
                      residual_budget_bytes=args.budget)
    if args.op == OperationKind.PREPARE and hasattr(args, "no_all_or_nothing"):
        params["all_or_nothing"] = not args.no_all_or_nothing
    if args.op == OperationKind.ROLLBACK:
        params["reason"] = args.reason
    if args.op == OperationKind.RESTORE:
        params["image"] = args.image
    return params


def add_parsers(sub: argparse._SubParsersAction) -> None:
    fmt = {"epilog": EXIT_CODES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    sp = sub.add_parser("serve", help="run the controller service", **fmt)
    sp.add_argument("--config", required=True, metavar="FILE", help="TOML configuration")
    sp.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
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
            sp.add_argument("--max-unavailable", type=count, metavar="N",
                            help="at most N engines out of service at once (default: all)")
        if op == OperationKind.ROLLBACK:
            sp.add_argument("--reason", default="", help="recorded with the transition")
        if op == OperationKind.RESTORE:
            sp.add_argument("--image", metavar="OP_ID", type=op_id,
                            help="restore the image operation OP_ID dumped (default: the one of "
                                 "the engine's generation; an older one must be named here)")

    sp = sub.add_parser("status", help="each engine's state as its agent reports it", **fmt)
    sp.add_argument("engines", nargs="*", metavar="ENGINE", help="default: all")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(run=_status)

    sp = sub.add_parser("history", help="operations and journal records", **fmt)
    sp.add_argument("--engine")
    sp.add_argument("--op-id")
    sp.add_argument("--limit", type=_history_limit, default=20)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(run=_history)

    sp = sub.add_parser("watch", help="print journal records live", **fmt)
    sp.add_argument("--duration", type=duration, metavar="S",
                    help="default: until interrupted or the controller is lost (exit 4)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(run=_watch)


def _history_limit(text: str) -> int:
    """``history --limit``: 1 to the protocol's ``MAX_HISTORY_LIMIT`` (the protocol is
    imported only when the flag is given)."""
    from ckpt_controller import protocol as p

    return arg_type(values.count(1, p.MAX_HISTORY_LIMIT))(text)


_history_limit.__name__ = "count"  # argparse's fallback message names the type


def _client(args: argparse.Namespace, **kw):
    from ckpt_controller.controller.client import ControllerClient

    return ControllerClient(args.controller, curve=curve_client(args), **kw)


# ---------------------------------------------------------------- serve


def _serve(args: argparse.Namespace) -> int:
    import logging

    from ckpt_controller.controller.config import load_config
    from ckpt_controller.controller.server import serve

    config = load_config(args.config)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(config, ready=lambda info: print(json.dumps(info), flush=True))
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


def _operation(args: argparse.Namespace) -> int:
    from ckpt_controller.controller.exit_codes import exit_code

    if bool(args.engines) == bool(args.all):
        raise UsageError("name the engines, or give --all (not both)")
    params = operation_params(args)
    if args.op == OperationKind.CYCLE:
        params["max_unavailable"] = args.max_unavailable
    progress = sys.stderr.isatty() and not args.json
    with _client(args, on_event=_print_progress if progress else None) as c:
        c.subscribe()  # heartbeats bound the wait: a dead controller is noticed, not waited out
        result = c.operation(args.op, args.engines, op_id=args.op_id, **params)
    if args.json:
        emit("operation", result)
    else:
        print(describe_result(result))
    return exit_code(result)


def _print_progress(ev: p.EventBody) -> None:
    from ckpt_controller import protocol as p

    if isinstance(ev, p.Journaled):
        line = describe_record(ev.record)
        if line:
            print(line, file=sys.stderr, flush=True)


def describe_record(r: p.JournalRecord) -> str | None:
    d, who = r.data, r.engine or "-"
    if r.type == "transition":
        return f"{who}: {d['source']} -> {d['dest']}"
    if r.type == "phase":
        return f"{who}: {d['name']} {'done' if d['ok'] else 'FAILED'} in {d['duration_s']:.3f}s"
    if r.type == "drain_progress":
        return f"{who}: draining, {d['in_flight']} in flight, {d['completed']} completed"
    if r.type == "hook":
        return f"{who}: hook {d['point']} {d['path']} exit {d['exit_code']}"
    if r.type == "error":
        return f"{who}: {d['kind']}: {d['message']}"
    if r.type in ("operation_start", "operation_end", "reconciled"):
        return f"{r.op_id}: {r.type.replace('_', ' ')} {json.dumps(d)}"
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
        if o.released:
            lines.append(f"    released {human_bytes(o.released.tensor_bytes)} "
                         f"(freed {human_bytes(o.released.freed_bytes)})")
        image = _image_line(r.kind, o)
        if image:
            lines.append(f"    {image}")
        if o.error:
            lines.append(f"    {o.error.kind}: {o.error.message}")
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


def _status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        reply = c.status(args.engines)
    if args.json:
        emit("status", reply)
        return 0
    for v in reply.engines:
        if v.moved_to is not None:
            print(f"{v.engine}: MOVED to node {v.moved_to} by operation {v.moved_by} "
                  "(not driven here)")
            continue
        unsettled = (f"; unsettled since operation {v.unsettled_by} lost contact"
                     if v.unsettled_by else "")
        if v.status is None:
            why = v.error.message if v.error else "no answer"
            print(f"{v.engine}: UNREACHABLE ({why}){unsettled}")
            continue
        s = v.status
        held = (f", held by {v.holder}" if v.holder else "") + unsettled
        print(f"{v.engine}: {s.state}, generation {s.generation}, in flight {s.in_flight}, "
              f"kept {s.kept}{held}")
    return 0 if all(v.reachable or v.moved_to for v in reply.engines) else 4


def _history(args: argparse.Namespace) -> int:
    with _client(args) as c:
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
                print(f"  {rec.seq:>6} {line}")
    return 0


def _watch(args: argparse.Namespace) -> int:
    from ckpt_controller import protocol as p

    with _client(args) as c:
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
                        print(line, flush=True)
            if not c.follows_heartbeats:  # else poll_events says when the controller is lost
                c.heartbeat()  # UnreachableError when the controller is gone
    return 0
