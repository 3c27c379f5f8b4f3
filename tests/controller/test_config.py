"""The controller's TOML config: a full file, defaults, relative paths, and every error naming
the file, the exact dotted key and the problem."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from ckpt_controller.controller.config import (
    ControllerConfig,
    Deadlines,
    EngineConfig,
    PrepareDefaults,
    default_config,
    load_config,
    parse_config,
)
from ckpt_controller.errors import ConfigError, UsageError
from ckpt_controller.units import human_bytes, parse_bytes
from ckpt_controller.vocab import (
    DrainMode,
    EngineKind,
    Escalation,
    RecoverUncaptured,
    ReleaseLevel,
)
from support.config import engine_table

FULL = """
[controller]
endpoint = "tcp://127.0.0.1:5600"
state_dir = "/var/lib/ckpt"
hooks_dir = "/etc/ckpt/hooks"
image_dir = "/scratch/images"
metrics_port = 9400
metrics_host = "0.0.0.0"
heartbeat_interval_s = 0.25
missed_beats = 4

[deadlines]
drain = 10
release = 20.5
capture = 30.0
restore = 40.0
hook = 50.0
hook_grace = 2.5
operation = 600.0
probe = 7.5

[defaults]
drain = "abort"
on_deadline = "fail"
level = 2
residual_budget = "1GiB"

[[engine]]
name = "engine-a"
control = "ipc:///run/ckpt/engine-a.sock"
kind = "vllm"
[engine.defaults]
level = 0
drain = "keep"

[[engine]]
name = "engine.b_2"
control = "tcp://10.0.0.2:5555"
"""


@pytest.fixture(autouse=True)
def private_dirs(tmp_path, monkeypatch):
    """Keep the default runtime and state dirs inside the test's own temp directory."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "run").mkdir(mode=0o700)


def write(tmp_path: Path, text: str, name: str = "conf/ckpt.toml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_full_file(tmp_path):
    path = write(tmp_path, FULL)
    cfg = load_config(path)
    assert cfg.endpoint == "tcp://127.0.0.1:5600"
    assert cfg.state_dir == Path("/var/lib/ckpt")
    assert cfg.hooks_dir == Path("/etc/ckpt/hooks")
    assert cfg.image_dir == Path("/scratch/images")
    assert (cfg.metrics_port, cfg.metrics_host) == (9400, "0.0.0.0")
    assert (cfg.heartbeat_interval_s, cfg.missed_beats) == (0.25, 4)
    assert cfg.deadlines == Deadlines(drain=10.0, release=20.5, capture=30.0, restore=40.0,
                                      hook=50.0, hook_grace=2.5, operation=600.0, probe=7.5)
    assert isinstance(cfg.deadlines.drain, float)
    assert cfg.defaults == PrepareDefaults(drain="abort", on_deadline="fail", level=2, tags=None,
                                           residual_budget_bytes=1 << 30)
    assert cfg.engines == (
        EngineConfig("engine-a", "ipc:///run/ckpt/engine-a.sock", "vllm",
                     {"level": 0, "drain": "keep"}),
        EngineConfig("engine.b_2", "tcp://10.0.0.2:5555", "native", {}),
    )
    assert cfg.engine("engine.b_2").kind == "native"


def test_defaults(tmp_path):
    cfg = parse_config("")
    assert cfg.endpoint == f"ipc://{tmp_path}/run/ckpt-controller/controller.sock"
    assert cfg.state_dir == tmp_path / "state" / "ckpt-controller"
    assert cfg.image_dir == cfg.state_dir / "images"
    assert cfg.hooks_dir is None and cfg.metrics_port is None
    assert (cfg.metrics_host, cfg.heartbeat_interval_s, cfg.missed_beats) == ("127.0.0.1", 0.5, 6)
    assert cfg.deadlines == Deadlines(30.0, 60.0, 600.0, 300.0, 60.0, 900.0, 5.0, 2.0)
    assert cfg.defaults == PrepareDefaults("wait", "abort", 2, None, None)
    assert cfg.engines == ()
    assert not cfg.state_dir.exists()  # the server creates it, not the parser
    assert cfg.migration.digest_ahead is False  # only its own engines' files, unless asked
    assert parse_config("[migration]\ndigest_ahead = true\n").migration.digest_ahead is True


def test_state_dir_without_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert parse_config("").state_dir == tmp_path / "home/.local/state/ckpt-controller"


def test_relative_paths_resolve_against_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write(tmp_path, """
[controller]
endpoint = "ipc://run/ctl.sock"
state_dir = "state"
hooks_dir = "../hooks"
[[engine]]
name = "a"
control = "ipc://a.sock"
[[engine]]
name = "b"
control = "ipc://@abstract-b"
""")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Path("conf/ckpt.toml"))
    conf = tmp_path / "conf"
    assert cfg.state_dir == conf / "state"
    assert cfg.image_dir == conf / "state" / "images"
    assert cfg.hooks_dir == conf / "../hooks"
    assert cfg.endpoint == f"ipc://{conf}/run/ctl.sock"
    assert [e.control for e in cfg.engines] == [f"ipc://{conf}/a.sock", "ipc://@abstract-b"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.toml"]  # nothing created
    home = parse_config('[controller]\nimage_dir = "~/img"', str(path))
    assert home.image_dir == tmp_path / "home" / "img"


def engines(*extras: str) -> str:
    """An ``[[engine]]`` table for each of ``extras`` (its own lines), named e0, e1, ..."""
    return "".join(engine_table((f"e{i}", f"ipc:///tmp/e{i}"), extra=extra)
                   for i, extra in enumerate(extras))


BAD = [
    # unknown keys: typos must not pass silently
    ("[controler]\n", "controler", "did you mean 'controller'"),
    ("[deadlines]\ndrian = 1.0\n", "deadlines.drian", "did you mean 'drain'"),
    ("[controller]\nmetrics-port = 1\n", "controller.metrics-port", "unknown key"),
    (engines("", 'contrl = "ipc:///x"'), "engine[1].contrl", "did you mean 'control'"),
    (engines("[engine.defaults]\nlevle = 2"), "engine[0].defaults.levle", "did you mean 'level'"),
    # wrong types and ranges
    ("controller = 1\n", "controller", "must be a table"),
    ("[controller]\nmetrics_port = \"9400\"\n", "controller.metrics_port", "'9400'"),
    ("[controller]\nmetrics_port = 70000\n", "controller.metrics_port", "0..65535"),
    ("[controller]\nmetrics_port = true\n", "controller.metrics_port", "True"),
    ("[controller]\nmissed_beats = 0\n", "controller.missed_beats", ">= 1"),
    ("[controller]\nheartbeat_interval_s = false\n", "controller.heartbeat_interval_s",
     "at least 0.01"),
    # an interval so small the controller would spin (5e-324 took 17% of a core)
    ("[controller]\nreconcile_interval_s = 5e-324\n", "controller.reconcile_interval_s",
     "at least 0.01"),
    ("[controller]\nheartbeat_interval_s = 0.001\n", "controller.heartbeat_interval_s",
     "at least 0.01"),
    ("[controller]\nstate_dir = \"\"\n", "controller.state_dir", "non-empty string"),
    ("[controller]\nhooks_dir = 3\n", "controller.hooks_dir", "non-empty string"),
    ("[controller]\nmetrics_host = [\"a\"]\n", "controller.metrics_host", "non-empty string"),
    # deadlines: seconds > 0
    ("[deadlines]\ndrain = -1\n", "deadlines.drain", "> 0, got -1"),
    ("[deadlines]\noperation = 0\n", "deadlines.operation", "> 0"),
    ("[deadlines]\nhook = inf\n", "deadlines.hook", "finite"),
    ("[deadlines]\nrestore = nan\n", "deadlines.restore", "finite"),
    ("[deadlines]\ncapture = \"10s\"\n", "deadlines.capture", "'10s'"),
    # durations have an upper bound (a day): a huge one passed validation, then overflowed
    ("[controller]\nreconcile_interval_s = 1e12\n", "controller.reconcile_interval_s",
     "at most 86400"),
    ("[controller]\nheartbeat_interval_s = 1e12\n", "controller.heartbeat_interval_s",
     "at most 86400"),
    ("[controller]\nmissed_beats = 100000000000\n", "controller.missed_beats", "<= 1000"),
    ("[deadlines]\nhook = 1e12\n", "deadlines.hook", "at most 86400"),
    ("[deadlines]\noperation = 1e12\n", "deadlines.operation", "at most 86400"),
    ("[deadlines]\nhook_grace = 86401\n", "deadlines.hook_grace", "at most 86400"),
    ("[deadlines]\nprobe = 0\n", "deadlines.probe", "> 0"),
    ("[deadlines]\nprobe = 86401\n", "deadlines.probe", "at most 86400"),
    ("[controller]\nrequire_dump = 1\n", "controller.require_dump", "true or false"),
    # engines
    ("[engine]\nname = \"a\"\n", "engine", "[[engine]]"),
    ("engine = [1]\n", "engine", "array of tables"),
    (engines("", "", "").replace('name = "e2"', 'name = "e0"'),
     "engine[2].name", "duplicate engine name 'e0' (also engine[0])"),
    ('[[engine]]\ncontrol = "ipc:///x"\n', "engine[0].name", "is required"),
    ('[[engine]]\nname = "a"\n', "engine[0].control", "is required"),
    ('[[engine]]\nname = "-a"\ncontrol = "ipc:///x"\n', "engine[0].name", "letter or digit"),
    ('[[engine]]\nname = "a b"\ncontrol = "ipc:///x"\n', "engine[0].name", "1-64"),
    (f'[[engine]]\nname = "{"a" * 65}"\ncontrol = "ipc:///x"\n', "engine[0].name", "1-64"),
    ('[[engine]]\nname = "a\\n"\ncontrol = "ipc:///x"\n', "engine[0].name", "'a\\n'"),
    ('[[engine]]\nname = 7\ncontrol = "ipc:///x"\n', "engine[0].name", "non-empty string"),
    (engines("", "", "").replace('control = "ipc:///tmp/e2"', 'control = "http://h:1"'),
     "engine[2].control", "ipc://, tcp:// or inproc://"),
    ('[[engine]]\nname = "a"\ncontrol = "tcp://"\n', "engine[0].control", "no address"),
    ("[controller]\nendpoint = \"localhost:5555\"\n", "controller.endpoint", "tcp://"),
    (engines('kind = "sglang"'), "engine[0].kind", "'native', 'vllm'"),
    (engines("defaults = 3"), "engine[0].defaults", "must be a table"),
    # prepare defaults
    ("[defaults]\ndrain = \"later\"\n", "defaults.drain", "'wait', 'abort', 'keep'"),
    ("[defaults]\non_deadline = \"wait\"\n", "defaults.on_deadline", "'abort', 'keep', 'fail'"),
    ("[defaults]\nlevel = 3\n", "defaults.level", "one of 0, 1, 2"),
    ("[defaults]\nlevel = true\n", "defaults.level", "one of 0, 1, 2"),
    ("[defaults]\ntags = []\n", "defaults.tags", "non-empty array"),
    ("[defaults]\ntags = \"kv_cache\"\n", "defaults.tags", "array"),
    ("[defaults]\ntags = [\"kv\", \"\"]\n", "defaults.tags", "non-empty strings"),
    ("[defaults]\ntags = [\"kv\", \"kv\"]\n", "defaults.tags", "distinct"),
    ("[defaults]\ntags = [\"kv\", 1]\n", "defaults.tags", "strings"),
    ("[defaults]\nlevel = 1\ntags = [\"kv\"]\n", "defaults.tags", "exclude each other"),
    (engines("[engine.defaults]\nlevel = 0\ntags = [\"kv\"]"), "engine[0].defaults.tags",
     "exclude each other"),
    ("[defaults]\nresidual_budget = \"lots\"\n", "defaults.residual_budget", "not a size"),
    ("[defaults]\nresidual_budget = -1\n", "defaults.residual_budget", ">= 0"),
    ("[defaults]\nresidual_budget = 1.5\n", "defaults.residual_budget", "size string"),
    # [fleet] and engine labels (fleet.md)
    ("[fleet]\nnode = \"n1\"\n", "fleet.etcd", "is required"),
    ("[fleet]\netcd = \"ftp://x:1\"\n", "fleet.etcd", "http:// or https://"),
    ("[fleet]\netcd = \"http://x\"\n", "fleet.etcd", "a host and a port"),
    ("[fleet]\netcd = [\"http://x:1\", \"http://y:2/v3\"]\n", "fleet.etcd[1]", "nothing after"),
    ("[fleet]\netcd = []\n", "fleet.etcd", "array of 1 to 16"),
    ("[fleet]\netcd = \"http://x:1\"\nnode = \"a b\"\n", "fleet.node", "'a b'"),
    ("[fleet]\netcd = \"http://x:1\"\nprefix = \"ckpt\"\n", "fleet.prefix", "key path"),
    ("[fleet]\netcd = \"http://x:1\"\nlease_ttl_s = 1\n", "fleet.lease_ttl_s", "2..3600"),
    ("[fleet]\netcd = \"http://x:1\"\npublish_interval_s = nan\n", "fleet.publish_interval_s",
     "finite"),
    ("[fleet]\netcd = \"http://x:1\"\nca_cert = \"/nonexistent/ca.pem\"\n", "fleet.ca_cert",
     "not a readable file"),
    ("[fleet]\netcd = \"http://x:1\"\ncert = \"/etc/hostname\"\n", "fleet.key",
     "both cert and key"),
    ("[fleet]\netcd = \"http://x:1\"\nca_cert = \"/etc/hostname\"\n", "fleet.etcd",
     "need https://"),
    ("[fleet]\netcd = \"http://x:1\"\nnodes = \"n\"\n", "fleet.nodes", "did you mean 'node'"),
    ("[fleet]\netcd = \"http://x:1\"\naddress = \"0.0.0.0\"\n", "fleet.address", "wildcard"),
    ("[fleet]\netcd = \"http://x:1\"\naddress = \"::\"\n", "fleet.address", "wildcard"),
    ("[fleet]\netcd = \"http://x:1\"\naddress = \"tcp://10.0.0.1\"\n", "fleet.address",
     "IP address or a host name"),
    ("[fleet]\netcd = \"http://x:1\"\naddress = \"a_b.example\"\n", "fleet.address",
     "'a_b.example'"),
    ("[fleet]\netcd = \"http://x:1\"\naddress = \"-x\"\n", "fleet.address", "'-x'"),
    ("[fleet]\netcd = \"http://x:1\"\naddress = \"\"\n", "fleet.address", "non-empty"),
    ("[fleet]\netcd = \"http://x:1\"\naddress = 1\n", "fleet.address", "non-empty string"),
    (engines('labels = { "a b" = "x" }'), "engine[0].labels", "at most 64 labels"),
    (engines('labels = { k = "-x" }'), "engine[0].labels", "starting and ending"),
    (engines('labels = { k = 1 }'), "engine[0].labels", "got {'k': 1}"),
    # [migration] (fleet.md, Migration)
    ("[migration]\nimage_transport = \"rsync\"\n", "migration.image_transport",
     '"page-server" or "shared", got \'rsync\''),
    ("[migration]\nimage_transport = \"shared\"\n", "migration.shared_dir",
     "needs the folder both nodes see"),
    ("[migration]\nshared_dir = \"/nonexistent/images\"\n", "migration.shared_dir",
     "is not a directory"),
    ("[migration]\npage_server_port = 65536\n", "migration.page_server_port", "0..65535"),
    ("[migration]\npage_server = 7000\n", "migration.page_server",
     "did you mean 'page_server_port'"),
    ("[migration]\ndigest_ahead = \"yes\"\n", "migration.digest_ahead", "true or false"),
]


@pytest.mark.parametrize("text,key,problem", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_every_problem_names_the_key(tmp_path, text, key, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.details["file"] == str(path)
    assert err.details["key"] == key
    assert problem in err.details["problem"]
    assert key in err.message and problem in str(err)
    assert err.exit_code == 2


@pytest.mark.parametrize("given", ["169.254.77.2", "fd00::2", "gpu-node-17.example.org", None])
def test_the_fleet_address_is_an_ip_address_or_a_host_name(tmp_path, given):
    import socket

    line = "" if given is None else f'address = "{given}"\n'
    cfg = load_config(write(tmp_path, f'[fleet]\netcd = "http://x:1"\n{line}'))
    assert cfg.fleet.address == (given or socket.gethostname())


def test_invalid_toml_says_where(tmp_path):
    path = write(tmp_path, '[controller]\nendpoint = "tcp://h:1"\nmissed_beats = = 3\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    d = info.value.details
    assert d["file"] == str(path) and d["key"] is None
    assert "invalid TOML" in d["problem"] and (d["line"], d["column"]) == (3, 16)
    with pytest.raises(ConfigError, match="line 2"):
        parse_config("[a]\n[a]\n")  # a table defined twice
    # nested thousands deep: a typed error, not Python's RecursionError (exit 1)
    with pytest.raises(ConfigError, match="nested too deep"):
        parse_config("a = " + "[" * 2000 + "]" * 2000 + "\n")


def test_unreadable_files(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read the file") as info:
        load_config(missing)
    assert info.value.details["file"] == str(missing) and info.value.details["key"] is None
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path)  # a directory
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b'[controller]\nmetrics_host = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)
    # a device or a FIFO as the config or a key file: refused at once, nothing read (the
    # config's /dev/zero once grew to 2.5 GB, a FIFO waited for a writer for ever)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    from ckpt_controller.security import load

    for path in ("/dev/zero", fifo):
        with pytest.raises(ConfigError, match="not a regular file"):
            load_config(path)
        with pytest.raises(ConfigError, match="not a regular file"):
            load(path, secret=False)
    if os.getuid() != 0:  # root reads anything
        locked = write(tmp_path, "", "locked.toml")
        locked.chmod(0)
        with pytest.raises(ConfigError, match="Permission denied"):
            load_config(locked)


def test_engine_defaults_override_global_ones():
    cfg = parse_config("""
[defaults]
drain = "wait"
tags = ["kv_cache"]
residual_budget = 1024
[[engine]]
name = "a"
control = "ipc:///tmp/a"
[engine.defaults]
level = 2
drain = "abort"
[[engine]]
name = "b"
control = "ipc:///tmp/b"
[engine.defaults]
tags = ["weights", "kv_cache"]
residual_budget = "2MiB"
on_deadline = "keep"
[[engine]]
name = "c"
control = "ipc:///tmp/c"
""")
    assert cfg.defaults == PrepareDefaults("wait", "abort", None, ("kv_cache",), 1024)
    assert cfg.engine("a").defaults == {"level": 2, "drain": "abort"}
    assert cfg.prepare_defaults("a") == PrepareDefaults("abort", "abort", 2, None, 1024)
    assert cfg.prepare_defaults("b") == PrepareDefaults("wait", "keep", None,
                                                        ("weights", "kv_cache"), 2 << 20)
    assert cfg.prepare_defaults("c") == cfg.defaults


def test_unknown_engine_is_a_usage_error_naming_the_known_ones():
    cfg = parse_config(engines("", ""))
    with pytest.raises(UsageError, match="unknown engine 'zz'; known engines: e0, e1") as info:
        cfg.engine("zz")
    assert type(info.value) is UsageError and info.value.details["known"] == ["e0", "e1"]
    with pytest.raises(UsageError, match="known engines: none"):
        parse_config("").prepare_defaults("zz")


def test_tags_and_level_exclude_each_other():
    assert parse_config("[defaults]\nlevel = 0\n").defaults.level == 0
    tagged = parse_config("[defaults]\ntags = [\"weights\"]\n").defaults
    assert (tagged.level, tagged.tags) == (None, ("weights",))
    # a global tag list, an engine level: the engine's level wins and its tags are cleared
    cfg = parse_config("[defaults]\ntags = [\"weights\"]\n" + engines("[engine.defaults]\nlevel = 1"))
    assert (cfg.prepare_defaults("e0").level, cfg.prepare_defaults("e0").tags) == (1, None)


@pytest.mark.parametrize("value,expected", [('"512MiB"', 512 << 20), ('"1.5 KiB"', 1536),
                                            ('"3GB"', 3 * 10**9), ("4096", 4096), ('"0"', 0),
                                            ('"2 gib"', 2 << 30)])
def test_size_strings(value, expected):
    cfg = parse_config(f"[defaults]\nresidual_budget = {value}\n")
    assert cfg.defaults.residual_budget_bytes == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1", "1.5.2", "12 parsecs", "0x10"])
def test_parse_bytes_rejects_non_sizes(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes(text)


def test_human_bytes():
    assert [human_bytes(n) for n in (None, 1023, 1536, 5 << 30, 3 << 40)] == \
        ["-", "1023 B", "1.5 KiB", "5.0 GiB", "3.0 TiB"]


def test_default_config(tmp_path):
    a = EngineConfig("a", "ipc:///tmp/a.sock")
    cfg = default_config([a], state_dir=tmp_path / "s")
    assert isinstance(cfg, ControllerConfig) and cfg.engines == (a,)
    assert (cfg.state_dir, cfg.image_dir) == (tmp_path / "s", tmp_path / "s" / "images")
    assert cfg.endpoint == f"ipc://{tmp_path}/run/ckpt-controller/controller.sock"
    assert default_config().engines == () and default_config().deadlines == Deadlines()
    with pytest.raises(ConfigError, match="duplicate") as info:
        default_config([a, a])
    assert info.value.details["key"] == "engine[1].name"
    with pytest.raises(ConfigError) as info:
        default_config([EngineConfig("a", "a.sock")])
    assert info.value.details["key"] == "engine[0].control"
    with pytest.raises(ConfigError) as info:
        default_config([EngineConfig("a", "tcp://h:1", kind="docker")])
    assert info.value.details["key"] == "engine[0].kind"


def test_config_is_frozen_and_hashable():
    cfg = parse_config(FULL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.missed_beats = 1  # type: ignore[misc]
    assert hash(cfg) == hash(parse_config(FULL))


def test_curve_keys_are_checked_and_named(tmp_path):
    from ckpt_controller.security import generate

    pub, secret = generate(tmp_path, "ctl")
    eng_pub, _ = generate(tmp_path, "eng")
    clients = tmp_path / "clients"
    clients.mkdir()
    engine = f'[[engine]]\nname = "a"\ncontrol = "tcp://127.0.0.1:7000"\n' \
             f'curve_server_key = "{eng_pub}"\n'
    cfg = parse_config(f'[controller]\ncurve_secret_key = "{secret}"\ncurve_clients = '
                       f'"{clients}"\n\n' + engine)
    assert cfg.curve_secret_key == secret and cfg.curve_clients == clients
    assert cfg.agent_curve("a").server_key == eng_pub
    for text, key, words in [
        (engine, "controller.curve_secret_key", "need the controller's own secret key"),
        (f'[controller]\ncurve_secret_key = "{pub}"\n', "controller.curve_secret_key",
         "no CURVE secret key"),
        (f'[controller]\ncurve_secret_key = "{tmp_path}/none"\n',
         "controller.curve_secret_key", "cannot read"),
        (f'[controller]\ncurve_clients = "{clients}"\n', "controller.curve_clients",
         "needs curve_secret_key"),
        (f'[controller]\ncurve_secret_key = "{secret}"\ncurve_clients = "{pub}"\n',
         "controller.curve_clients", "not a directory"),
    ]:
        with pytest.raises(ConfigError, match=words) as info:
            parse_config(text)
        assert info.value.details["key"] == key


NESTED = [
    # an unknown key in a nested table, with and without a close known one
    (engines("", '[engine.defaults]\nfoo = 1'), "engine[1].defaults.foo",
     "unknown key; known keys here: drain, on_deadline, level, tags, residual_budget"),
    ("[controller.sub]\nx = 1\n", "controller.sub", "unknown key; known keys here: endpoint, "),
    (engines('kidn = "vllm"'), "engine[0].kidn", "unknown key; did you mean 'kind'? "),
    # a wrong type or value in a nested table: the whole key, the value, what is wanted
    (engines("", '[engine.defaults]\ndrain = "later"'), "engine[1].defaults.drain",
     "must be one of 'wait', 'abort', 'keep', got 'later'"),
    (engines("", "", '[engine.defaults]\ntags = ["kv", 2]'), "engine[2].defaults.tags",
     "must be a non-empty array of distinct non-empty strings (at most 256, each at most 64 "
     "characters), got ['kv', 2]"),
    (engines('[engine.defaults]\ntags = ["a", "a"]'), "engine[0].defaults.tags",
     "distinct non-empty strings (at most 256, each at most 64 characters), got ['a', 'a']"),
    (engines('[engine.defaults]\nresidual_budget = "x"'), "engine[0].defaults.residual_budget",
     "not a size: 'x'"),
    (engines("kind = 3"), "engine[0].kind", "must be one of 'native', 'vllm', got 3"),
    (engines("curve_server_key = 1"), "engine[0].curve_server_key",
     "must be a non-empty string, got 1"),
    (engines("defaults = []"), "engine[0].defaults", "must be a table, got []"),
    ("[deadlines]\ndrain = 1979-05-27\n", "deadlines.drain",
     "must be a finite number of seconds, at most 86400 (a day) and > 0, got "
     "datetime.date(1979, 5, 27)"),
    ("[controller]\nmissed_beats = 1.0\n", "controller.missed_beats",
     "must be an integer >= 1 and <= 1000, got 1.0"),
    ("[defaults]\nlevel = 1.0\n", "defaults.level", "must be one of 0, 1, 2, got 1.0"),
    ("[controller]\nrecover_uncaptured = \"retry\"\n", "controller.recover_uncaptured",
     "must be one of 'resume', 'leave', got 'retry'"),
    ("[[engine]]\n", "engine[0].name", "is required"),
    # NaN and infinity are never a duration, wherever the key is
    ("[controller]\nheartbeat_interval_s = nan\n", "controller.heartbeat_interval_s",
     "must be a finite number of seconds, at least 0.01 and at most 86400 (a day), got nan"),
    ("[controller]\nreconcile_interval_s = -inf\n", "controller.reconcile_interval_s",
     "got -inf"),
    ("[deadlines]\nhook_grace = +inf\n", "deadlines.hook_grace", "got inf"),
    ("[deadlines]\ndrain = -nan\n", "deadlines.drain", "got nan"),
    # the wire's bounds hold in the file too: a prepare would be refused with these
    (f'[defaults]\ntags = ["{"t" * 65}"]\n', "defaults.tags", "each at most 64 characters"),
    ("[defaults]\nresidual_budget = 2305843009213693952\n", "defaults.residual_budget",
     "at most 2**60 (1 EiB)"),
    ("[defaults]\nresidual_budget = \"2000000 TiB\"\n", "defaults.residual_budget",
     "out of range"),
]


@pytest.mark.parametrize("text,key,problem", NESTED,
                         ids=[f"{i}-{b[1]}" for i, b in enumerate(NESTED)])
def test_nested_problems_name_the_whole_key(text, key, problem):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "conf.toml")
    assert info.value.details["key"] == key
    assert problem in info.value.details["problem"]
    assert info.value.message == f"conf.toml: {key}: {info.value.details['problem']}"


def test_values_are_vocabulary_members():
    cfg = parse_config(FULL.replace("heartbeat", 'recover_uncaptured = "leave"\nheartbeat'))
    assert cfg.defaults.drain is DrainMode.ABORT and cfg.defaults.on_deadline is Escalation.FAIL
    assert cfg.defaults.level is ReleaseLevel.DISCARD
    assert cfg.engine("engine-a").kind is EngineKind.VLLM
    assert cfg.engine("engine-a").defaults == {"level": ReleaseLevel.NOTHING,
                                               "drain": DrainMode.KEEP}
    assert cfg.engine("engine.b_2").kind is EngineKind.NATIVE
    assert cfg.recover_uncaptured is RecoverUncaptured.LEAVE
    assert parse_config("").recover_uncaptured is RecoverUncaptured.RESUME


def test_every_key_says_what_it_wants():
    """A key added to the file without a description (or an enum) would be refused with a
    Python type's repr instead of words."""
    import typing

    from ckpt_controller.controller import config_schema as schema

    tables = [schema.FileTable, schema.ControllerTable, schema.DeadlinesTable,
              schema.DefaultsTable, schema.EngineTable, schema.FleetTable]
    for table in tables:
        for name in typing.get_type_hints(table):
            words = schema.refused(table, name, None)
            assert words.startswith("must be ") and words.endswith(", got None")
            assert not any(s in words for s in ("typing", "<class", "Annotated", "Unset")), words
