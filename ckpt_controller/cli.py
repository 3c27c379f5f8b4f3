"""``ckptctl``: the command line. Human output by default, ``--json`` for scripts.

Exit codes (also in ``ckptctl --help``): 0 success; 1 operation failed or rolled back;
2 usage or configuration error; 3 deadline passed; 4 unreachable. They come from
``CkptError.exit_code``. This module only parses, calls a client and prints: the work is
done by ``agent`` (and, later, the controller). Neighbours: ``agent.client``, ``errors``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence

import msgspec

from ckpt_controller import __version__
from ckpt_controller import protocol as p
from ckpt_controller.errors import CkptError, UsageError

EXIT_CODES = """exit codes:
  0  success
  1  operation failed or was rolled back (or the engine refused a request)
  2  usage or configuration error
  3  a deadline passed
  4  the agent or controller is unreachable"""

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912; plain integers are bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _positive(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptctl",
        description="Drive LLM inference engines through checkpoint/restore: "
                    "RUNNING -> PREPARING -> PREPARED -> RESTORING -> RUNNING.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ckptctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    agent = sub.add_parser("agent", help="talk to one engine's agent directly (no controller)",
                           epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    asub = agent.add_subparsers(dest="agent_command", metavar="ACTION", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--control", required=True, metavar="ENDPOINT",
                        help="the agent's control endpoint (ipc://PATH or tcp://HOST:PORT)")
        sp.add_argument("--json", action="store_true", help="print one JSON document")
        sp.add_argument("--timeout", type=_positive, default=5.0, metavar="S",
                        help="seconds to wait for an answer to a quick request (default 5)")

    sp = asub.add_parser("status", help="state, generation, in-flight and released memory")
    common(sp)

    sp = asub.add_parser("prepare", help="drain requests and release memory (-> PREPARED)")
    common(sp)
    sp.add_argument("--op-id", help="operation id; repeating it returns the first result")
    sp.add_argument("--drain", choices=["wait", "abort", "keep"], default="wait",
                    help="wait: let requests finish; abort: end them now; keep: freeze them "
                         "to finish after restore (default wait)")
    sp.add_argument("--drain-timeout", type=_positive, default=30.0, metavar="S",
                    help="seconds a wait drain may take (default 30)")
    sp.add_argument("--on-deadline", choices=["abort", "keep", "fail"], default="abort",
                    help="what a wait drain does at its deadline (default abort)")
    what = sp.add_mutually_exclusive_group()
    what.add_argument("--level", type=int, choices=[0, 1, 2], default=None,
                      help="0 nothing; 1 offload weights, discard KV cache (default); "
                           "2 discard both, reload weights from file")
    what.add_argument("--tags", metavar="TAG,...", help="release these tags instead of a level")
    sp.add_argument("--budget", type=parse_bytes, metavar="SIZE",
                    help="fail (and roll back) if more memory than this remains after release")
    sp.add_argument("--deadline", type=_positive, metavar="S", help="overall deadline in seconds")

    for name, text in (("restore", "re-wake, verify and resume (PREPARED/FAILED -> RUNNING)"),
                       ("rollback", "undo a prepare (PREPARING/PREPARED -> RUNNING)")):
        sp = asub.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--op-id", help="operation id; repeating it returns the first result")
        sp.add_argument("--deadline", type=_positive, metavar="S", help="deadline in seconds")
        if name == "rollback":
            sp.add_argument("--reason", default="", help="recorded with the transition")

    sp = asub.add_parser("watch", help="print the agent's events as they happen")
    common(sp)
    sp.add_argument("--duration", type=_positive, metavar="S",
                    help="stop after S seconds (default: until interrupted)")
    sp.add_argument("--heartbeats", action="store_true", help="print heartbeats too")
    return parser


# ---------------------------------------------------------------- output


def _print_json(obj) -> None:
    sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")


def _describe(result) -> str:
    if isinstance(result, p.StatusReply):
        lines = [f"engine {result.engine} (pid {result.pid}): {result.state}, "
                 f"generation {result.generation}",
                 f"  in flight {result.in_flight}, kept {result.kept}"
                 + (f", operation {result.current_op}" if result.current_op else "")]
        for tag, size in result.registered_bytes.items():
            mark = " (released)" if tag in result.released_tags else ""
            lines.append(f"  {tag}: {human_bytes(size)}{mark}")
        if result.restored_from_image:
            lines.append(f"  restored from a checkpoint image (incarnation {result.incarnation})")
        return "\n".join(lines)
    if isinstance(result, p.PrepareReply):
        d, m = result.drain, result.memory
        esc = f" -> {d.escalated_to}" if d.escalated_to else ""
        return (f"{result.state} in {result.duration_s:.3f}s (op {result.op_id})\n"
                f"  drain {d.mode}{esc}: {d.completed} completed, {d.aborted} aborted, "
                f"{d.kept} kept in {d.drain_s:.3f}s\n"
                f"  memory: freed {human_bytes(m.freed_bytes)}, residual "
                f"{human_bytes(m.residual_bytes)} (tags {','.join(m.tags) or '-'})")
    if isinstance(result, p.RestoreReply):
        mem = (f", verified {result.memory.verified_tensors} tensors" if result.memory else "")
        return (f"{result.state} in {result.duration_s:.3f}s (op {result.op_id}), generation "
                f"{result.generation}, {result.resumed_kept} kept requests resumed{mem}")
    return str(result)


def _describe_event(ev: p.EventBody) -> str:
    if isinstance(ev, p.StateChanged):
        t = ev.transition
        return f"{ev.engine}: {t.source} -> {t.dest} ({t.trigger}{', ' + t.reason if t.reason else ''})"
    if isinstance(ev, p.DrainProgress):
        return (f"{ev.engine}: draining {ev.in_flight} in flight, {ev.completed} completed, "
                f"{ev.aborted} aborted after {ev.elapsed_s:.1f}s")
    if isinstance(ev, p.MemoryReported):
        r = ev.report
        return f"{ev.engine}: {r.action} freed {human_bytes(r.freed_bytes)}"
    if isinstance(ev, p.Heartbeat):
        return f"{ev.engine}: heartbeat {ev.seq} ({ev.state})"
    return repr(ev)


# ---------------------------------------------------------------- commands


def _agent(args: argparse.Namespace) -> int:
    from ckpt_controller.agent.client import AgentClient

    progress = sys.stderr.isatty() and not args.json
    on_event = (lambda ev: print(_describe_event(ev), file=sys.stderr)) if progress else None
    with AgentClient(args.control, timeout_s=args.timeout, on_event=on_event) as client:
        action = args.agent_command
        if action == "watch":
            return _watch(client, args)
        if progress and action != "status":
            client.subscribe()
        if action == "status":
            result = client.status()
        elif action == "prepare":
            tags = [t for t in args.tags.split(",") if t] if args.tags else None
            if args.tags is not None and not tags:
                raise UsageError("--tags needs at least one tag")
            result = client.prepare(
                op_id=args.op_id, drain=args.drain, drain_timeout_s=args.drain_timeout,
                on_deadline=args.on_deadline, level=None if tags else (
                    1 if args.level is None else args.level),
                tags=tags, residual_budget_bytes=args.budget, deadline_s=args.deadline,
            )
        elif action == "restore":
            result = client.restore(op_id=args.op_id, deadline_s=args.deadline)
        else:
            result = client.rollback(op_id=args.op_id, reason=args.reason,
                                     deadline_s=args.deadline)
    if args.json:
        _print_json(result)
    else:
        print(_describe(result))
    return 0


def _watch(client, args: argparse.Namespace) -> int:
    client.subscribe()
    end = None if args.duration is None else time.monotonic() + args.duration
    while end is None or time.monotonic() < end:
        left = 0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))
        for ev in client.poll_events(left):
            if isinstance(ev, p.Heartbeat) and not args.heartbeats:
                continue
            if args.json:
                _print_json({"event": type(ev).__name__, **msgspec.to_builtins(ev)})
            else:
                print(_describe_event(ev), flush=True)
        if end is None:
            client.heartbeat()  # raises UnreachableError when the agent is gone
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "agent":
            return _agent(args)
        raise UsageError(f"unknown command {args.command}")
    except CkptError as err:
        if getattr(args, "json", False):
            _print_json({"error": {"kind": err.kind, "message": err.message,
                                   "details": p.to_plain(err.details)}})
        print(f"ckptctl: {err.kind}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
