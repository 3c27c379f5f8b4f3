"""``ckptctl agent ...``: talk to one engine's agent directly, without a controller.

The client, the protocol and the vLLM sidecar load when an action runs, not for ``--help``.
Neighbours: ``cli.common``, ``agent.client``, ``adapters.vllm.sidecar``.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from ckpt_controller.cli.common import (
    EXIT_CODES,
    STATUS_COLUMNS,
    add_curve_client_args,
    add_curve_server_args,
    curve_client,
    curve_server,
    describe,
    describe_event,
    duration,
    duration_or_zero,
    goes_on_if_interrupted,
    human_bytes,
    prepare_flags,
    prepare_opts,
    status_row,
    step_op_id,
    table,
)
from ckpt_controller.cli.logsetup import add_log_args, log_args, setup_from_args
from ckpt_controller.cli.progress import Progress
from ckpt_controller.cli.output import emit, event_body, result_kind
from ckpt_controller.errors import UsageError
from ckpt_controller.vocab import Trigger


def add_parser(sub: argparse._SubParsersAction) -> None:
    agent = sub.add_parser("agent", help="talk to one engine's agent directly (no controller)",
                           epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    agent.set_defaults(run=run)
    asub = agent.add_subparsers(dest="agent_command", metavar="ACTION", required=True)
    fmt = {"epilog": EXIT_CODES, "formatter_class": argparse.RawDescriptionHelpFormatter}

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--control", required=True, metavar="ENDPOINT",
                        help="the agent's control endpoint (ipc://PATH or tcp://HOST:PORT)")
        sp.add_argument("--json", action="store_true", help="print one JSON document")
        sp.add_argument("--timeout", type=duration, default=5.0, metavar="S",
                        help="seconds to wait for an answer to a quick request (default 5)")
        add_curve_client_args(sp, "agent")

    sp = asub.add_parser("status", help="state, generation, in-flight and released memory",
                         **fmt)
    common(sp)

    sp = asub.add_parser(Trigger.PREPARE,
                         help="drain requests and release memory (-> PREPARED)", **fmt)
    common(sp)
    sp.add_argument("--op-id", type=step_op_id,
                    help="operation id; repeating it returns the first result")
    prepare_opts(sp, drain_timeout=duration_or_zero)
    sp.add_argument("--deadline", type=duration, metavar="S",
                    help="overall deadline in seconds (at most a day)")

    for name, text in ((Trigger.RESTORE, "re-wake, verify and resume (PREPARED/FAILED -> "
                                         "RUNNING)"),
                       (Trigger.ROLLBACK, "undo a prepare (PREPARING/PREPARED -> RUNNING)")):
        sp = asub.add_parser(name, help=text, **fmt)
        common(sp)
        sp.add_argument("--op-id", type=step_op_id,
                        help="operation id; repeating it returns the first result")
        sp.add_argument("--deadline", type=duration, metavar="S",
                        help="deadline in seconds (at most a day)")
        if name is Trigger.ROLLBACK:
            sp.add_argument("--reason", default="", help="recorded with the transition")

    sp = asub.add_parser(
        "vllm", help="run an agent for a vLLM server (a sidecar over its HTTP API)",
        description="Run an agent beside a vLLM server. It serves the control protocol on\n"
                    "ENDPOINT and drives vLLM through its /checkpoint API (vLLM 0.34+ started\n"
                    "with --enable-sleep-mode) where the server has it, else through its\n"
                    "dev-mode API (VLLM_SERVER_DEV_MODE=1: /pause, /sleep, /wake_up, ...),\n"
                    "also used for what /checkpoint cannot do when the server has both\n"
                    "(docs/vllm.md). It prints one JSON ready line, then runs until SIGTERM\n"
                    "or Ctrl-C.",
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
    sp.add_argument("--api", choices=("auto", "checkpoint", "dev"), default="auto",
                    help="which vLLM API to drive: auto (default: /checkpoint where the "
                         "server has it), checkpoint (only it), dev (the dev-mode API only)")
    sp.add_argument("--no-verify-weights", action="store_true",
                    help="skip the weight checksums (the golden completion still runs)")
    sp.add_argument("--http-timeout", type=duration, default=30.0, metavar="S",
                    help="seconds for one quick HTTP call to vLLM (default 30)")
    sp.add_argument("--heartbeat", type=duration, default=0.5, metavar="S",
                    help="heartbeat interval in seconds (default 0.5)")
    add_curve_server_args(sp)
    add_log_args(sp)

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
    add_log_args(sp)
    sp.add_argument("vllm_command", nargs=argparse.REMAINDER, metavar="-- VLLM_COMMAND",
                    help="the vLLM server's command line, after --")

    sp = asub.add_parser("watch", help="print the agent's events as they happen", **fmt)
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

    progress = None if args.json else Progress()
    shown: set[tuple[str, float]] = set()  # transitions printed from events
    engine = [""]

    def on_event(ev) -> None:
        from ckpt_controller import protocol as p

        transition = getattr(ev, "transition", None)
        if transition is not None:
            shown.add((transition.trigger, transition.monotonic))
        engine[0] = getattr(ev, "engine", engine[0])
        if isinstance(ev, p.Heartbeat):
            progress.refresh()
        elif isinstance(ev, p.DrainProgress):
            progress.drain(ev.engine, ev.in_flight, ev.completed, ev.aborted)
        else:
            progress.line(describe_event(ev))
    action = args.agent_command
    with AgentClient(args.control, timeout_s=args.timeout,
                     on_event=on_event if progress and action != "status" else None,
                     curve=curve_client(args)) as client:
        if action == "watch":
            return _watch(client, args)
        if progress and action != "status":
            client.subscribe()
        try:
            if action == "status":
                result = client.status()
            else:
                result = _operation(client, args)
        finally:
            if progress is not None:
                progress.finish()
    if progress and action != "status":
        # the transition that ended the operation comes in its reply, not as an event
        from ckpt_controller import protocol as p

        for t in getattr(result, "transitions", ()):
            if (t.trigger, t.monotonic) not in shown:
                ev = p.StateChanged(engine=engine[0] or args.control, transition=t)
                progress.line(describe_event(ev))
        progress.finish()
    if args.json:
        emit(result_kind(result, action), result)
    elif action == "status":
        print(agent_status(result))
    else:
        print(describe(result))
    return 0


def _operation(client, args: argparse.Namespace):
    """``agent prepare|restore|rollback``: its op id chosen here (``--op-id``, else a new
    one), so that Ctrl-C can name it: the agent goes on with the operation."""
    from ckpt_controller.rpc import new_op_id

    op_id = args.op_id or new_op_id()
    status = f"ckptctl agent status --control {shlex.quote(args.control)}"
    if args.curve_key is not None:
        status += (f" --curve-key {shlex.quote(str(args.curve_key))} --curve-server-key "
                   f"{shlex.quote(str(args.curve_server_key))}")
    with goes_on_if_interrupted(op_id, "agent", status):
        if args.agent_command == Trigger.PREPARE:
            flags = prepare_flags(args, controller=False)
            return client.prepare(
                op_id=op_id, drain=flags.drain, drain_timeout_s=flags.drain_timeout_s,
                on_deadline=flags.on_deadline, level=flags.level, tags=flags.tags,
                residual_budget_bytes=args.budget, deadline_s=args.deadline,
            )
        if args.agent_command == Trigger.RESTORE:
            return client.restore(op_id=op_id, deadline_s=args.deadline)
        return client.rollback(op_id=op_id, reason=args.reason, deadline_s=args.deadline)


def agent_status(s) -> str:
    """``agent status``: the row ``ckptctl status`` prints for this engine (HELD-BY: the
    agent's operation now), then its memory by tag."""
    row = status_row(s.engine, s, now=time.time(), holder=s.current_op)
    lines = [table([STATUS_COLUMNS, row]), ""]
    for tag, size in s.registered_bytes.items():
        mark = " (released)" if tag in s.released_tags else ""
        lines.append(f"{tag}: {human_bytes(size)}{mark}")
    lines.append(f"kept {s.kept}" + (f"; restored from a checkpoint image (incarnation "
                                     f"{s.incarnation})" if s.restored_from_image else ""))
    return "\n".join(lines)


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
    from ckpt_controller.adapters.vllm import run, sidecar
    from ckpt_controller.endpoints import check_name
    from ckpt_controller.sdnotify import Notifier

    notifier = Notifier.from_env()
    setup_from_args(args)
    check_name(args.name)
    if args.golden_tokens is not None and not 1 <= args.golden_tokens <= 512:
        raise UsageError("--golden-tokens must be between 1 and 512", value=args.golden_tokens)
    if args.pid is not None and args.pid <= 0:
        raise UsageError("--pid must be a positive process id", value=args.pid)
    run.serve(args.url, name=args.name, control=args.control, pid=args.pid,
                  golden_prompt=args.golden_prompt or sidecar.GOLDEN_PROMPT,
                  golden_tokens=args.golden_tokens or sidecar.GOLDEN_TOKENS,
                  verify_weights=not args.no_verify_weights, timeout_s=args.http_timeout,
                  heartbeat_interval_s=args.heartbeat, curve=curve_server(args),
                  engine_is_parent=args.engine_is_parent, notifier=notifier, api=args.api)
    return 0


def _vllm_launch(args: argparse.Namespace) -> int:
    from ckpt_controller.adapters.vllm import launcher
    from ckpt_controller.endpoints import check_endpoint, check_name

    command = args.vllm_command[1:] if args.vllm_command[:1] == ["--"] else args.vllm_command
    if not command:
        raise UsageError("give the vLLM server's command after --", value=args.vllm_command)
    check_name(args.name)
    check_endpoint(args.control)
    setup_from_args(args)  # the launcher's own records; its sidecar gets the same flags
    sidecar = ["--control", args.control, "--name", args.name, "--heartbeat",
               str(args.heartbeat), *log_args(args)]
    return launcher.launch(command, url=args.url, sidecar_args=sidecar,
                           log_dir=args.log_dir.resolve(), start_timeout_s=args.start_timeout)
