"""``ckptctl engine serve``, ``ckptctl generate``, ``ckptctl load``: the reference engine.

``generate`` and ``load`` reach an engine by its request endpoint (``--api``) or by its name
in the fleet's registry (``--engine NAME`` with ``--etcd URL``, the global etcd flags, also
accepted after the command): the client follows the engine when it moves to another node.
Neighbours: ``engine.server``, ``engine.client`` and ``engine.load`` (imported when a command
runs), ``cli.common``, ``cli.fleet_cmd`` (the etcd flags and client)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ckpt_controller import values
from ckpt_controller.cli.common import (
    EXIT_CODES,
    add_curve_server_args,
    count,
    curve_server,
    duration,
    duration_or_zero,
    rate,
    seed,
    token_id,
)
from ckpt_controller.cli.logsetup import add_log_args, setup_from_args
from ckpt_controller.cli.output import emit
from ckpt_controller.errors import OperationError


def _ids(text: str) -> list[int]:
    try:
        ids = [values.TOKEN_ID.parse(t) for t in text.split(",") if t.strip()]
    except ValueError as err:  # argparse reports it as a usage error (exit 2) with the flag
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of token ids: {values.shown(text)} ({err})") from None
    if not ids:
        raise argparse.ArgumentTypeError("at least one token id")
    return ids


def default_model_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "ckpt-controller" / "models"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    fmt = {"epilog": EXIT_CODES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    engine = sub.add_parser("engine", help="the reference engine (a small torch LM server)", **fmt)
    esub = engine.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    sp = esub.add_parser("serve", help="run a reference engine with its agent until SIGTERM", **fmt)
    sp.set_defaults(run=_serve)
    sp.add_argument("--name", required=True, help="engine name (letters, digits, . _ -)")
    sp.add_argument("--api", required=True, metavar="ENDPOINT", help="request API endpoint")
    sp.add_argument("--control", metavar="ENDPOINT",
                    help="agent control endpoint (default: ipc:// in a private runtime dir)")
    sp.add_argument("--model", default="tiny",
                    help="tiny | small | a weight size such as 2GiB | a .safetensors path")
    sp.add_argument("--seed", type=seed, default=0, help="weights seed (default 0)")
    sp.add_argument("--dtype", choices=["float64", "float32", "bfloat16"],
                    help="default: float64 for tiny/small, float32 for sizes")
    sp.add_argument("--model-dir", type=Path, default=None,
                    help=f"where generated weights files are kept (default {default_model_dir()})")
    sp.add_argument("--kv-blocks", type=count, help="KV pool size in blocks (default 4 sequences)")
    sp.add_argument("--block-size", type=count, default=16, help="tokens per KV block")
    sp.add_argument("--max-batch", type=count, default=16, help="requests decoded together")
    sp.add_argument("--max-waiting", type=count, default=256, metavar="N",
                    help="requests that may wait for the running batch; one more is refused "
                         "at once with OverloadedError (retryable; default 256)")
    sp.add_argument("--heartbeat", type=duration, default=0.5, metavar="S",
                    help="agent heartbeat interval (default 0.5)")
    sp.add_argument("--prepare-on-startup", action="store_true",
                    help="start PREPARED (KV cache released, as vLLM's "
                         "--checkpoint-prepare-on-startup): serve after a restore; a capture "
                         "of it is a snapshot to restore from")
    add_curve_server_args(sp)
    add_log_args(sp)

    sp = sub.add_parser("generate", help="send one request to an engine, print its tokens", **fmt)
    sp.set_defaults(run=_generate)
    _add_target_args(sp)
    sp.add_argument("--prompt-ids", required=True, type=_ids, metavar="ID,ID,...",
                    help="the prompt as token ids")
    sp.add_argument("--max-tokens", required=True, type=count, metavar="N",
                    help="tokens to generate at most (finish reason length)")
    sp.add_argument("--stop-id", type=token_id, help="stop at this token id")
    sp.add_argument("--timeout", type=duration, default=60.0, metavar="S",
                    help="give up after S seconds without the end (exit 3; default 60, at "
                         "most a day); an engine nobody serves is exit 4 within a second")
    sp.add_argument("--json", action="store_true",
                    help="token ids, finish reason and events as one JSON document")

    sp = sub.add_parser("load", help="send requests at a rate; report how each ended", **fmt)
    sp.set_defaults(run=_load)
    _add_target_args(sp)
    sp.add_argument("--rate", required=True, type=rate,
                    help=f"requests per second (at most {values.MAX_RATE:.0f})")
    sp.add_argument("--duration", required=True, type=duration, metavar="S",
                    help="seconds to send for (rate x duration requests in all)")
    sp.add_argument("--seed", type=seed, default=0,
                    help="prompt seed: same seed, same requests")
    sp.add_argument("--vocab-size", type=count, default=1024,
                    help="prompt tokens are drawn below this (default 1024, the smallest "
                         "model's vocabulary)")
    sp.add_argument("--settle", type=duration_or_zero, default=60.0, metavar="S",
                    help="how long to wait for the last requests to end (default 60)")
    sp.add_argument("--json", action="store_true",
                    help="one JSON document: counts, lost ids, a digest of the outputs")


def _add_target_args(sp: argparse.ArgumentParser) -> None:
    """``--api ENDPOINT`` or ``--engine NAME`` (through etcd); the global etcd flags again,
    so that they may follow the command too (``SUPPRESS``: given before it, they stay)."""
    target = sp.add_mutually_exclusive_group(required=True)
    target.add_argument("--api", metavar="ENDPOINT", help="the engine's request API endpoint")
    target.add_argument("--engine", metavar="NAME",
                        help="the engine's name in the fleet's registry (needs --etcd): its "
                             "published api endpoint, followed when the engine moves")
    for flag, metavar in (("--etcd", "URL[,URL...]"), ("--etcd-ca", "FILE"),
                          ("--etcd-cert", "FILE"), ("--etcd-key", "FILE"),
                          ("--etcd-prefix", "PREFIX")):
        sp.add_argument(flag, metavar=metavar, default=argparse.SUPPRESS,
                        help=f"as `ckptctl {flag}` (given here or before the command)")


def _connect(args: argparse.Namespace):
    """The client ``--api`` or ``--engine`` names: ``UsageError`` (exit 2) for an engine not
    in the registry or with no api endpoint, ``UnreachableError`` (exit 4) without etcd."""
    from ckpt_controller.engine.client import EngineClient

    if args.api is not None:
        return EngineClient(args.api)
    from ckpt_controller.cli.fleet_cmd import client
    from ckpt_controller.fleet.registry import Resolver

    return EngineClient.for_engine(args.engine, Resolver(client(args), prefix=args.etcd_prefix))


def _serve(args: argparse.Namespace) -> int:
    from ckpt_controller.endpoints import check_endpoint

    for endpoint in (args.api, args.control):  # a bad address said before torch loads
        if endpoint is not None:
            check_endpoint(endpoint)
    from ckpt_controller.engine.server import EngineOptions, serve
    from ckpt_controller.sdnotify import Notifier

    notifier = Notifier.from_env()
    setup_from_args(args)
    serve(EngineOptions(
        name=args.name, api=args.api, control=args.control, model=args.model, seed=args.seed,
        model_dir=args.model_dir or default_model_dir(), dtype=args.dtype,
        kv_blocks=args.kv_blocks, block_size=args.block_size, max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        heartbeat_interval_s=args.heartbeat, curve=curve_server(args),
        prepare_on_startup=args.prepare_on_startup,
    ), notifier=notifier)
    return 0


def _generate(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        c = client.generate(args.prompt_ids, args.max_tokens, stop_token_id=args.stop_id,
                            timeout_s=args.timeout)
    if args.json:
        emit("generation", request_id=c.request_id, token_ids=c.token_ids,
             finish_reason=c.finish_reason, events=c.events)
    else:
        print(",".join(map(str, c.token_ids)))
        print(f"finish: {c.finish_reason}", file=sys.stderr)
    return 0


def _load(args: argparse.Namespace) -> int:
    from ckpt_controller.engine.load import run_load

    def show(r) -> None:
        print(f"sent {r.sent}, completed {r.completed}, aborted {r.aborted}, "
              f"rejected {r.rejected}", file=sys.stderr)

    progress = show if sys.stderr.isatty() and not args.json else None
    report, _ = run_load(lambda: _connect(args), rate=args.rate, duration_s=args.duration, seed=args.seed,
                         vocab_size=args.vocab_size, settle_s=args.settle, on_progress=progress)
    lost = None
    if report.lost:  # a request that never ended is the one failure load exists to catch
        lost = OperationError("requests ended without a finish reason or rejection",
                              lost=report.lost, request_ids=report.lost_ids[:20])
    if args.json:  # one document: the report, with the error in it when there is one
        error = None if lost is None else {"kind": lost.kind, "message": lost.message,
                                           "exit_code": lost.exit_code, "details": lost.details}
        emit("load", report, error=error)
    else:
        print(f"sent {report.sent}: completed {report.completed}, aborted {report.aborted}, "
              f"errored {report.errored}, rejected {report.rejected}, lost {report.lost} "
              f"in {report.duration_s:.1f}s")
        if report.latency_p50_s is not None:
            print(f"latency p50 {report.latency_p50_s:.3f}s, max {report.latency_max_s:.3f}s")
    if lost is not None and args.json:
        print(f"ckptctl: {lost.kind}: {lost}", file=sys.stderr)
        return lost.exit_code
    if lost is not None:
        raise lost
    return 0
