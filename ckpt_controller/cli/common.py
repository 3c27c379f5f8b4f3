"""Helpers every ckptctl command shares: argparse types for durations, rates, counts, sizes
and op ids (the rules themselves live in ``values``), flags that take a ``vocab`` word,
deprecated flag names, the prepare defaults, JSON and human output (the one table renderer
``table`` that ``status``, ``agent status`` and ``fleet status`` print with, ``age``), and what
an operation command says when Ctrl-C stops it (``goes_on_if_interrupted``).

Building the parser (``ckptctl --help``) imports nothing heavier than ``values``: the wire
protocol, the transport and CURVE load when a command runs. Neighbours: ``values``,
``vocab``, ``units``, ``protocol`` (``describe``), ``security`` (CURVE keys).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_controller import values
from ckpt_controller.errors import UsageError
from ckpt_controller.units import human_bytes

if TYPE_CHECKING:
    from ckpt_controller import protocol as p

#: the heading of the one exit-code block each help page has (tests/cli/test_cli.py counts them)
EXIT_CODES_HEADING = "exit codes:"
EXIT_CODES = """exit codes:
  0  success
  1  operation failed or was rolled back (or the engine refused a request)
  2  usage or configuration error
  3  a deadline passed
  4  the agent or controller is unreachable (or shed the request under load: retry)"""


#: the rolling limit's default as argparse's help shows it (help is %-formatted: 25% is 25%%)
LIMIT_HELP = str(values.DEFAULT_MAX_UNAVAILABLE).replace("%", "%%")


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


class DeprecatedFlag(argparse.Action):
    """A flag's old name, kept one release: hidden from ``--help``, it stores into the new
    flag's ``dest`` and says on stderr which name to use instead."""

    def __init__(self, option_strings, dest, new: str = "", **kw) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        print(f"ckptctl: warning: {option_string} is deprecated and goes away in the next "
              f"release; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, value)


def add_deprecated(sp: argparse.ArgumentParser, old: str, new: str) -> None:
    """``old`` as a hidden alias of the flag ``new`` (already added to ``sp``)."""
    action = next(a for a in sp._actions if new in a.option_strings)
    sp.add_argument(old, dest=action.dest, type=action.type, metavar=action.metavar,
                    action=DeprecatedFlag, new=new, default=argparse.SUPPRESS)


# ---------------------------------------------------------------- prepare defaults


@dataclass(frozen=True)
class PrepareFlags:
    """The prepare parameters one command resolved: what it sends, or what it leaves to the
    controller (``None``: the controller's ``[defaults]`` apply)."""

    drain: Any
    drain_timeout_s: float | None
    on_deadline: Any
    level: Any
    tags: list[str] | None


def builtin_prepare_defaults() -> PrepareFlags:
    """The prepare defaults where no controller's ``[defaults]`` table decides: the
    controller's own built-in ones (``controller.config.PrepareDefaults``, ``Deadlines.drain``),
    so that ``agent prepare`` and ``drill`` prepare exactly as a ``cycle`` does against a
    controller whose file has no ``[defaults]``."""
    from ckpt_controller.controller.config import Deadlines, PrepareDefaults

    d = PrepareDefaults()
    return PrepareFlags(drain=d.drain, drain_timeout_s=Deadlines().drain,
                        on_deadline=d.on_deadline, level=d.level,
                        tags=None if d.tags is None else list(d.tags))


def prepare_flags(args: argparse.Namespace, controller: bool) -> PrepareFlags:
    """The one place a command's prepare flags become parameters. Against a controller
    (``controller``): a flag not given stays ``None`` and the controller's ``[defaults]``
    (merged with the engine's own) decide; without one (``agent prepare``, and ``drill``,
    which writes its controller's ``[defaults]`` from these): the built-in defaults fill it."""
    tags = None
    if getattr(args, "tags", None) is not None:
        tags = [t for t in args.tags.split(",") if t]
        if not tags:
            raise UsageError("--tags needs at least one tag", value=args.tags)
    given = PrepareFlags(drain=getattr(args, "drain", None),
                         drain_timeout_s=getattr(args, "drain_timeout", None),
                         on_deadline=getattr(args, "on_deadline", None),
                         level=getattr(args, "level", None), tags=tags)
    if controller:
        return given
    base = builtin_prepare_defaults()
    level = given.level
    if level is None and tags is None:
        level, tags = base.level, base.tags
    return PrepareFlags(
        drain=base.drain if given.drain is None else given.drain,
        drain_timeout_s=(base.drain_timeout_s if given.drain_timeout_s is None
                         else given.drain_timeout_s),
        on_deadline=base.on_deadline if given.on_deadline is None else given.on_deadline,
        level=level, tags=tags)


#: the help texts of the prepare flags, shared by every command that has them
PREPARE_HELP = {
    "drain": "wait: let requests finish; abort: end them now; keep: freeze them to finish "
             "after restore (default: the controller's [defaults], else wait)",
    "drain_timeout": "seconds a wait drain may take (default: the controller's "
                     "deadlines.drain, else 30)",
    "on_deadline": "what a wait drain does at its deadline (default: the controller's "
                   "[defaults], else abort)",
    "level": "0 release nothing; 1 offload weights, discard the KV cache; 2 discard both, "
             "reload weights from file (default: the controller's [defaults], else 2)",
    "tags": "release these tags instead of a level",
}


def prepare_opts(sp: argparse.ArgumentParser, *, drain_timeout=None) -> None:
    """The prepare parameters (``prepare``, ``cycle``, their ``fleet`` twins, ``agent
    prepare``); each defaults to ``None``, resolved by ``prepare_flags``."""
    from ckpt_controller.vocab import DrainMode, Escalation, ReleaseLevel

    sp.add_argument("--drain", **word_arg(DrainMode), help=PREPARE_HELP["drain"])
    sp.add_argument("--drain-timeout", type=drain_timeout or duration, metavar="S",
                    help=PREPARE_HELP["drain_timeout"])
    sp.add_argument("--on-deadline", **word_arg(Escalation), help=PREPARE_HELP["on_deadline"])
    what = sp.add_mutually_exclusive_group()
    what.add_argument("--level", **word_arg(ReleaseLevel), help=PREPARE_HELP["level"])
    what.add_argument("--tags", metavar="TAG,...", help=PREPARE_HELP["tags"])
    sp.add_argument("--budget", type=parse_bytes, metavar="SIZE",
                    help="largest residual memory allowed after release; more fails the "
                         "prepare, which is rolled back (default: the controller's "
                         "[defaults], else none)")


def operation_params(args: argparse.Namespace) -> dict:
    """An operation's parameters from its flags (``OperationCommand`` fields)."""
    from ckpt_controller.vocab import OperationKind

    params: dict = {"deadline_s": args.deadline}
    if args.op in (OperationKind.PREPARE, OperationKind.CYCLE):
        flags = prepare_flags(args, controller=True)
        params.update(drain=flags.drain, drain_timeout_s=flags.drain_timeout_s,
                      on_deadline=flags.on_deadline, level=flags.level, tags=flags.tags,
                      residual_budget_bytes=args.budget)
    if args.op == OperationKind.PREPARE and hasattr(args, "no_all_or_nothing"):
        params["all_or_nothing"] = not args.no_all_or_nothing
    if args.op == OperationKind.ROLLBACK:
        params["reason"] = args.reason
    if args.op == OperationKind.RESTORE:
        params["image"] = args.image
        if getattr(args, "accept", None):
            params["accept"] = args.accept
    return params


def field_list(text: str) -> list[str]:
    """``a,b,c`` as a list (the controller says which names it does not know)."""
    return [f.strip() for f in text.split(",") if f.strip()]


def add_accept_arg(sp: argparse.ArgumentParser, host: str) -> None:
    """``--accept FIELD,...``: the fields of an image's manifest a restore on ``host`` (as a
    person reads it) may differ in."""
    sp.add_argument("--accept", metavar="FIELD,...", type=field_list, default=[],
                    help=f"restore although the image's manifest differs from {host} in these "
                         "fields (kernel, criu, cpu_isa, ..., or manifest for a damaged one: "
                         "`ckptctl images inspect` shows them; docs/controller.md)")


# ---------------------------------------------------------------- human output


def age(seconds: float) -> str:
    """kubectl's way: 45s, 3m12s, 5h4m, 2d3h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the header first) as kubectl prints them: columns two spaces apart, each as
    wide as its widest cell, no trailing blanks; a cell never holds a line break."""
    cells = [[str(c).replace("\n", " ") for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in cells)


#: ``status``'s columns (``agent status`` prints the same); ``-o wide`` adds ``WIDE_COLUMNS``
STATUS_COLUMNS = ("NAME", "STATE", "GEN", "IN-FLIGHT", "PID", "HELD-BY", "LAST-OP", "AGE")
WIDE_COLUMNS = ("KIND", "API", "KEPT", "ENDPOINT", "REGISTERED", "RELEASED", "IMAGE", "IMAGES",
                "ERROR")


def status_row(name: str, status: p.StatusReply | None, *, now: float, state: str = "",
               holder: str | None = None, last_op: str | None = None, kind: str = "-",
               endpoint: str = "-", error: str = "", images: int | None = None,
               wide: bool = False) -> tuple[str, ...]:
    """One engine's row of ``STATUS_COLUMNS`` (and ``WIDE_COLUMNS`` with ``wide``) from its
    agent's ``status``; ``None`` when the agent did not answer (``state`` then says why, and
    the columns it would have given are ``-``). AGE is the time since its last transition;
    IMAGES the disk its capture images take (``images``)."""
    dash = "-"
    if status is None:
        row: tuple[str, ...] = (name, state or "UNREACHABLE", dash, dash, dash, holder or dash,
                                last_op or dash, dash)
        more = (kind, dash, dash, endpoint, dash, dash, dash,
                dash if images is None else human_bytes(images), error or dash)
    else:
        t = status.last_transition
        row = (name, state or str(status.state), str(status.generation), str(status.in_flight),
               str(status.pid), holder or dash, last_op or dash,
               dash if t is None else age(now - t.wall))
        released = [tag for tag in status.released_tags]
        image = (f"restored ({status.incarnation})" if status.restored_from_image else dash)
        more = (kind, status.api or dash, str(status.kept),
                status.endpoints.get("control", endpoint),
                human_bytes(sum(status.registered_bytes.values())),
                ",".join(released) or dash, image,
                dash if images is None else human_bytes(images), error or dash)
    return row + more if wide else row


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
        if result.api is not None:
            lines.append(f"  driven through {result.api}"
                         + (f" ({result.api_detail})" if result.api_detail else ""))
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


@contextlib.contextmanager
def goes_on_if_interrupted(op_id: str, where: str, follow: str) -> Iterator[None]:
    """Around the call that waits for operation ``op_id``: on Ctrl-C, say on stderr that the
    operation goes on in ``where`` (the controller, the agent), which command (``follow``)
    shows where it got, and that the same ``--op-id`` again waits for its result; then the
    ``KeyboardInterrupt`` goes on up (``main`` returns 130)."""
    try:
        yield
    except KeyboardInterrupt:
        # policy: only this command stops; the operation goes on: say which and how to
        # follow it (main returns 130)
        print(f"\ninterrupted: operation {op_id} goes on in the {where}; follow it with "
              f"`{follow}` (the same --op-id again waits for its result)", file=sys.stderr)
        raise


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


def add_etcd_args(parser: argparse.ArgumentParser) -> None:
    """The root's etcd options, for ``fleet`` (``cli.fleet_cmd``)."""
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


def controller_client(args: argparse.Namespace, **kw):
    """A ``ControllerClient`` of ``--controller``, with ``--curve-key``'s keys."""
    from ckpt_controller.controller.client import ControllerClient

    return ControllerClient(args.controller, curve=curve_client(args), **kw)


def waiting_notice(line: str) -> None:
    """A request that has waited a while says so on stderr (never stdout: ``--json`` prints
    only its document there)."""
    print(f"ckptctl: {line}", file=sys.stderr, flush=True)


def curve_client(args: argparse.Namespace):
    from ckpt_controller.security import CurveClient, load

    if (args.curve_key is None) != (args.curve_server_key is None):
        raise UsageError("--curve-key and --curve-server-key go together")
    if args.curve_key is None:
        return None
    load(args.curve_key, secret=True, what="--curve-key")
    load(args.curve_server_key, secret=False, what="--curve-server-key")
    return CurveClient(args.curve_key, args.curve_server_key)
