"""The controller's TOML file as msgspec Structs, and msgspec's complaints said as ``ConfigError``.

Each table of the file is a Struct with ``forbid_unknown_fields``; each key's type carries its
constraint (``values``' durations, sizes and tags, ``vocab``'s enums, a ``msgspec.Meta``) and,
as the Meta's ``description``, what a valid value is in words. Every key defaults to ``UNSET``:
a table says only what the file gave (``given``), and the defaults live once, in ``config``'s
dataclasses. ``convert`` turns ``tomllib``'s result into a ``FileTable`` with
``msgspec.convert``; its ``ValidationError`` (msgspec stops at the first problem) becomes a
``ConfigError`` naming the file, the dotted key (``engine[2].defaults.level``; ``engine[2]`` is
the third ``[[engine]]`` table) and the problem: the value and what was wanted, "is required",
or an unknown key with the closest known one ("did you mean").

Neighbours: ``values`` and ``vocab`` below (types, enums); ``config`` above, the only user,
which checks what msgspec cannot say (see its docstring).
"""

from __future__ import annotations

import difflib
import enum
import functools
import re
import reprlib
import types
import typing
from typing import Annotated, Any, Union, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from ckpt_controller import values
from ckpt_controller.errors import ConfigError
from ckpt_controller.vocab import (
    DrainMode,
    EngineKind,
    Escalation,
    RecoverUncaptured,
    ReleaseLevel,
)

Seconds = Annotated[values.Duration, Meta(description=(
    f"a finite number of seconds, at most {values.MAX_DURATION_S:.0f} (a day) and > 0"))]
Text = Annotated[str, Meta(min_length=1, description="a non-empty string")]
Port = Annotated[int, Meta(ge=0, le=65535,
                           description="an integer port in 0..65535 (0: any free port)")]
Beats = Annotated[int, Meta(ge=1, le=1000, description="an integer >= 1 and <= 1000")]
#: how often the controller does a thing of its own (heartbeats, reconciling): not so often
#: it would spin (``5e-324`` once took 17% of a core doing nothing)
Interval = Annotated[float, Meta(ge=0.01, le=values.MAX_DURATION_S, description=(
    f"a finite number of seconds, at least 0.01 and at most {values.MAX_DURATION_S:.0f} "
    "(a day)"))]
Flag = Annotated[bool, Meta(description="true or false")]
#: the wire's tags (``values.Tags``: at most 256, each at most 64 characters), at least one;
#: distinctness is checked after the conversion (msgspec has no such constraint)
Tags = Annotated[values.Tags, Meta(min_length=1, description=(
    "a non-empty array of distinct non-empty strings (at most 256, each at most "
    f"{values.MAX_NAME_LENGTH} characters)"))]
#: the wire's byte sizes; a size string is parsed after the conversion (``values.BYTES``)
Size = Annotated[values.ByteSize | str, Meta(description=(
    "a number of bytes >= 0 and at most 2**60 (1 EiB) or a size string such as 512MiB"))]


#: engine labels: selectors match them (``fleet --selector KEY=VALUE``); shaped as Kubernetes
#: labels are, so that an operator on the same data can use them as they are
LabelKey = Annotated[str, Meta(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")]
LabelValue = Annotated[str, Meta(pattern=r"^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$")]
Labels = Annotated[dict[LabelKey, LabelValue], Meta(max_length=64, description=(
    "a table of at most 64 labels, each key 1-63 letters, digits, '.', '_', '-' or '/' and "
    "each value at most 63 letters, digits, '.', '_' or '-', both starting and ending with a "
    "letter or digit"))]
#: etcd endpoints: one URL or several (members of one cluster), checked by ``config``
EtcdUrls = Annotated[str | Annotated[list[Text], Meta(min_length=1, max_length=16)], Meta(
    description="an http:// or https:// URL with host and port, or an array of 1 to 16 such")]
LeaseTtl = Annotated[int, Meta(ge=2, le=3600, description="an integer of seconds, 2..3600")]


class _Table(Struct, frozen=True, forbid_unknown_fields=True):
    """A TOML table: an unknown key is an error."""


class ControllerTable(_Table):
    """``[controller]``; paths and endpoints are resolved by ``config``."""

    endpoint: Text | UnsetType = UNSET
    state_dir: Text | UnsetType = UNSET
    hooks_dir: Text | UnsetType = UNSET
    image_dir: Text | UnsetType = UNSET
    metrics_port: Port | UnsetType = UNSET
    metrics_host: Text | UnsetType = UNSET
    heartbeat_interval_s: Interval | UnsetType = UNSET
    missed_beats: Beats | UnsetType = UNSET
    reconcile_interval_s: Interval | UnsetType = UNSET
    curve_secret_key: Text | UnsetType = UNSET
    curve_clients: Text | UnsetType = UNSET
    require_dump: Flag | UnsetType = UNSET
    recover_uncaptured: RecoverUncaptured | UnsetType = UNSET
    criu_action_scripts: Annotated[list[Text], Meta(max_length=16, description=(
        "at most 16 paths"))] | UnsetType = UNSET


class DeadlinesTable(_Table):
    """``[deadlines]``: the fields of ``config.Deadlines``."""

    drain: Seconds | UnsetType = UNSET
    release: Seconds | UnsetType = UNSET
    capture: Seconds | UnsetType = UNSET
    restore: Seconds | UnsetType = UNSET
    hook: Seconds | UnsetType = UNSET
    operation: Seconds | UnsetType = UNSET
    hook_grace: Seconds | UnsetType = UNSET
    probe: Seconds | UnsetType = UNSET


class DefaultsTable(_Table):
    """``[defaults]`` and ``[engine.defaults]``: prepare parameters."""

    drain: DrainMode | UnsetType = UNSET
    on_deadline: Escalation | UnsetType = UNSET
    level: ReleaseLevel | UnsetType = UNSET
    tags: Tags | UnsetType = UNSET
    residual_budget: Size | UnsetType = UNSET


class EngineTable(_Table):
    """One ``[[engine]]``; its name and endpoint are checked by ``config``."""

    name: Text
    control: Text
    kind: EngineKind | UnsetType = UNSET
    defaults: DefaultsTable = DefaultsTable()
    curve_server_key: Text | UnsetType = UNSET
    labels: Labels | UnsetType = UNSET


class FleetTable(_Table):
    """``[fleet]``: the node's registration in etcd (``fleet.config``'s fields)."""

    etcd: EtcdUrls
    node: Text | UnsetType = UNSET
    address: Text | UnsetType = UNSET
    prefix: Text | UnsetType = UNSET
    lease_ttl_s: LeaseTtl | UnsetType = UNSET
    publish_interval_s: Interval | UnsetType = UNSET
    coordinator: Flag | UnsetType = UNSET
    keep_days: Annotated[float, Meta(gt=0, le=36500, description=(
        "a number of days > 0 and at most 36500"))] | UnsetType = UNSET
    ca_cert: Text | UnsetType = UNSET
    cert: Text | UnsetType = UNSET
    key: Text | UnsetType = UNSET


class MigrationTable(_Table):
    """``[migration]``: how engines move to and from this node (``fleet migrate``)."""

    image_transport: Annotated[Literal["page-server", "shared"], Meta(
        description='"page-server" or "shared"')] | UnsetType = UNSET
    shared_dir: Text | UnsetType = UNSET
    page_server_port: Port | UnsetType = UNSET
    digest_ahead: Flag | UnsetType = UNSET


class JournalTable(_Table):
    """``[journal]``: how long the journal keeps ended operations (``config.JournalConfig``)."""

    keep_days: Annotated[float, Meta(gt=0, le=36500, description=(
        "a number of days > 0 and at most 36500"))] | UnsetType = UNSET
    keep_operations: Annotated[int, Meta(ge=1, le=10**9, description=(
        "an integer >= 1 and at most 1000000000"))] | UnsetType = UNSET


class ImagesTable(_Table):
    """``[images]``: how many capture images each engine keeps (``config.ImagesConfig``)."""

    keep: Annotated[int, Meta(ge=1, le=10**6, description=(
        "an integer >= 1 and at most 1000000 (the newest image is never removed)"))] \
        | UnsetType = UNSET


class FileTable(_Table):
    """The whole file."""

    controller: ControllerTable = ControllerTable()
    deadlines: DeadlinesTable = DeadlinesTable()
    defaults: DefaultsTable = DefaultsTable()
    engine: Annotated[list[EngineTable],
                      Meta(description="an array of tables: [[engine]]")] = []
    fleet: FleetTable | UnsetType = UNSET
    migration: MigrationTable = MigrationTable()
    journal: JournalTable = JournalTable()
    images: ImagesTable = ImagesTable()


def given(table: _Table) -> dict[str, Any]:
    """The keys ``table``'s TOML gave, with their converted values."""
    return {name: value for name in table.__struct_fields__
            if (value := getattr(table, name)) is not UNSET}


def error(file: str, key: str | None, problem: str, **extra: Any) -> ConfigError:
    """The one shape of a config problem: ``<file>: <key>: <problem>``."""
    where = f"{file}: {key}" if key else file
    return ConfigError(f"{where}: {problem}", file=file, key=key, problem=problem, **extra)


def convert(data: dict[str, Any], file: str) -> FileTable:
    """``data`` (what ``tomllib`` read from ``file``) as a ``FileTable``; ``ConfigError``
    naming the key for the first value msgspec refuses."""
    try:
        return msgspec.convert(data, FileTable)
    except msgspec.ValidationError as err:  # policy: said again with the file and dotted key
        raise _translate(str(err), data, file) from None


_AT = " - at `"
_FIELD = re.compile(r"Object (contains unknown|missing required) field `(.*)`", re.DOTALL)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _translate(message: str, data: dict[str, Any], file: str) -> ConfigError:
    """msgspec's ``message`` ("Expected `int` >= 1 - at `$.controller.missed_beats`") as a
    ``ConfigError``: the path becomes a dotted key, the wants come from the field's type."""
    what, at, path = message.rpartition(_AT)
    if not at:
        what, path = message, "$`"
    steps: list[str | int] = [int(i) if i else name for name, i in _STEP.findall(path[1:-1])]
    field = _FIELD.fullmatch(what)
    if field:
        steps.append(field.group(2))
    key, hint, value, table = _locate(steps, data)
    if field and field.group(1) == "missing required":
        return error(file, key, "is required")
    if hint is None:  # an unknown key in ``table``
        known = table.__struct_fields__
        close = difflib.get_close_matches(str(steps[-1]), known, n=1)
        suggest = f"did you mean {close[0]!r}? " if close else ""
        return error(file, key, f"unknown key; {suggest}known keys here: {', '.join(known)}")
    return error(file, key, _refusal(hint, value))


def refused(table: type[_Table], name: str, value: Any) -> str:
    """The problem with ``value`` at key ``name`` of ``table``: "must be <wants>, got <value>",
    for a check made after the conversion."""
    return _refusal(_hints(table)[name], value)


def _refusal(hint: Any, value: Any) -> str:
    return f"must be {_wants(hint)}, got {reprlib.repr(value)}"


def _locate(steps: list[str | int], data: Any) -> tuple[str, Any, Any, type[_Table]]:
    """Follow ``steps`` from the file's top table down to the key a problem belongs to:
    ``(dotted key, its type hint or None when unknown, the value the file gave, its table)``.
    A step into an array of tables goes on into that table; any other step below a key
    (``tags[1]``) belongs to that key, whose whole value the message shows."""
    table: type[_Table] = FileTable
    key, hint, value, i = "", None, data, 0
    while i < len(steps):
        name = str(steps[i])
        i += 1
        key = f"{key}.{name}" if key else name
        hint = _hints(table).get(name)
        value = value.get(name) if isinstance(value, dict) else None
        if hint is None:
            break
        inner = _plain(hint)
        if _is_table(inner) and i < len(steps):
            table = inner
            continue
        element = typing.get_args(inner)[0] if typing.get_origin(inner) is list else None
        if _is_table(element) and i + 1 < len(steps) and isinstance(steps[i], int):
            index = int(steps[i])
            i += 1
            key += f"[{index}]"
            value = value[index] if isinstance(value, list) and index < len(value) else None
            table = element
            continue
        break
    return key, hint, value, table


@functools.cache
def _hints(table: type[_Table]) -> dict[str, Any]:
    return typing.get_type_hints(table, include_extras=True)


def _without_unset(hint: Any) -> Any:
    """``hint`` without ``UNSET`` as an alternative (``Text | UnsetType`` -> ``Text``)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not UnsetType]
        if len(rest) == 1:
            return rest[0]
    return hint


def _plain(hint: Any) -> Any:
    """``hint`` without ``UNSET`` and without its ``Annotated`` metadata."""
    hint = _without_unset(hint)
    return _plain(typing.get_args(hint)[0]) if typing.get_origin(hint) is Annotated else hint


def _wants(hint: Any) -> str:
    """What a valid value of ``hint`` is, in words: the description its ``Meta`` gives, else
    the members of its enum, else "a table"."""
    hint = _without_unset(hint)
    if typing.get_origin(hint) is Annotated:
        described = [m.description for m in hint.__metadata__
                     if isinstance(m, Meta) and m.description]
        return described[-1] if described else _wants(typing.get_args(hint)[0])
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in hint)
    if _is_table(hint):
        return "a table"
    return str(hint)  # every key of the file has a case above


def _is_table(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, _Table)
