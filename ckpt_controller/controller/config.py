"""The controller's configuration: one TOML file read into frozen dataclasses, checked strictly.

Every problem (an unreadable file, invalid TOML, an unknown key, a wrong type, a bad value)
raises ``ConfigError`` whose ``details`` hold ``file``, ``key`` and ``problem``. Keys are dotted;
``engine[0]`` is the first ``[[engine]]`` table, so ``engine[2].control`` is the third one's.
Relative paths (and relative ``ipc://`` paths) resolve against the config file's directory.
Nothing is created on disk here except the private runtime directory that the default
endpoint lives in; the server creates the state and image directories.

Neighbours: ``endpoints`` (engine names, endpoint schemes, the runtime dir) and ``units``
(size strings) below; the controller's server and operations and ``ckptctl serve`` above.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NoReturn

from ckpt_controller import units
from ckpt_controller.endpoints import check_endpoint, check_name, runtime_dir
from ckpt_controller.errors import ConfigError, UsageError
from ckpt_controller.security import CurveClient

DRAIN_MODES = ("wait", "abort", "keep")
ON_DEADLINE = ("abort", "keep", "fail")
LEVELS = (0, 1, 2)
KINDS = ("native", "vllm")
RECOVER_UNCAPTURED = ("resume", "leave")
#: the longest duration any key may give (a day): longer ones overflow timers and waits
MAX_SECONDS = 86400.0
_MISSING: Any = object()


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


@dataclass(frozen=True)
class PrepareDefaults:
    """Defaults of prepare parameters. ``level`` and ``tags`` exclude each other (tags -> level None)."""

    drain: str = "wait"
    on_deadline: str = "abort"
    level: int | None = 1
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
    kind: str = "native"
    defaults: dict[str, Any] = field(default_factory=dict, hash=False)
    #: the agent's CURVE public key file: the controller connects with CURVE when set
    curve_server_key: Path | None = None


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
    #: back and found it paused, say): "resume" restores it, "leave" leaves it FAILED
    recover_uncaptured: str = "resume"
    #: the controller's CURVE secret key file (its identity towards agents and clients)
    curve_secret_key: Path | None = None
    #: public keys of the clients admitted to the controller's own endpoint (with CURVE)
    curve_clients: Path | None = None
    deadlines: Deadlines = field(default_factory=Deadlines)
    defaults: PrepareDefaults = field(default_factory=PrepareDefaults)
    engines: tuple[EngineConfig, ...] = ()
    #: a capture whose engine has no dump hook to run is an error (else it is reported)
    require_dump: bool = False
    #: the file this was read from (named in errors found when the controller starts)
    source: str = "<defaults>"

    def engine(self, name: str) -> EngineConfig:
        """The engine called ``name``; ``UsageError`` naming the known engines otherwise."""
        for engine in self.engines:
            if engine.name == name:
                return engine
        known = [e.name for e in self.engines]
        raise UsageError(f"unknown engine {name!r}; known engines: {', '.join(known) or 'none'}",
                         engine=name, known=known)

    def agent_curve(self, name: str) -> CurveClient | None:
        """The CURVE keys to reach engine ``name``'s agent with, when it has a server key."""
        key = self.engine(name).curve_server_key
        if key is None or self.curve_secret_key is None:
            return None
        return CurveClient(self.curve_secret_key, key)

    def prepare_defaults(self, name: str) -> PrepareDefaults:
        """The global prepare defaults overridden by engine ``name``'s own."""
        return self.defaults.merged(self.engine(name).defaults)


def load_config(path: str | os.PathLike[str]) -> ControllerConfig:
    """Read and check the TOML file at ``path``; ``ConfigError`` for any problem."""
    file = os.fspath(path)
    try:
        raw = Path(file).read_bytes()
    except OSError as err:  # missing, no permission, a directory: the person fixes the path
        raise _error(file, None, f"cannot read the file: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:  # TOML is UTF-8 by definition: report, do not guess
        raise _error(file, None, f"not UTF-8 text (bad byte at offset {err.start})") from None
    return parse_config(text, file)


def parse_config(text: str, file: str = "<string>") -> ControllerConfig:
    """Check TOML ``text``; ``file`` names it in errors and, unless it is ``<...>``, is the
    file whose directory relative paths resolve against (the working directory otherwise)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # a syntax error: say where, the person fixes it
        at = re.search(r"at line (\d+), column (\d+)", str(err))
        where = {"line": int(at.group(1)), "column": int(at.group(2))} if at else {}
        raise _error(file, None, f"invalid TOML: {err}", **where) from None
    base = Path.cwd() if file.startswith("<") else Path(file).absolute().parent
    top = _Table(data, "", file, base, ("controller", "deadlines", "defaults", "engine"))
    ctl = top.table("controller", ("endpoint", "state_dir", "hooks_dir", "image_dir",
                                   "metrics_port", "metrics_host", "heartbeat_interval_s",
                                   "missed_beats", "reconcile_interval_s", "curve_secret_key",
                                   "curve_clients", "require_dump", "recover_uncaptured"))
    dl = top.table("deadlines", tuple(f.name for f in fields(Deadlines)))
    deadlines = Deadlines(**{f.name: dl.seconds(f.name, f.default) for f in fields(Deadlines)})
    defaults = PrepareDefaults().merged(_prepare_overrides(top.table("defaults", _PREPARE_KEYS)))
    state_dir = ctl.path("state_dir", None) or _default_state_dir()
    config = ControllerConfig(
        endpoint=ctl.endpoint("endpoint", None) or _default_endpoint(file),
        state_dir=state_dir,
        hooks_dir=ctl.path("hooks_dir", None),
        image_dir=ctl.path("image_dir", None) or state_dir / "images",
        metrics_port=ctl.value("metrics_port", None, lambda v: _is_int(v) and 0 <= v <= 65535,
                               "an integer port in 0..65535 (0: any free port)"),
        metrics_host=ctl.string("metrics_host", "127.0.0.1"),
        heartbeat_interval_s=ctl.seconds("heartbeat_interval_s", 0.5),
        missed_beats=ctl.value("missed_beats", 6, lambda v: _is_int(v) and 1 <= v <= 1000,
                               "an integer >= 1 and <= 1000"),
        reconcile_interval_s=ctl.seconds("reconcile_interval_s", 2.0),
        recover_uncaptured=ctl.value("recover_uncaptured", "resume",
                                     RECOVER_UNCAPTURED.__contains__,
                                     _one_of(RECOVER_UNCAPTURED)),
        curve_secret_key=_curve_key(ctl, "curve_secret_key", secret=True),
        curve_clients=_curve_clients(ctl),
        deadlines=deadlines, defaults=defaults, engines=_engines(top),
        require_dump=ctl.value("require_dump", False, lambda v: isinstance(v, bool),
                               "true or false"),
        source=file)
    engines_with_keys = [e.name for e in config.engines if e.curve_server_key]
    if engines_with_keys and config.curve_secret_key is None:
        raise _error(file, "controller.curve_secret_key", "engines with curve_server_key ("
                     + ", ".join(engines_with_keys) + ") need the controller's own secret key")
    return config


def _curve_key(t: _Table, name: str, secret: bool) -> Path | None:
    from ckpt_controller.security import load

    path = t.path(name, None)
    if path is not None:
        try:
            load(path, secret=secret)
        except ConfigError as err:
            t.fail(name, err.message)
    return path


def _curve_clients(t: _Table) -> Path | None:
    path = t.path("curve_clients", None)
    if path is None:
        return None
    if not Path(path).is_dir():
        t.fail("curve_clients", f"{path} is not a directory of client public keys (*.key)")
    if "curve_secret_key" not in t.data:
        t.fail("curve_clients", "needs curve_secret_key (the controller's own key) too")
    return path


def default_config(engines: Iterable[EngineConfig] = (),
                   state_dir: str | os.PathLike[str] | None = None) -> ControllerConfig:
    """The embedded defaults (no file) with these engines, for a controller built in-process
    (``Controller(default_config([...]))``); ``ckptctl serve`` always reads a file."""
    engines = tuple(engines)
    for i, engine in enumerate(engines):
        _check_engine_name(engine.name, "<defaults>", f"engine[{i}].name")
        _check_endpoint(engine.control, "<defaults>", f"engine[{i}].control")
        if engine.kind not in KINDS:
            raise _error("<defaults>", f"engine[{i}].kind", f"must be one of {', '.join(KINDS)}")
    _check_unique(engines, "<defaults>")
    state = Path(state_dir).expanduser().absolute() if state_dir else _default_state_dir()
    return ControllerConfig(endpoint=_default_endpoint("<defaults>"), state_dir=state,
                            hooks_dir=None, image_dir=state / "images", engines=engines)


_PREPARE_KEYS = ("drain", "on_deadline", "level", "tags", "residual_budget")


def _prepare_overrides(t: _Table) -> dict[str, Any]:
    """The keys a [defaults] table gives, validated, under ``PrepareDefaults`` field names."""
    if "level" in t.data and "tags" in t.data:
        t.fail("tags", "level and tags exclude each other: give one of them")
    read = {
        "drain": lambda k: t.value(k, _MISSING, DRAIN_MODES.__contains__, _one_of(DRAIN_MODES)),
        "on_deadline": lambda k: t.value(k, _MISSING, ON_DEADLINE.__contains__,
                                         _one_of(ON_DEADLINE)),
        "level": lambda k: t.value(k, _MISSING, lambda v: _is_int(v) and v in LEVELS,
                                   _one_of(LEVELS)),
        "tags": lambda k: tuple(t.value(k, _MISSING, _is_tags,
                                        "a non-empty array of distinct non-empty strings")),
        "residual_budget": t.size,
    }
    return {("residual_budget_bytes" if k == "residual_budget" else k): read[k](k) for k in t.data}


def _engines(top: _Table) -> tuple[EngineConfig, ...]:
    items = top.value("engine", [], lambda v: isinstance(v, list) and all(
        isinstance(item, dict) for item in v), "an array of tables: [[engine]]")
    engines = []
    for i, item in enumerate(items):
        t = _Table(item, f"engine[{i}]", top.file, top.base,
                   ("name", "control", "kind", "defaults", "curve_server_key"))
        name = t.string("name")
        _check_engine_name(name, t.file, t.key("name"))
        engines.append(EngineConfig(
            name=name, control=t.endpoint("control"),
            kind=t.value("kind", "native", KINDS.__contains__, _one_of(KINDS)),
            defaults=_prepare_overrides(t.table("defaults", _PREPARE_KEYS)),
            curve_server_key=_curve_key(t, "curve_server_key", secret=False)))
    _check_unique(engines, top.file)
    return tuple(engines)


class _Table:
    """One TOML table under a dotted ``prefix``: unknown keys fail at once, typed getters after."""

    def __init__(self, data: dict, prefix: str, file: str, base: Path, known: tuple[str, ...]):
        self.data, self.prefix, self.file, self.base = data, prefix, file, base
        for name in data:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                self.fail(name, f"unknown key; {hint}known keys here: {', '.join(known)}")

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def fail(self, name: str, problem: str) -> NoReturn:
        raise _error(self.file, self.key(name), problem)

    def value(self, name: str, default: Any, ok: Callable[[Any], bool], wants: str) -> Any:
        """The value at ``name`` if ``ok(value)``; ``default`` when absent (required if _MISSING)."""
        if name not in self.data:
            if default is _MISSING:
                self.fail(name, "is required")
            return default
        value = self.data[name]
        if not ok(value):
            self.fail(name, f"must be {wants}, got {reprlib.repr(value)}")
        return value

    def table(self, name: str, known: tuple[str, ...]) -> _Table:
        data = self.value(name, {}, lambda v: isinstance(v, dict), "a table")
        return _Table(data, self.key(name), self.file, self.base, known)

    def string(self, name: str, default: Any = _MISSING) -> Any:
        return self.value(name, default, lambda v: isinstance(v, str) and v != "",
                          "a non-empty string")

    def seconds(self, name: str, default: float) -> float:
        return float(self.value(name, default,
                                lambda v: _is_number(v) and 0 < v <= MAX_SECONDS,
                                f"a finite number of seconds, at most {MAX_SECONDS:.0f} (a day) "
                                f"and > 0"))

    def size(self, name: str) -> int:
        value = self.value(name, _MISSING, lambda v: isinstance(v, str) or _is_int(v) and v >= 0,
                           "a number of bytes >= 0 or a size string such as 512MiB")
        try:
            return value if isinstance(value, int) else units.parse_bytes(value)
        except ValueError as err:  # re-raised with the file and key, as every config problem
            self.fail(name, str(err))

    def path(self, name: str, default: Any) -> Any:
        value = self.string(name, default)
        if name not in self.data:
            return value
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.base / path

    def endpoint(self, name: str, default: Any = _MISSING) -> Any:
        value = self.string(name, default)
        if name not in self.data:
            return value
        _check_endpoint(value, self.file, self.key(name))
        rest = value.split("://", 1)[1]
        if value.startswith("ipc://") and not rest.startswith(("/", "@")):
            return f"ipc://{self.base / rest}"  # relative to the file; '@': abstract, no file
        return value


def _check_endpoint(value: str, file: str, key: str) -> None:
    try:
        check_endpoint(value)
    except ConfigError as err:  # one rule for endpoints; re-raised with the file and key
        raise _error(file, key, f"{err.message}, got {value!r}") from None
    if not value.split("://", 1)[1]:
        raise _error(file, key, f"names no address after the scheme: {value!r}")


def _check_engine_name(name: str, file: str, key: str) -> None:
    try:
        check_name(name)
    except ConfigError as err:  # one rule for engine names; re-raised with the file and key
        raise _error(file, key, f"{err.message}, starting with a letter or digit; "
                                f"got {name!r}") from None


def _check_unique(engines: Iterable[EngineConfig], file: str) -> None:
    seen: dict[str, int] = {}
    for i, engine in enumerate(engines):
        if engine.name in seen:
            raise _error(file, f"engine[{i}].name", f"duplicate engine name {engine.name!r} "
                                                    f"(also engine[{seen[engine.name]}])")
        seen[engine.name] = i


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "ckpt-controller"


def _default_endpoint(file: str) -> str:
    try:
        return f"ipc://{runtime_dir() / 'controller.sock'}"
    except (ConfigError, OSError) as err:  # no usable default: the person sets one instead
        raise _error(file, "controller.endpoint",
                     f"not given, and the default is unusable: {err}") from None


def key_error(config: ControllerConfig, key: str, problem: str, **extra: Any) -> ConfigError:
    """A ``ConfigError`` naming the file ``config`` was read from and ``key``: for a value
    that passed these checks but that the running system refuses (found at start)."""
    return _error(config.source, key, problem, **extra)


def _error(file: str, key: str | None, problem: str, **extra: Any) -> ConfigError:
    where = f"{file}: {key}" if key else file
    return ConfigError(f"{where}: {problem}", file=file, key=key, problem=problem, **extra)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_tags(value: Any) -> bool:
    return (isinstance(value, list) and len(value) > 0
            and all(isinstance(tag, str) and tag for tag in value) and len(set(value)) == len(value))


def _one_of(choices: tuple) -> str:
    return "one of " + ", ".join(map(repr, choices))
