"""The controller's configuration: one TOML file read into frozen dataclasses, checked strictly.

Every problem (an unreadable file, invalid TOML, an unknown key, a wrong type, a bad value)
raises ``ConfigError`` whose ``details`` hold ``file``, ``key`` and ``problem``. Keys are dotted;
``engine[0]`` is the first ``[[engine]]`` table, so ``engine[2].control`` is the third one's.
Relative paths (and relative ``ipc://`` paths) resolve against the config file's directory.
Nothing is created on disk here except the private runtime directory that the default
endpoint lives in; the server creates the state and image directories.

The file's shape, types and ranges are ``config_schema``'s msgspec Structs (unknown keys,
wrong types, bounds, enums: msgspec checks them, ``config_schema`` words its error). What
msgspec cannot say is checked here, after the conversion, by small functions:
engine names and endpoints (``endpoints``' rules, shared with the agent side, whose messages
say more than a regex's), distinct tags (msgspec has no uniqueness constraint, and a set
would drop their order silently), ``level`` vs ``tags`` (two keys), size strings
(``values.BYTES``), paths relative to the file, CURVE key files (read from disk),
duplicate engine names and the defaults that depend on the environment.

Neighbours: ``config_schema`` (the file's Structs), ``endpoints`` (engine names, endpoint
schemes, the runtime dir) and ``values`` (sizes) below; the controller's server and
operations and ``ckptctl serve`` above.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from msgspec import UNSET

from ckpt_controller import values
from ckpt_controller.controller.config_schema import (
    DefaultsTable,
    EngineTable,
    FileTable,
    FleetTable,
    convert,
    error,
    refused,
    given,
)
from ckpt_controller.endpoints import check_endpoint, check_name, runtime_dir
from ckpt_controller.errors import ConfigError, UsageError
from ckpt_controller.files import UnfitFileError, read_small
from ckpt_controller.security import CurveClient
from ckpt_controller.vocab import (
    DrainMode,
    EngineKind,
    Escalation,
    RecoverUncaptured,
    ReleaseLevel,
)

#: the longest duration any key may give (a day): longer ones overflow timers and waits
MAX_SECONDS = values.MAX_DURATION_S
#: the largest config file read (a roster of thousands of engines is well under 1 MiB)
MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase may take; ``operation`` bounds one whole operation on one engine."""

    drain: float = 30.0
    release: float = 60.0
    capture: float = 600.0
    restore: float = 300.0
    hook: float = 60.0
    operation: float = 900.0
    #: a hook past its timeout gets SIGTERM, then this long before SIGKILL of its group
    hook_grace: float = 5.0
    #: how long an engine has to answer the one status request asked before an operation
    #: (``preflight``), for ``status`` and by the reconciler; slower is unreachable
    probe: float = 2.0


@dataclass(frozen=True)
class PrepareDefaults:
    """Defaults of prepare parameters. ``level`` and ``tags`` exclude each other (tags -> level None).

    These field defaults are the built-in ones (a file without ``[defaults]``), and also what
    ``ckptctl agent prepare`` and ``ckptctl drill`` use (``cli.common.prepare_flags``): one
    place, so that every command prepares alike."""

    drain: DrainMode = DrainMode.WAIT
    on_deadline: Escalation = Escalation.ABORT
    level: ReleaseLevel | None = ReleaseLevel.DISCARD
    tags: tuple[str, ...] | None = None
    residual_budget_bytes: int | None = None

    def merged(self, overrides: Mapping[str, Any]) -> PrepareDefaults:
        """These defaults with ``overrides`` (field name -> value) applied; giving one of
        ``level``/``tags`` clears the other."""
        changes = dict(overrides)
        if "tags" in changes:
            changes.setdefault("level", None)
        if "level" in changes:
            changes.setdefault("tags", None)
        return replace(self, **changes)


@dataclass(frozen=True)
class EngineConfig:
    """One engine: its agent's control endpoint, its kind, and its own prepare defaults.

    ``defaults`` holds only the overrides the engine's ``[engine.defaults]`` table gave, keyed by
    ``PrepareDefaults`` field names (``residual_budget`` becomes ``residual_budget_bytes``).
    """

    name: str
    control: str
    kind: EngineKind = EngineKind.NATIVE
    defaults: dict[str, Any] = field(default_factory=dict, hash=False)
    #: the agent's CURVE public key file: the controller connects with CURVE when set
    curve_server_key: Path | None = None
    #: labels the fleet registry publishes with the engine (``fleet --selector``)
    labels: dict[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class FleetConfig:
    """``[fleet]``: this node's registration in etcd; ``None`` in ``ControllerConfig`` when
    the file has no ``[fleet]`` (then nothing of the fleet layer is loaded)."""

    #: the etcd members' client URLs (http:// or https://), tried in turn
    etcd: tuple[str, ...]
    #: the node's name in the fleet (default: the host's name)
    node: str
    #: the address clients reach this node's engines at (an IP address or a host name;
    #: default: the host's name): published in place of an endpoint's wildcard host
    address: str = ""
    #: where the fleet's keys live in etcd
    prefix: str = "/ckpt"
    #: the node's lease: a node silent this long is gone, its engines' records say so
    lease_ttl_s: int = 5
    #: how often the node compares its engines with what etcd holds, and writes changes
    publish_interval_s: float = 0.5
    #: whether this node may be elected to drive fleet operations
    coordinator: bool = True
    #: ended fleet operations older than this are forgotten (``fleet.gc``, by the
    #: coordinator every hour, or ``ckptctl fleet gc``)
    keep_days: float = 7.0
    #: TLS: the CA that signed etcd's certificate; with https:// URLs
    ca_cert: Path | None = None
    #: TLS client certificate and its key (both or neither)
    cert: Path | None = None
    key: Path | None = None


@dataclass(frozen=True)
class MigrationConfig:
    """``[migration]``: how an engine's image reaches the node it moves to (``fleet
    migrate``; docs/fleet.md). The target node's setting decides."""

    #: ``page-server``: the memory pages stream straight into a ``criu page-server`` the
    #: target runs, the small rest goes through etcd; ``shared``: the source dumps into
    #: ``shared_dir``, which both nodes see at the same path
    image_transport: str = "page-server"
    shared_dir: Path | None = None
    #: the target's page server listens here (0: a free port, chosen per migration)
    page_server_port: int = 0
    #: digest, in the background, the weight files of every engine in the fleet that this
    #: node holds at the same path, not only its own engines' (``weights.Ahead``): a
    #: level-2 move here then reads none of them in its receive; each file once per change
    digest_ahead: bool = False


@dataclass(frozen=True)
class JournalConfig:
    """``[journal]``: the journal forgets an ended operation, with its records, once it is
    older than ``keep_days`` or beyond the newest ``keep_operations``, except what the
    controller still reads (``Journal.compact``); at start and every hour, or at once with
    ``ckptctl journal compact``."""

    keep_days: float = 90.0
    keep_operations: int = 100_000


@dataclass(frozen=True)
class ImagesConfig:
    """``[images]``: each engine keeps its newest ``keep`` good capture images (and what an
    operation still needs); the controller removes the others after each good capture, or
    at once with ``ckptctl images prune`` (``images.ImageStore``)."""

    keep: int = 3


@dataclass(frozen=True)
class ControllerConfig:
    """Everything the controller service needs; see the module docstring for the file format."""

    endpoint: str
    state_dir: Path
    hooks_dir: Path | None
    image_dir: Path
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    heartbeat_interval_s: float = 0.5
    missed_beats: int = 6
    #: how often engines that an operation lost contact with are looked at again
    reconcile_interval_s: float = 2.0
    #: an engine such an operation never began to capture, found FAILED (its sidecar came
    #: back and found it paused, say): RESUME restores it, LEAVE leaves it FAILED
    recover_uncaptured: RecoverUncaptured = RecoverUncaptured.RESUME
    #: the controller's CURVE secret key file (its identity towards agents and clients)
    curve_secret_key: Path | None = None
    #: public keys of the clients admitted to the controller's own endpoint (with CURVE)
    curve_clients: Path | None = None
    deadlines: Deadlines = field(default_factory=Deadlines)
    defaults: PrepareDefaults = field(default_factory=PrepareDefaults)
    engines: tuple[EngineConfig, ...] = ()
    #: a capture whose engine has no dump hook to run is an error (else it is reported)
    require_dump: bool = False
    #: CRIU action scripts the shipped hooks hand to ``criu dump|restore`` (``hooks``)
    criu_action_scripts: tuple[Path, ...] = ()
    #: ``[fleet]``: None when the file has none (a node on its own, as before)
    fleet: FleetConfig | None = None
    #: ``[migration]`` (its defaults when the file has none)
    migration: MigrationConfig = MigrationConfig()
    #: ``[journal]`` (its defaults when the file has none)
    journal: JournalConfig = JournalConfig()
    #: ``[images]`` (its defaults when the file has none)
    images: ImagesConfig = ImagesConfig()
    #: the file this was read from (named in errors found when the controller starts)
    source: str = "<defaults>"

    def __post_init__(self) -> None:
        object.__setattr__(self, "_roster", Roster.of(self.engines))

    @property
    def roster(self) -> Roster:
        """The engines driven now and those given away, as one snapshot (``set_roster``
        replaces it whole: a reader that keeps it sees one consistent set)."""
        return self._roster  # type: ignore[attr-defined]

    def set_roster(self, roster: Roster) -> None:
        """Replace the driven engines (``engines``) and the given-away ones at once. The
        caller serialises changes (the controller, under its admission lock); readers never
        see a list mutated under them: ``engines`` is a new tuple, ``roster`` a new
        snapshot (the snapshot first: a name in ``engines`` is always known to it)."""
        object.__setattr__(self, "_roster", roster)
        object.__setattr__(self, "engines", roster.engines)

    def knows(self, name: str) -> bool:
        """Whether the controller drives ``name`` (given-away engines: False)."""
        return name in self.roster.by_name

    def engine(self, name: str) -> EngineConfig:
        """The engine called ``name``; ``UsageError`` saying where a given-away one lives
        now, or naming the known engines otherwise."""
        return self.roster.engine(name)

    def agent_curve(self, name: str) -> CurveClient | None:
        """The CURVE keys to reach engine ``name``'s agent with, when it has a server key."""
        key = self.engine(name).curve_server_key
        if key is None or self.curve_secret_key is None:
            return None
        return CurveClient(self.curve_secret_key, key)

    def prepare_defaults(self, name: str) -> PrepareDefaults:
        """The global prepare defaults overridden by engine ``name``'s own."""
        roster = self.roster
        merged = roster.merged.get(name)
        if merged is None:
            merged = roster.merged[name] = self.defaults.merged(roster.engine(name).defaults)
        return merged


@dataclass(frozen=True)
class Moved:
    """An engine the controller gave away: where it lives now and which operation moved it
    (a TOML entry for it is shown, not driven)."""

    engine: EngineConfig
    to: str
    op_id: str
    wall: float


@dataclass(frozen=True)
class Roster:
    """One snapshot of a controller's engines: those it drives (the TOML's, less those given
    away, plus those adopted) and those it gave away. Never changed: replaced whole."""

    engines: tuple[EngineConfig, ...]
    moved: Mapping[str, Moved] = field(default_factory=dict)
    #: engines by name: an operation looks its engines up several times each
    by_name: Mapping[str, EngineConfig] = field(default_factory=dict)
    #: each engine's prepare defaults, merged once (frozen, so shared safely)
    merged: dict[str, PrepareDefaults] = field(default_factory=dict)

    @classmethod
    def of(cls, engines: Iterable[EngineConfig], moved: Mapping[str, Moved] | None = None
           ) -> Roster:
        engines = tuple(engines)
        return cls(engines, dict(moved or {}), {e.name: e for e in engines})

    def engine(self, name: str) -> EngineConfig:
        engine = self.by_name.get(name)
        if engine is not None:
            return engine
        moved = self.moved.get(name)
        if moved is not None:
            raise UsageError(f"engine {name!r} was given away to node {moved.to} by operation "
                             f"{moved.op_id}; it lives there now: ask that node's controller",
                             engine=name, node=moved.to, op_id=moved.op_id)
        known = [e.name for e in self.engines]
        raise UsageError(f"unknown engine {name!r}; known engines: {', '.join(known) or 'none'}",
                         engine=name, known=known)


def load_config(path: str | os.PathLike[str]) -> ControllerConfig:
    """Read and check the TOML file at ``path``; ``ConfigError`` for any problem."""
    file = os.fspath(path)
    try:
        raw = read_small(file, MAX_CONFIG_BYTES)
    except OSError as err:  # policy: missing or unreadable: the person fixes the path
        raise error(file, None, f"cannot read the file: {err.strerror or err}") from None
    except UnfitFileError as err:  # policy: a device, FIFO, directory or huge file: refused
        # before reading (``/dev/zero`` once read 1.6 GiB, a FIFO waited for a writer)
        raise error(file, None, f"cannot read the file: {err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:  # policy: TOML is UTF-8 by definition: report, do not guess
        raise error(file, None, f"not UTF-8 text (bad byte at offset {err.start})") from None
    return parse_config(text, file)


def parse_config(text: str, file: str = "<string>") -> ControllerConfig:
    """Check TOML ``text``; ``file`` names it in errors and, unless it is ``<...>``, is the
    file whose directory relative paths resolve against (the working directory otherwise)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # policy: bad syntax: say where; the person fixes it
        at = re.search(r"at line (\d+), column (\d+)", str(err))
        where = {"line": int(at.group(1)), "column": int(at.group(2))} if at else {}
        raise error(file, None, f"invalid TOML: {err}", **where) from None
    except RecursionError:  # policy: arrays or tables nested thousands deep: no config is
        raise error(file, None, "invalid TOML: nested too deep to read") from None
    base = Path.cwd() if file.startswith("<") else Path(file).absolute().parent
    table = convert(data, file)
    config = ControllerConfig(
        **_controller(table, file, base),
        deadlines=Deadlines(**given(table.deadlines)),
        defaults=PrepareDefaults().merged(_prepare_overrides(table.defaults, "defaults", file)),
        engines=_engines(table.engine, file, base),
        fleet=_fleet(table.fleet, file, base) if table.fleet is not UNSET else None,
        migration=_migration(table.migration, file, base),
        journal=JournalConfig(**given(table.journal)),
        images=ImagesConfig(**given(table.images)),
        source=file)
    engines_with_keys = [e.name for e in config.engines if e.curve_server_key]
    if engines_with_keys and config.curve_secret_key is None:
        raise error(file, "controller.curve_secret_key", "engines with curve_server_key ("
                    + ", ".join(engines_with_keys) + ") need the controller's own secret key")
    return config


def _controller(table: FileTable, file: str, base: Path) -> dict[str, Any]:
    """The ``[controller]`` keys given, as ``ControllerConfig`` fields: paths resolved (CRIU
    action scripts checked later, as hooks are), endpoint and key files checked, defaults added."""
    out = given(table.controller)
    key = "controller."
    if "endpoint" in out:
        out["endpoint"] = _endpoint(out["endpoint"], file, key + "endpoint", base)
    else:
        out["endpoint"] = _default_endpoint(file)
    for name in ("state_dir", "hooks_dir", "image_dir"):
        if name in out:
            out[name] = _path(out[name], base)
    out.setdefault("state_dir", _default_state_dir())
    out.setdefault("hooks_dir", None)
    out.setdefault("image_dir", out["state_dir"] / "images")
    if "curve_secret_key" in out:
        out["curve_secret_key"] = _key_file(out["curve_secret_key"], file,
                                            key + "curve_secret_key", base, secret=True)
    out["criu_action_scripts"] = tuple(_path(p, base) for p in out.get("criu_action_scripts", ()))
    if "curve_clients" in out:
        clients = out["curve_clients"] = _path(out["curve_clients"], base)
        if not clients.is_dir():
            raise error(file, key + "curve_clients",
                        f"{clients} is not a directory of client public keys (*.key)")
        if "curve_secret_key" not in out:
            raise error(file, key + "curve_clients",
                        "needs curve_secret_key (the controller's own key) too")
    return out


def _fleet(table: FleetTable, file: str, base: Path) -> FleetConfig:
    """``[fleet]``: the URLs checked, file paths resolved and present, the node named."""
    out = given(table)
    urls = [out["etcd"]] if isinstance(out["etcd"], str) else list(out["etcd"])
    for i, url in enumerate(urls):
        _check_etcd_url(url, file, "fleet.etcd" if len(urls) == 1 and isinstance(
            out["etcd"], str) else f"fleet.etcd[{i}]")
    out["etcd"] = tuple(urls)
    node = out.get("node") or socket.gethostname().split(".")[0]
    try:
        check_name(node)
    except ConfigError:  # policy: the engine names' rule, said with the key
        raise error(file, "fleet.node", "must be 1-64 letters, digits, '.', '_' or '-', "
                    f"starting with a letter or digit; got {node!r}"
                    + ("" if "node" in out else " (the host's name: give fleet.node)")) from None
    out["node"] = node
    out["address"] = _address(out.get("address"), file)
    prefix = out.get("prefix", "/ckpt")
    if not re.fullmatch(r"(/[A-Za-z0-9._-]+)+", prefix):
        raise error(file, "fleet.prefix", "must be a key path such as /ckpt (segments of "
                    f"letters, digits, '.', '_' or '-', each after a '/'); got {prefix!r}")
    out["prefix"] = prefix
    for name in ("ca_cert", "cert", "key"):
        if name in out:
            path = out[name] = _path(out[name], base)
            if not path.is_file():
                raise error(file, f"fleet.{name}", f"{path} is not a readable file")
    if ("cert" in out) != ("key" in out):
        missing = "key" if "cert" in out else "cert"
        raise error(file, f"fleet.{missing}", "a client certificate needs both cert and key")
    if ("ca_cert" in out or "cert" in out) and not all(u.startswith("https://") for u in urls):
        raise error(file, "fleet.etcd", "TLS settings (ca_cert, cert, key) need https:// URLs")
    return FleetConfig(**out)


def _migration(table, file: str, base: Path) -> MigrationConfig:
    """``[migration]``: a shared transport needs its folder, and the folder must exist."""
    out = given(table)
    if "shared_dir" in out:
        shared = out["shared_dir"] = _path(out["shared_dir"], base)
        if not shared.is_dir():
            raise error(file, "migration.shared_dir", f"{shared} is not a directory")
    if out.get("image_transport") == "shared" and "shared_dir" not in out:
        raise error(file, "migration.shared_dir", "image_transport = \"shared\" needs the "
                    "folder both nodes see (shared_dir)")
    return MigrationConfig(**out)


#: a host name: dot-separated labels of letters, digits and inner hyphens, 253 characters at most
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def _address(given: str | None, file: str) -> str:
    """``fleet.address``: an IP address (not a wildcard) or a host name; default the host's
    name (``socket.gethostname()``, whole: clients resolve it)."""
    import ipaddress

    address = given if given is not None else socket.gethostname()
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # policy: not an IP address: it must be a host name
        ip = None
    if ip is not None and ip.is_unspecified:
        raise error(file, "fleet.address", f"{address!r} is a wildcard, not an address clients "
                    "can reach: give this node's IP address or host name")
    if ip is None and not _HOST_NAME.fullmatch(address):
        raise error(file, "fleet.address", "must be an IP address or a host name (labels of "
                    f"letters, digits and '-', joined by dots); got {address!r}"
                    + ("" if given is not None else " (the host's name: give fleet.address)"))
    return address


def _check_etcd_url(url: str, file: str, key: str) -> None:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # policy: a malformed URL (a bad port) is a config error
        port = None
        parts = None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or port is None or parts.path not in ("", "/") or parts.query or parts.fragment):
        raise error(file, key, "must be an etcd client URL: http:// or https://, a host and a "
                    f"port, nothing after them (e.g. http://10.0.0.5:2379); got {url!r}")


def _prepare_overrides(table: DefaultsTable, key: str, file: str) -> dict[str, Any]:
    """The keys a ``[defaults]`` table at ``key`` gave, under ``PrepareDefaults`` field names."""
    out = given(table)
    if "level" in out and "tags" in out:
        raise error(file, f"{key}.tags", "level and tags exclude each other: give one of them")
    if "tags" in out:
        tags = out["tags"]
        if len(set(tags)) != len(tags):
            raise error(file, f"{key}.tags", refused(DefaultsTable, "tags", tags))
        out["tags"] = tuple(tags)
    if "residual_budget" in out:
        budget = out.pop("residual_budget")
        try:
            out["residual_budget_bytes"] = values.BYTES.parse(budget)
        except ValueError as err:  # policy: a size string that is none, said with the key
            raise error(file, f"{key}.residual_budget", str(err)) from None
    return out


def _engines(tables: Iterable[EngineTable], file: str, base: Path) -> tuple[EngineConfig, ...]:
    engines = []
    for i, table in enumerate(tables):
        key = f"engine[{i}]"
        _check_engine_name(table.name, file, f"{key}.name")
        fields = given(table)
        fields["control"] = _endpoint(table.control, file, f"{key}.control", base)
        fields["defaults"] = _prepare_overrides(table.defaults, f"{key}.defaults", file)
        if "curve_server_key" in fields:
            fields["curve_server_key"] = _key_file(fields["curve_server_key"], file,
                                                   f"{key}.curve_server_key", base, secret=False)
        engines.append(EngineConfig(**fields))
    _check_unique(engines, file)
    return tuple(engines)


def _path(value: str, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _endpoint(value: str, file: str, key: str, base: Path) -> str:
    _check_endpoint(value, file, key)
    rest = value.split("://", 1)[1]
    if value.startswith("ipc://") and not rest.startswith(("/", "@")):
        return f"ipc://{base / rest}"  # relative to the file; '@': abstract, no file
    return value


def _key_file(value: str, file: str, key: str, base: Path, secret: bool) -> Path:
    from ckpt_controller.security import load

    path = _path(value, base)
    try:
        load(path, secret=secret)
    except ConfigError as err:  # policy: an unreadable or wrong key file, said with the key
        raise error(file, key, err.message) from None
    return path


def _check_endpoint(value: str, file: str, key: str) -> None:
    try:
        check_endpoint(value)
    except ConfigError as err:  # policy: one rule for endpoints; re-raised with the file and key
        raise error(file, key, f"{err.message}, got {value!r}") from None


def _check_engine_name(name: str, file: str, key: str) -> None:
    try:
        check_name(name)
    except ConfigError as err:  # policy: one rule for engine names; re-raised with file and key
        raise error(file, key, f"{err.message}, starting with a letter or digit; "
                               f"got {name!r}") from None


def _check_unique(engines: Iterable[EngineConfig], file: str) -> None:
    seen: dict[str, int] = {}
    for i, engine in enumerate(engines):
        if engine.name in seen:
            raise error(file, f"engine[{i}].name", f"duplicate engine name {engine.name!r} "
                                                   f"(also engine[{seen[engine.name]}])")
        seen[engine.name] = i


def default_config(engines: Iterable[EngineConfig] = (),
                   state_dir: str | os.PathLike[str] | None = None) -> ControllerConfig:
    """The embedded defaults (no file) with these engines, for a controller built in-process
    (``Controller(default_config([...]))``); ``ckptctl serve`` always reads a file."""
    engines = tuple(engines)
    for i, engine in enumerate(engines):
        _check_engine_name(engine.name, "<defaults>", f"engine[{i}].name")
        _check_endpoint(engine.control, "<defaults>", f"engine[{i}].control")
        if engine.kind not in tuple(EngineKind):
            raise error("<defaults>", f"engine[{i}].kind",
                        f"must be one of {', '.join(EngineKind)}")
    _check_unique(engines, "<defaults>")
    state = Path(state_dir).expanduser().absolute() if state_dir else _default_state_dir()
    return ControllerConfig(endpoint=_default_endpoint("<defaults>"), state_dir=state,
                            hooks_dir=None, image_dir=state / "images", engines=engines)


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "ckpt-controller"


def _default_endpoint(file: str) -> str:
    try:
        return f"ipc://{runtime_dir() / 'controller.sock'}"
    except (ConfigError, OSError) as err:  # policy: no usable default: the person sets one
        raise error(file, "controller.endpoint",
                    f"not given, and the default is unusable: {err}") from None


def key_error(config: ControllerConfig, key: str, problem: str, **extra: Any) -> ConfigError:
    """A ``ConfigError`` naming the file ``config`` was read from and ``key``: for a value
    that passed these checks but that the running system refuses (found at start)."""
    return error(config.source, key, problem, **extra)
