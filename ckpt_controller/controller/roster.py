"""Engines a controller adopted or gave away: their journal rows, checked, and the roster they
make with the TOML's engines.

An adopted engine is driven as if its TOML named it, so its whole ``EngineConfig`` (control
endpoint, kind, labels, prepare defaults, CURVE key file) goes into the journal's ``roster``
table as an ``AdoptedEngine`` (msgpack); a given-away one keeps the configuration it had when
it left, for ``status`` to show. ``check`` refuses an engine configuration the TOML's own
checks would refuse (names, endpoints, defaults, key files), so a bad ``adopt`` is a
``UsageError`` naming the value, and a malformed row found at start a ``ConfigError`` naming
the journal, the row and the problem. ``replay`` builds the roster a starting controller
begins with; ``adopted`` and ``given_away`` make the next one while it runs.
Neighbours: ``config`` (``EngineConfig``, ``Roster``, ``Moved``), ``journal`` (the table),
``service`` (``Controller.adopt`` and ``give_away``), ``endpoints`` and ``security`` (checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from ckpt_controller.controller.config import ControllerConfig, EngineConfig, Moved, Roster
from ckpt_controller.endpoints import check_endpoint, check_name
from ckpt_controller.errors import ConfigError, UsageError
from ckpt_controller.vocab import DrainMode, EngineKind, Escalation, ReleaseLevel, RosterChange


class AdoptedDefaults(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An engine's own prepare defaults (``EngineConfig.defaults``): only those it gave."""

    drain: DrainMode | UnsetType = UNSET
    on_deadline: Escalation | UnsetType = UNSET
    level: ReleaseLevel | None | UnsetType = UNSET
    tags: tuple[str, ...] | UnsetType = UNSET
    residual_budget_bytes: Annotated[int, Meta(ge=0)] | UnsetType = UNSET


class AdoptedEngine(msgspec.Struct, kw_only=True):
    """One engine's configuration as the journal keeps it. New fields only at the end, with
    defaults (a journal outlives a controller version)."""

    name: str
    control: str
    kind: EngineKind
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    defaults: AdoptedDefaults = msgspec.field(default_factory=AdoptedDefaults)
    curve_server_key: str | None = None


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(AdoptedEngine)


def encode(engine: EngineConfig, config: ControllerConfig) -> bytes:
    """``engine`` checked (``check``) and encoded for the journal; ``UsageError`` naming
    the value that is refused."""
    unknown = sorted(set(engine.defaults) - set(AdoptedDefaults.__struct_fields__))
    if unknown:
        raise UsageError(f"engine {engine.name!r} cannot be adopted: unknown defaults "
                         f"{', '.join(unknown)} (known: "
                         f"{', '.join(AdoptedDefaults.__struct_fields__)})",
                         engine=engine.name, unknown=unknown)
    try:
        row = msgspec.convert(
            {"name": engine.name, "control": engine.control, "kind": engine.kind,
             "labels": dict(engine.labels), "defaults": dict(engine.defaults),
             "curve_server_key": None if engine.curve_server_key is None
             else str(engine.curve_server_key)}, AdoptedEngine)
    except msgspec.ValidationError as err:  # policy: a bad value, said with the engine
        raise UsageError(f"engine {engine.name!r} cannot be adopted: {err}",
                         engine=engine.name, problem=str(err)) from None
    problem = check(row, config)
    if problem is not None:
        raise UsageError(f"engine {engine.name!r} cannot be adopted: {problem}",
                         engine=engine.name, problem=problem)
    return _enc.encode(row)


def decode(data: bytes | None, config: ControllerConfig, where: dict) -> EngineConfig:
    """The engine a journal row keeps; ``ConfigError`` naming the row (``where``: journal
    file, seq, engine) when it is malformed or names a value the checks refuse."""
    try:
        if data is None:
            raise msgspec.DecodeError("the row has no engine configuration")
        row = _dec.decode(data)
    except msgspec.DecodeError as err:  # policy: a damaged row stops the start, said exactly
        problem = str(err)
    else:
        problem = check(row, config)
        if problem is None and row.name != where["engine"]:
            problem = f"its configuration names engine {row.name!r}"
        if problem is None:
            return EngineConfig(
                name=row.name, control=row.control, kind=row.kind, labels=dict(row.labels),
                defaults={k: v for k, v in msgspec.structs.asdict(row.defaults).items()
                          if v is not UNSET},
                curve_server_key=Path(row.curve_server_key) if row.curve_server_key else None)
    raise ConfigError(f"journal: the roster row {where['seq']} of engine {where['engine']!r} "
                      f"is malformed: {problem}; the controller does not start with it (move "
                      "the state directory's journal aside, or delete that row)",
                      key="roster", problem=problem, **where)


def check(row: AdoptedEngine, config: ControllerConfig) -> str | None:
    """What the TOML's checks would refuse in ``row``, in words; None when it is fine."""
    try:
        check_name(row.name)
        check_endpoint(row.control)
    except ConfigError as err:  # policy: one rule for names and endpoints; said here
        return f"{err.message}, got {err.details.get('name') or err.details.get('endpoint')!r}"
    rest = row.control.split("://", 1)[1]  # never empty: ``check_endpoint`` refuses that
    if row.control.startswith("ipc://") and not rest.startswith(("/", "@")):
        return f"control must be an absolute ipc path (no file to resolve it against): " \
               f"{row.control!r}"
    d = row.defaults
    if d.level not in (UNSET, None) and d.tags is not UNSET:
        return "defaults: level and tags exclude each other"
    if d.tags is not UNSET and len(set(d.tags)) != len(d.tags):
        return f"defaults: tags must differ, got {list(d.tags)!r}"
    if row.curve_server_key is not None:
        from ckpt_controller.security import load

        if config.curve_secret_key is None:
            return "a curve_server_key needs the controller's own curve_secret_key"
        try:
            load(row.curve_server_key, secret=False)
        except ConfigError as err:  # policy: an unreadable key file, said with the engine
            return err.message
    return None


def replay(config: ControllerConfig, rows: list[tuple], journal: str) -> Roster:
    """The roster a controller starts with: the TOML's engines, with each engine's newest
    journal row applied (adopted: driven with the row's configuration; given away: shown
    as moved). ``ConfigError`` for a malformed row."""
    driven = {e.name: e for e in config.engines}
    moved: dict[str, Moved] = {}
    for seq, engine, change, op_id, peer, wall, data in rows:
        where = {"file": journal, "seq": seq, "engine": engine}
        if change not in tuple(RosterChange):
            raise ConfigError(f"journal: the roster row {seq} of engine {engine!r} is "
                              f"malformed: unknown change {change!r}", key="roster",
                              problem=f"unknown change {change!r}", **where)
        eng = decode(data, config, where)
        if change == RosterChange.ADOPTED:
            driven.pop(engine, None)  # adopted back: the row's configuration is the one
            driven[engine] = eng
        else:
            driven.pop(engine, None)
            moved[engine] = Moved(engine=eng, to=peer, op_id=op_id, wall=wall)
    return Roster.of(driven.values(), moved)


def adopted(roster: Roster, engine: EngineConfig) -> Roster:
    """``roster`` with ``engine`` driven (and no longer shown as moved)."""
    engines = [e for e in roster.engines if e.name != engine.name] + [engine]
    return Roster.of(engines, {k: v for k, v in roster.moved.items() if k != engine.name})


def given_away(roster: Roster, name: str, to: str, op_id: str, wall: float) -> Roster:
    """``roster`` without ``name`` driven, shown as moved to ``to`` by ``op_id``."""
    engine = roster.by_name[name]
    return Roster.of([e for e in roster.engines if e.name != name],
                     {**roster.moved, name: Moved(engine=engine, to=to, op_id=op_id,
                                                  wall=wall)})
