"""What a valid duration, operation id, rate, count, byte size and rolling limit are, said
once.

Every way in applies the same rules: the command line (``cli.common.arg_type`` turns a rule
into an argparse ``type=``: exit 2 with the flag and the value), the Python clients (``check``
raises ``UsageError`` naming the field and the value before anything is sent; a Python caller
gives a number as a number: the text the command line parses, ``"5"``, is refused, except a
size's, whose units have no other form: ``"512MiB"``) and the wire
(the ``Annotated`` types below carry ``msgspec.Meta`` constraints in the protocol Structs, so
a hand-built frame with such a value is answered with a ``ProtocolError``). NaN and infinity
are never a number here; every duration has an upper bound (a day).

A low-level module: it imports only ``errors`` and ``units``. Neighbours: ``protocol`` (the
Structs use the types), ``rpc`` and the clients (``check``), ``cli.common`` (argparse types).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from msgspec import Meta

from ckpt_controller import units
from ckpt_controller.errors import UsageError

#: the longest duration anything here accepts: a day
MAX_DURATION_S = 86_400.0
#: an operation id names an image folder: letters, digits, '.', '_', '-'; a letter or digit first
#: (patterns end in \Z: msgspec matches with re.search, and "$" would accept a final newline)
MAX_OP_ID_LENGTH = 128
#: names an operation id may not take: its image folder would alias ``<image_dir>/<engine>/
#: latest``, the link criu-restore restores from by default
RESERVED_OP_IDS = frozenset({"latest"})
OP_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z"
#: the ids a controller sends an agent for one step: ``<op id>/<engine>/<step>``
MAX_STEP_OP_ID_LENGTH = 256
STEP_OP_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*\Z"
#: requests per second a load may send
MAX_RATE = 10_000.0
#: the largest byte size (1 EiB); msgpack integers end at 2**64
MAX_BYTES = 1 << 60
#: the largest count (tokens, blocks, engines, records...)
MAX_COUNT = 1 << 31
#: free text that travels with a request (a reason, a client name)
MAX_TEXT_LENGTH = 64 << 10
MAX_NAME_LENGTH = 64
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z"

# ------------------------------------------------------------- wire types (msgspec constraints)

#: seconds, > 0 and at most a day (NaN and infinity fail both bounds)
Duration = Annotated[float, Meta(gt=0, le=MAX_DURATION_S)]
#: seconds, >= 0 (0: at once) and at most a day
DurationOrZero = Annotated[float, Meta(ge=0, le=MAX_DURATION_S)]
OpId = Annotated[str, Meta(min_length=1, max_length=MAX_OP_ID_LENGTH, pattern=OP_ID_PATTERN)]
StepOpId = Annotated[str, Meta(min_length=1, max_length=MAX_STEP_OP_ID_LENGTH,
                               pattern=STEP_OP_ID_PATTERN)]
ByteSize = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
Count = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
Percent = Annotated[int, Meta(ge=1, le=100)]
Level = Annotated[int, Meta(ge=0, le=2)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_LENGTH)]
#: an engine name (as ``endpoints.check_name`` checks it)
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)]
#: a memory tag (``weights``, ``kv_cache`` or one an engine defines)
Tag = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_LENGTH)]
#: engines named in one request: at most this many
Names = Annotated[list[Name], Meta(max_length=4096)]
Tags = Annotated[list[Tag], Meta(max_length=256)]
#: the hook settings an operation may set for its own hooks (a fleet migration's capture and
#: restore): only these keys, each a short printable value; never options passed to criu
#: as they are (CKPT_CRIU_EXTRA), nor a path to restore from
HookEnvKey = Literal["CKPT_CRIU_MODE", "CKPT_PAGE_SERVER", "CKPT_CRIU_BESIDE"]
HookEnvValue = Annotated[str, Meta(max_length=256, pattern=r"^[A-Za-z0-9_.:\[\]-]*$")]
HookEnv = Annotated[dict[HookEnvKey, HookEnvValue], Meta(max_length=8)]


# ------------------------------------------------------------- rules for people and clients


@dataclass(frozen=True)
class Rule:
    """One kind of value: ``parse`` returns it normalized or raises ``ValueError`` with what
    a valid one looks like. ``parse`` takes the command line's text as well; ``takes`` are
    the Python types ``check`` lets through to it (``said``: them in words)."""

    name: str
    parse: Callable[[Any], Any]
    takes: tuple[type, ...] = (str,)
    said: str = "text"


#: what a Python caller gives for a number of seconds or a rate; for a count
_NUMBER = {"takes": (int, float), "said": "a number (int or float), not text"}
_WHOLE = {"takes": (int,), "said": "an int, not text or a float"}


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("not a number")
    try:
        number = float(value)
    except (ValueError, OverflowError):  # policy: the caller gets the rule, not float's text
        raise ValueError("not a number") from None
    if not math.isfinite(number):
        raise ValueError("not a finite number")
    return number


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("not a whole number")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ValueError("not a whole number")


def _duration(lo_ok: bool) -> Callable[[Any], float]:
    want = (f"a number of seconds {'>=' if lo_ok else '>'} 0 and at most "
            f"{MAX_DURATION_S:.0f} (a day)")

    def parse(value: Any) -> float:
        try:
            seconds = _number(value)
        except ValueError as err:  # policy: say what is wanted
            raise ValueError(f"{err}; give {want}") from None
        if seconds < 0 or (seconds == 0 and not lo_ok) or seconds > MAX_DURATION_S:
            raise ValueError(f"out of range; give {want}")
        return seconds
    return parse


def _rate(value: Any) -> float:
    want = f"a number of requests per second > 0 and at most {MAX_RATE:.0f}"
    try:
        rate = _number(value)
    except ValueError as err:  # policy: say what is wanted
        raise ValueError(f"{err}; give {want}") from None
    if not 0 < rate <= MAX_RATE:
        raise ValueError(f"out of range; give {want}")
    return rate


def _count(lo: int, hi: int) -> Callable[[Any], int]:
    want = f"a whole number from {lo} to {hi}"

    def parse(value: Any) -> int:
        try:
            n = _integer(value)
        except ValueError as err:  # policy: say what is wanted
            raise ValueError(f"{err}; give {want}") from None
        if not lo <= n <= hi:
            raise ValueError(f"out of range; give {want}")
        return n
    return parse


def _bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        n = units.parse_bytes(value)  # ValueError names the units
    else:
        raise ValueError("not a size (e.g. 1073741824, 512MiB, 2GiB)")
    if not 0 <= n <= MAX_BYTES:
        raise ValueError("out of range; give a size from 0 to 1 EiB (2**60 bytes)")
    return n


def _op_id(pattern: str, limit: int, slash: bool) -> Callable[[Any], str]:
    chars = "letters, digits, '.', '_', '-'" + (", '/'" if slash else "")
    want = f"1 to {limit} {chars}, starting with a letter or digit"
    allowed = re.compile(pattern)

    def parse(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"empty; give {want}")
        if len(value) > limit:
            raise ValueError(f"{len(value)} characters long; give {want}")
        if not allowed.fullmatch(value):
            raise ValueError(f"has characters that are not allowed; give {want}")
        if value in RESERVED_OP_IDS:
            raise ValueError("is reserved (the name of the image link); give another")
        return value
    return parse


DURATION = Rule("duration", _duration(lo_ok=False), **_NUMBER)
DURATION_OR_ZERO = Rule("duration", _duration(lo_ok=True), **_NUMBER)
RATE = Rule("rate", _rate, **_NUMBER)
COUNT = Rule("count", _count(1, MAX_COUNT), **_WHOLE)
TOKEN_ID = Rule("token id", _count(0, MAX_COUNT - 1), **_WHOLE)
BYTES = Rule("size", _bytes, takes=(int, str), said="an int of bytes or a size such as '512MiB'")
OP_ID = Rule("operation id", _op_id(OP_ID_PATTERN, MAX_OP_ID_LENGTH, slash=False))
STEP_OP_ID = Rule("operation id", _op_id(STEP_OP_ID_PATTERN, MAX_STEP_OP_ID_LENGTH, slash=True))


@dataclass(frozen=True)
class Limit:
    """How many engines a rolling operation may have out of service at once: ``value``
    engines, or ``value`` percent of those it acts on (rounded down, at least one), as
    kubectl's ``maxUnavailable``."""

    value: int
    percent: bool = False

    def of(self, engines: int) -> int:
        """The limit for an operation on ``engines`` engines."""
        return max(1, engines * self.value // 100) if self.percent else self.value

    def __str__(self) -> str:
        return f"{self.value}%" if self.percent else str(self.value)


def _limit(value: Any) -> Limit:
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            n = _integer(value.strip()[:-1])
        except ValueError:
            raise ValueError("not N or P%; give a whole number from 1, or a percentage from "
                             "1% to 100%") from None
        if not 1 <= n <= 100:
            raise ValueError("out of range; give a percentage from 1% to 100%")
        return Limit(n, percent=True)
    try:
        return Limit(_count(1, MAX_COUNT)(value))
    except ValueError as err:  # policy: say both forms
        raise ValueError(f"{err}, or a percentage such as 25%") from None


#: the rolling limit of a cycle (node-local or fleet) that names none: a quarter of its
#: engines, at least one; ``100%`` takes them all out at once (docs/cli.md)
DEFAULT_MAX_UNAVAILABLE = Limit(25, percent=True)
MAX_UNAVAILABLE = Rule("limit", _limit, takes=(int, str),
                       said="an int of engines or a percentage such as '25%'")


def count(lo: int = 1, hi: int = MAX_COUNT) -> Rule:
    """A count with its own bounds (e.g. ``count(1, 100_000)`` for a history limit)."""
    return Rule("count", _count(lo, hi), **_WHOLE)


def shown(value: Any) -> str:
    """``value`` as an error message shows it: its repr, cut short when long."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(value)} characters)" \
        if isinstance(value, str) else f"{text[:60]}..."


def check(rule: Rule, value: Any, field: str) -> Any:
    """``value`` from a Python caller normalized by ``rule``, or ``UsageError`` naming
    ``field`` and the value; a value of a type the rule does not take (``"5"`` seconds,
    ``2.0`` as a count) is refused so, whatever ``parse`` would make of it."""
    try:
        if not isinstance(value, rule.takes):
            raise ValueError(f"{type(value).__name__} given; give {rule.said}")
        return rule.parse(value)
    except ValueError as err:  # policy: a bad value is the caller's to fix (exit 2)
        raise UsageError(f"{field} = {shown(value)} is not a valid {rule.name}: {err}",
                         field=field, value=shown(value)) from None


def check_optional(rule: Rule, value: Any, field: str) -> Any:
    """``check``, with ``None`` passed through (a value left to the default)."""
    return None if value is None else check(rule, value, field)

