"""The documented install (docs/deploy.md) makes every path the systemd units name, and a
controller-only host needs no torch: the install's own commands, run into a temporary prefix
in place of /opt/ckpt-controller (``pip install .`` from this checkout, dependencies from
PyPI: marked slow), then the units' ExecStart and Documentation= paths looked for there, and
the installed ``ckptctl`` checking a config. Beside it, in the default suite: a controller
that cannot import torch (nor numpy, safetensors, matplotlib) cycles a reference engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT
from support.config import engines_toml
from support.timing import scaled

DEPLOY = ROOT / "docs" / "deploy.md"
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
PREFIX = "/opt/ckpt-controller"
ENGINE_SIDE = ("torch", "safetensors", "numpy", "matplotlib")


def install_commands() -> list[str]:
    """The install block's commands that make ``PREFIX`` (the ones before the units go in)."""
    block = re.search(r"```sh\n(python3 -m venv .*?)```", DEPLOY.read_text(), re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if PREFIX in line
            and not line.startswith("install ")]


def named_paths() -> set[str]:
    """Every path under ``PREFIX`` a unit names (its ExecStart's program, Documentation=)."""
    found = set()
    for unit in UNITS:
        for m in re.finditer(rf"(?:file://)?({re.escape(PREFIX)}/[^\s]+)", unit.read_text()):
            found.add(m.group(1))
    return found


def test_the_units_name_only_what_the_install_makes():
    cmds = install_commands()
    assert cmds[0].startswith(f"python3 -m venv {PREFIX}") and "pip install ." in cmds[0]
    assert any(c.startswith("cp -r docs hooks") for c in cmds), cmds
    assert named_paths() == {f"{PREFIX}/bin/ckptctl", f"{PREFIX}/docs/deploy.md"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_install_makes_them_without_torch(tmp_path):
    prefix = tmp_path / "opt-ckpt"
    for cmd in install_commands():
        out = subprocess.run(cmd.replace(PREFIX, str(prefix)), shell=True, cwd=ROOT,
                             capture_output=True, text=True, timeout=scaled(600))
        assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-2000:])
    for path in named_paths():
        assert Path(path.replace(PREFIX, str(prefix))).exists(), path
    py = prefix / "bin" / "python"
    for name in ENGINE_SIDE:  # none of the engine side came with it
        probe = subprocess.run([str(py), "-c", f"import {name}"], capture_output=True,
                               text=True, timeout=scaled(60))
        assert probe.returncode != 0 and "No module named" in probe.stderr, name
    config = tmp_path / "c.toml"
    config.write_text(f'[controller]\nendpoint = "ipc://{tmp_path}/c.sock"\n'
                      f'state_dir = "{tmp_path}/state"\n')
    out = subprocess.run([str(prefix / "bin" / "ckptctl"), "serve", "--config", str(config),
                          "--check"], capture_output=True, text=True, timeout=scaled(60),
                         cwd=tmp_path)
    assert out.returncode == 0 and ": ok:" in out.stdout, out.stdout + out.stderr


def test_a_controller_without_the_engine_side_cycles_an_engine(spawn_reference,
                                                                spawn_controller, tmp_path,
                                                                monkeypatch):
    """The controller's process cannot import the engine side (a path hook refuses it, as a
    host without the extra would); it still serves, cycles a reference engine (which has
    torch) and answers status, history and images."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class _Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {ENGINE_SIDE!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Refuse())\n")
    eng = spawn_reference("nt")  # started before the variable is set: it has torch
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(blocker), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    ctl = spawn_controller(engines_toml(eng))
    refused = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True,
                             text=True, timeout=scaled(60))
    assert refused.returncode != 0  # the blocker is in force for what starts now
    out = ctl.ckptctl("cycle", "nt", "--drain", "keep", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    for args in (("status",), ("history", "--engine", "nt"), ("images", "list"),
                 ("describe", "nt")):
        got = ctl.ckptctl(*args)
        assert got.returncode == 0 and "ModuleNotFoundError" not in got.stderr, (args, got)
    assert "No module named" not in (ctl.dir / "controller.log").read_text()
