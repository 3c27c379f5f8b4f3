"""The systemd units in deploy/systemd/: each passes ``systemd-analyze verify`` without a
warning (a copy whose ExecStart names this checkout's ckptctl, which verify wants to find
executable), is a Type=notify service with a watchdog that restarts on failure, and its
ExecStart is a command line ckptctl's own parser accepts (so a renamed flag breaks this test,
not a host's boot). Skips without systemd-analyze."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_controller.cli import build_parser
from support import ROOT
from support.timing import scaled

UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
INSTALLED = "/opt/ckpt-controller/bin/ckptctl"
#: what the template's instance and environment file stand for in the parser check
VALUES = {"%i": "llama-a", "${VLLM_URL}": "http://127.0.0.1:8000", "$AGENT_ARGS": ""}


def _unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(path.read_text())
    return unit


def test_there_are_units_for_the_controller_and_the_vllm_agent():
    assert {u.name for u in UNITS} >= {"ckpt-controller.service", "ckpt-agent-vllm@.service"}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify_passes(path, tmp_path):
    ckptctl = Path(sys.executable).parent / "ckptctl"
    if not ckptctl.exists():
        ckptctl = shutil.which("ckptctl")
    assert ckptctl, "ckptctl is not installed beside this python"
    text = path.read_text()
    assert INSTALLED in text
    copy = tmp_path / path.name
    copy.write_text(text.replace(INSTALLED, str(ckptctl)))
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                         text=True, timeout=scaled(60))
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "" and out.stdout.strip() == ""  # an unknown key only warns


def test_verify_would_catch_a_mistake(tmp_path):
    """The check above is not vacuous: a misspelled key is reported."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    copy = tmp_path / "ckpt-controller.service"
    copy.write_text((ROOT / "deploy" / "systemd" / copy.name).read_text().replace(INSTALLED, sys.executable)
                    .replace("WatchdogSec=", "WatchDogSec="))
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                         text=True, timeout=scaled(60))
    assert "WatchDogSec" in out.stderr


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_a_notify_service_with_a_watchdog_and_real_flags(path):
    service = _unit(path)["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert int(service["WatchdogSec"]) > 0 and service["Restart"] == "on-failure"
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == INSTALLED
    for key, value in VALUES.items():
        argv = [a.replace(key, value) for a in argv]
    args = build_parser().parse_args([a for a in argv[1:] if a])  # exits 2 on a bad flag
    assert args.log_format == "json" and args.log_level == "info"
    if args.command == "serve":
        assert args.config.startswith("/etc/ckpt-controller/")
        assert service["KillMode"] == "process"  # restored engines outlive a restart
    else:
        assert (args.command, args.agent_command, args.name) == ("agent", "vllm", "llama-a")
        assert args.control == "ipc:///run/ckpt-controller/llama-a.sock"
        assert service["EnvironmentFile"].startswith("/etc/ckpt-controller/")
    # the agents' sockets and the sidecar's state survive a restart of either service
    assert service["RuntimeDirectory"] == "ckpt-controller"
    assert service["RuntimeDirectoryPreserve"] == "yes"


def test_the_example_config_loads_and_meets_the_agent_unit():
    """deploy/systemd/controller.toml (the unit's --config) passes the config checks, and its
    engine is reached where ckpt-agent-vllm@NAME serves."""
    from ckpt_controller.controller.config import load_config

    config = load_config(ROOT / "deploy" / "systemd" / "controller.toml")
    assert config.endpoint.startswith("ipc:///run/ckpt-controller/")
    assert str(config.state_dir) == "/var/lib/ckpt-controller"  # the unit's StateDirectory
    (engine,) = config.engines
    assert engine.control == f"ipc:///run/ckpt-controller/{engine.name}.sock"
