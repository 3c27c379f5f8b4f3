"""``ckptctl agent ...``: talk to one engine's agent directly, without a controller.

The client, the protocol and the vLLM sidecar load when an action runs, not for ``--help``.
Neighbours: ``cli.common``, ``agent.client``, ``adapters.vllm.sidecar``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ckpt_controller.cli.common import (
    EXIT_CODES,
    add_curve_client_args,
    add_curve_server_args,
    curve_client,
    curve_server,
    describe,
    describe_event,
    duration,
    duration_or_zero,
    parse_bytes,
    step_op_id,
    word_arg,
)
from ckpt_controller.cli.output import emit, event_body, result_kind
from ckpt_controller.errors import UsageError
from ckpt_controller.vocab import DrainMode, Escalation, ReleaseLevel


def add_parser(sub: argparse._SubParsersAction) -> None:
    agent = sub.add_parser("agent", help="talk to one engine's agent directly (no controller)",
                           epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    agent.set_defaults(run=run)
    asub = agent.add_subparsers(dest="agent_command", metavar="ACTION", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--control", required=True, metavar="ENDPOINT",
                        help="the agent's control endpoint (ipc://PATH or tcp://HOST:PORT)")
        sp.add_argument("--json", action="store_true", help="print one JSON document")
        sp.add_argument("--timeout", type=duration, default=5.0, metavar="S",
                        help="seconds to wait for an answer to a quick request (default 5)")
        add_curve_client_args(sp, "agent")

    sp = asub.add_parser("status", help="state, generation, in-flight and released memory")
    common(sp)

    sp = asub.add_parser("prepare", help="drain requests and release memory (-> PREPARED)")
    common(sp)
    sp.add_argument("--op-id", type=step_op_id,
                    help="operation id; repeating it returns the first result")
    sp.add_argument("--drain", **word_arg(DrainMode), default=DrainMode.WAIT,
                    help="wait: let requests finish; abort: end them now; keep: freeze them "
                         "to finish after restore (default wait)")
    sp.add_argument("--drain-timeout", type=duration_or_zero, default=30.0, metavar="S",
                    help="seconds a wait drain may take, 0 to a day (default 30)")
    sp.add_argument("--on-deadline", **word_arg(Escalation), default=Escalation.ABORT,
                    help="what a wait drain does at its deadline (default abort)")
    what = sp.add_mutually_exclusive_group()
    what.add_argument("--level", **word_arg(ReleaseLevel), default=None,
                      help="0 nothing; 1 offload weights, discard KV cache (default); "
                           "2 discard both, reload weights from file")
    what.add_argument("--tags", metavar="TAG,...", help="release these tags instead of a level")
    sp.add_argument("--budget", type=parse_bytes, metavar="SIZE",
                    help="fail (and roll back) if more memory than this remains after release")
    sp.add_argument("--deadline", type=duration, metavar="S",
                    help="overall deadline in seconds (at most a day)")

    for name, text in (("restore", "re-wake, verify and resume (PREPARED/FAILED -> RUNNING)"),
                       ("rollback", "undo a prepare (PREPARING/PREPARED -> RUNNING)")):
        sp = asub.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--op-id", type=step_op_id,
                        help="operation id; repeating it returns the first result")
        sp.add_argument("--deadline", type=duration, metavar="S",
                        help="deadline in seconds (at most a day)")
        if name == "rollback":
            sp.add_argument("--reason", default="", help="recorded with the transition")

    sp = asub.add_parser(
        "vllm", help="run an agent for a vLLM server (a sidecar over its HTTP dev-mode API)",
        description="Run an agent beside a vLLM server started with VLLM_SERVER_DEV_MODE=1.\n"
                    "It serves the control protocol on ENDPOINT and drives vLLM through\n"
                    "/pause, /sleep, /wake_up, /collective_rpc and /resume. It prints one\n"
                    "JSON ready line, then runs until SIGTERM or Ctrl-C.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--url", required=True, metavar="URL",
                    help="the vLLM server, e.g. http://127.0.0.1:8000")
    sp.add_argument("--control", metavar="ENDPOINT",
                    help="control endpoint to bind (default: ipc:// in the runtime folder)")
    sp.add_argument("--name", default="vllm", help="engine name (default vllm)")
    sp.add_argument("--pid", type=int, metavar="PID",
                    help="the vLLM server's PID, for hooks and memory reports (default: the "
                         "local process listening on the URL's port)")
    sp.add_argument("--engine-is-parent", action="store_true",
                    help="the engine is this sidecar's parent (ckptctl agent vllm-launch): its "
                         "host PID is reported, and read again after a restore")
    sp.add_argument("--golden-prompt", default=None, metavar="TEXT",
                    help="prompt of the golden completion compared after restore")
    sp.add_argument("--golden-tokens", type=int, default=None, metavar="N",
                    help="tokens of the golden completion (default 12)")
    sp.add_argument("--no-verify-weights", action="store_true",
                    help="skip the weight checksums (the golden completion still runs)")
    sp.add_argument("--http-timeout", type=duration, default=30.0, metavar="S",
                    help="seconds for one quick HTTP call to vLLM (default 30)")
    sp.add_argument("--heartbeat", type=duration, default=0.5, metavar="S",
                    help="heartbeat interval in seconds (default 0.5)")
    add_curve_server_args(sp)

    sp = asub.add_parser(
        "vllm-launch", help="start a vLLM server and its sidecar under this process (the "
                            "init of their PID namespace), so that CRIU moves them together",
        description="Start VLLM_COMMAND, wait until URL/health answers, then start\n"
                    "`ckptctl agent vllm --engine-is-parent` beside it, print one JSON ready\n"
                    "line and reap until SIGTERM, SIGINT or either child's end. Run it as\n"
                    "`unshare --pid --fork setsid ckptctl agent vllm-launch ... -- CMD...`\n"
                    "for an engine that can migrate (docs/vllm.md, Migrating vLLM).",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--url", required=True, metavar="URL",
                    help="where VLLM_COMMAND serves, e.g. http://0.0.0.0:8000 (a wildcard "
                         "host is published with the node's address)")
    sp.add_argument("--log-dir", required=True, type=Path, metavar="DIR",
                    help="vllm.log, sidecar.log and launcher.log go there")
    sp.add_argument("--start-timeout", type=duration, default=600.0, metavar="S",
                    help="seconds vLLM has to answer /health (default 600)")
    sp.add_argument("--control", required=True, metavar="ENDPOINT",
                    help="the sidecar's control endpoint; tcp://0.0.0.0:PORT for an engine "
                         "that migrates (ipc:// cannot move between nodes)")
    sp.add_argument("--name", default="vllm", help="engine name (default vllm)")
    sp.add_argument("--heartbeat", type=duration, default=0.5, metavar="S",
                    help="the sidecar's heartbeat interval in seconds (default 0.5)")
    sp.add_argument("vllm_command", nargs=argparse.REMAINDER, metavar="-- VLLM_COMMAND",
                    help="the vLLM server's command line, after --")

    sp = asub.add_parser("watch", help="print the agent's events as they happen")
    common(sp)
    sp.add_argument("--duration", type=duration, metavar="S",
                    help="stop after S seconds (default: until interrupted or the agent is "
                         "lost: exit 4)")
    sp.add_argument("--heartbeats", action="store_true", help="print heartbeats too")


def run(args: argparse.Namespace) -> int:
    from ckpt_controller.agent.client import AgentClient

    if args.agent_command == "vllm":
        return _vllm(args)
    if args.agent_command == "vllm-launch":
        return _vllm_launch(args)

    progress = sys.stderr.isatty() and not args.json
    shown: set[tuple[str, float]] = set()  # transitions printed from events
    engine = [""]

    def on_event(ev) -> None:
        transition = getattr(ev, "transition", None)
        if transition is not None:
            shown.add((transition.trigger, transition.monotonic))
        engine[0] = getattr(ev, "engine", engine[0])
        print(describe_event(ev), file=sys.stderr)
    with AgentClient(args.control, timeout_s=args.timeout,
                     on_event=on_event if progress else None,
                     curve=curve_client(args)) as client:
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
                on_deadline=args.on_deadline,
                level=None if tags else (ReleaseLevel.OFFLOAD if args.level is None
                                         else args.level),
                tags=tags, residual_budget_bytes=args.budget, deadline_s=args.deadline,
            )
        elif action == "restore":
            result = client.restore(op_id=args.op_id, deadline_s=args.deadline)
        else:
            result = client.rollback(op_id=args.op_id, reason=args.reason,
                                     deadline_s=args.deadline)
    if progress:  # the transition that ended the operation comes in its reply, not as an event
        from ckpt_controller import protocol as p

        for t in getattr(result, "transitions", ()):
            if (t.trigger, t.monotonic) not in shown:
                ev = p.StateChanged(engine=engine[0] or args.control, transition=t)
                print(describe_event(ev), file=sys.stderr)
    if args.json:
        emit(result_kind(result, action), result)
    else:
        print(describe(result))
    return 0


def _watch(client, args: argparse.Namespace) -> int:
    from ckpt_controller import protocol as p

    client.subscribe()
    end = None if args.duration is None else time.monotonic() + args.duration
    while end is None or time.monotonic() < end:
        left = 0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))
        for ev in client.poll_events(left):
            if isinstance(ev, p.Heartbeat) and not args.heartbeats:
                continue
            if args.json:
                emit("agent-event", event_body(ev), stream=True)
            else:
                print(describe_event(ev), flush=True)
        if not client.follows_heartbeats:  # else poll_events says when the agent is lost
            client.heartbeat()  # raises UnreachableError when the agent is gone
    return 0


def _vllm(args: argparse.Namespace) -> int:
    from ckpt_controller.adapters.vllm import sidecar
    from ckpt_controller.endpoints import check_name

    check_name(args.name)
    if args.golden_tokens is not None and not 1 <= args.golden_tokens <= 512:
        raise UsageError("--golden-tokens must be between 1 and 512", value=args.golden_tokens)
    if args.pid is not None and args.pid <= 0:
        raise UsageError("--pid must be a positive process id", value=args.pid)
    sidecar.serve(args.url, name=args.name, control=args.control, pid=args.pid,
                  golden_prompt=args.golden_prompt or sidecar.GOLDEN_PROMPT,
                  golden_tokens=args.golden_tokens or sidecar.GOLDEN_TOKENS,
                  verify_weights=not args.no_verify_weights, timeout_s=args.http_timeout,
                  heartbeat_interval_s=args.heartbeat, curve=curve_server(args),
                  engine_is_parent=args.engine_is_parent)
    return 0


def _vllm_launch(args: argparse.Namespace) -> int:
    from ckpt_controller.adapters.vllm import launcher
    from ckpt_controller.endpoints import check_endpoint, check_name

    command = args.vllm_command[1:] if args.vllm_command[:1] == ["--"] else args.vllm_command
    if not command:
        raise UsageError("give the vLLM server's command after --", value=args.vllm_command)
    check_name(args.name)
    check_endpoint(args.control)
    sidecar = ["--control", args.control, "--name", args.name, "--heartbeat",
               str(args.heartbeat)]
    return launcher.launch(command, url=args.url, sidecar_args=sidecar,
                           log_dir=args.log_dir.resolve(), start_timeout_s=args.start_timeout)
