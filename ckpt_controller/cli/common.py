"""Helpers every ckptctl command shares: argparse types for durations, rates, counts, sizes
and op ids (the rules themselves live in ``values``), flags that take a ``vocab`` word, JSON
and human output.

Building the parser (``ckptctl --help``) imports nothing heavier than ``values``: the wire
protocol, the transport and CURVE load when a command runs. Neighbours: ``values``,
``vocab``, ``units``, ``protocol`` (``describe``), ``security`` (CURVE keys).
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ckpt_controller import values
from ckpt_controller.errors import UsageError
from ckpt_controller.units import human_bytes

if TYPE_CHECKING:
    from ckpt_controller import protocol as p

EXIT_CODES = """exit codes:
  0  success
  1  operation failed or was rolled back (or the engine refused a request)
  2  usage or configuration error
  3  a deadline passed
  4  the agent or controller is unreachable"""


def arg_type(rule: values.Rule) -> Callable[[str], Any]:
    """An argparse ``type=`` for ``rule``: a bad value exits 2 with usage, the flag, the value
    and what a valid one looks like."""

    def parse(text: str) -> Any:
        try:
            return rule.parse(text)
        except ValueError as err:  # argparse reports it as a usage error (exit 2) with the flag
            raise argparse.ArgumentTypeError(
                f"{values.shown(text)} is not a valid {rule.name}: {err}") from None

    parse.__name__ = rule.name  # argparse's own fallback message names the type
    return parse


#: a size ('1073741824', '512MiB', '2GiB'), at most ``values.MAX_BYTES``
parse_bytes = arg_type(values.BYTES)
#: seconds, > 0 and at most a day (NaN, infinity, 0 and negative numbers are refused)
duration = arg_type(values.DURATION)
#: seconds, >= 0 and at most a day
duration_or_zero = arg_type(values.DURATION_OR_ZERO)
#: requests per second, > 0 and at most ``values.MAX_RATE``
rate = arg_type(values.RATE)
#: a whole number >= 1
count = arg_type(values.COUNT)
#: a token id (>= 0)
token_id = arg_type(values.TOKEN_ID)
#: a seed for a random generator
seed = arg_type(values.count(0, 2**63 - 1))
#: a controller operation id (it names image folders: letters, digits, '.', '_', '-')
op_id = arg_type(values.OP_ID)
#: an agent operation id (also '/': the controller's ``<op>/<engine>/<step>``)
step_op_id = arg_type(values.STEP_OP_ID)
#: the name commands outside this package import for a duration
positive = duration


def word_arg(words: type[enum.Enum]) -> dict[str, Any]:
    """``add_argument`` keywords for a flag that takes one word of ``words`` (a ``vocab``
    enum): ``--help`` and argparse's "invalid choice" message list the wire words as they
    always did, and the value parsed is the member (``DrainMode.WAIT``, ``ReleaseLevel(2)``)."""
    plain = int if issubclass(words, int) else str

    def parse(text: str) -> Any:
        value = plain(text)  # a ValueError: argparse says "invalid int value: 'x'"
        try:
            return words(value)
        except ValueError:  # policy: left as given, for argparse's "invalid choice" message
            return value

    parse.__name__ = plain.__name__
    return {"type": parse, "choices": [w.value for w in words]}


def print_json(obj, flush: bool = False) -> None:
    """``obj`` as one line of JSON on stdout; ``flush`` for a stream of lines read as they
    come (``watch --json`` into a pipe would otherwise hold them until its buffer fills)."""
    sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")
    if flush:
        sys.stdout.flush()


def describe(result) -> str:
    from ckpt_controller import protocol as p

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


def describe_event(ev: p.EventBody) -> str:
    from ckpt_controller import protocol as p

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


# ---------------------------------------------------------------- CURVE keys


def add_curve_server_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--curve-secret-key", type=Path, metavar="FILE",
                    help="serve the control endpoint with CURVE, with this secret key "
                         "(NAME.key_secret from `ckptctl keys`)")
    sp.add_argument("--curve-clients", type=Path, metavar="DIR",
                    help="admit only clients whose public key (*.key) is in DIR")


def curve_server(args: argparse.Namespace):
    from ckpt_controller.security import CurveServer, load

    if (args.curve_secret_key is None) != (args.curve_clients is None):
        raise UsageError("--curve-secret-key and --curve-clients go together")
    if args.curve_secret_key is None:
        return None
    load(args.curve_secret_key, secret=True, what="--curve-secret-key")
    if not args.curve_clients.is_dir():
        raise UsageError(f"--curve-clients {args.curve_clients} is not a directory")
    return CurveServer(args.curve_secret_key, args.curve_clients)


def add_curve_client_args(sp: argparse.ArgumentParser, server: str) -> None:
    sp.add_argument("--curve-key", type=Path, metavar="FILE",
                    default=os.environ.get("CKPT_CURVE_KEY") or None,
                    help="connect with CURVE using this secret key (default $CKPT_CURVE_KEY)")
    sp.add_argument("--curve-server-key", type=Path, metavar="FILE",
                    default=os.environ.get("CKPT_CURVE_SERVER_KEY") or None,
                    help=f"the {server}'s public key file (default $CKPT_CURVE_SERVER_KEY)")


def curve_client(args: argparse.Namespace):
    from ckpt_controller.security import CurveClient, load

    if (args.curve_key is None) != (args.curve_server_key is None):
        raise UsageError("--curve-key and --curve-server-key go together")
    if args.curve_key is None:
        return None
    load(args.curve_key, secret=True, what="--curve-key")
    load(args.curve_server_key, secret=False, what="--curve-server-key")
    return CurveClient(args.curve_key, args.curve_server_key)
