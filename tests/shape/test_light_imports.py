"""What a fresh process loads: ``ckptctl --help`` and a client stay light.

Each case runs in a new interpreter (``python -c``) and lists the modules it loaded; the
heavy ones (torch, the engine side of the agent, the controller service, Prometheus, the
transport where a command does not need it) must not be among them. Times are measured by
``bench/startup.py``, never asserted here. Also the small shared helpers those commands use:
``endpoints.free_port``, ``endpoints.runtime_dir_path`` and ``procutil.StopSignals``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT
from support.timing import scaled


#: loaded only by a command that needs them, never to show help or to talk to an agent
ENGINE_SIDE = ("torch", "ckpt_controller.agent.server", "ckpt_controller.agent.operations",
               "ckpt_controller.agent.failpoints", "ckpt_controller.memory",
               "ckpt_controller.engine.server", "ckpt_controller.engine.model")
SERVICE_SIDE = ("ckpt_controller.controller.service", "ckpt_controller.controller.server",
                "ckpt_controller.controller.hooks", "ckpt_controller.drill.runner",
                "prometheus_client", "PIL", "psutil")
TRANSPORT = ("zmq", "ckpt_controller.rpc", "ckpt_controller.security", "ckpt_controller.protocol",
             "transitions", "ckpt_controller.lifecycle")

_LIST_MODULES = "import json, sys; print(json.dumps(sorted(sys.modules)))"


def loaded_by(code: str) -> set[str]:
    """The modules a fresh interpreter has after running ``code``."""
    run = subprocess.run([sys.executable, "-c", f"{code}\n{_LIST_MODULES}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=scaled(120))
    assert run.returncode == 0, run.stderr
    return set(json.loads(run.stdout.splitlines()[-1]))


def heavy(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


def test_help_loads_no_transport_engine_or_service():
    code = ("import contextlib, io\nfrom ckpt_controller.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n        main(['--help'])\n    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "assert 'exit codes' in out.getvalue()")
    modules = loaded_by(code)
    assert "ckpt_controller.cli.controller_cmds" in modules  # the parser really was built
    assert heavy(modules, ENGINE_SIDE + SERVICE_SIDE + TRANSPORT) == []


def test_each_subcommand_help_stays_light():
    code = ("import contextlib, io\nfrom ckpt_controller.cli import main\n"
            "for cmd in (['serve'], ['cycle'], ['agent', 'prepare'], ['agent', 'vllm'],\n"
            "            ['engine', 'serve'], ['load'], ['demo'], ['drill'], ['keys'],\n"
            "            ['lifecycle']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            main([*cmd, '--help'])\n"
            "        except SystemExit as e:\n            assert e.code == 0, (cmd, e.code)")
    assert heavy(loaded_by(code), ENGINE_SIDE + SERVICE_SIDE + TRANSPORT) == []


def test_the_console_script_shows_help_with_the_same_modules():
    """The installed ``ckptctl`` (not ``-m``) goes through ``ckpt_controller.cli`` alone."""
    script = Path(sys.executable).parent / "ckptctl"
    if not script.exists():
        pytest.skip("the console script is not installed beside this interpreter")
    code = (f"import runpy, sys\nsys.argv = [{str(script)!r}, '--help']\n"
            f"try:\n    runpy.run_path({str(script)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code")
    assert heavy(loaded_by(code), ENGINE_SIDE + SERVICE_SIDE + TRANSPORT) == []


def test_the_package_alone_loads_nothing_else():
    modules = loaded_by("import ckpt_controller")
    assert sorted(m for m in modules if m.startswith("ckpt_controller")) == ["ckpt_controller"]
    assert heavy(modules, ENGINE_SIDE + SERVICE_SIDE + TRANSPORT) == []
    # and the name it exports still arrives, on first use
    modules = loaded_by("import ckpt_controller\n"
                        "assert ckpt_controller.CheckpointState.RUNNING == 'running'")
    assert "ckpt_controller.vocab" in modules
    assert heavy(modules, ("ckpt_controller.lifecycle", "transitions")) == []


@pytest.mark.parametrize("code", ["from ckpt_controller.agent import AgentClient",
                                  "from ckpt_controller.agent.client import AgentClient"])
def test_agent_client_leaves_the_engine_side_behind(code):
    modules = loaded_by(code)
    assert "ckpt_controller.agent.client" in modules
    assert heavy(modules, ENGINE_SIDE + SERVICE_SIDE) == []


@pytest.mark.parametrize("code", ["from ckpt_controller.agent import AgentClient",
                                  "from ckpt_controller.controller.client import "
                                  "ControllerClient\nfrom ckpt_controller.cli import "
                                  "controller_cmds"])
def test_a_client_loads_no_asyncio(code):
    """Nothing here uses asyncio; pyzmq's monitor helpers would load it (``zmq.asyncio``),
    a fifth of a ``ckptctl status``'s start: the transport reads monitor events itself."""
    modules = loaded_by(code)
    assert "ckpt_controller.contact" in modules
    assert heavy(modules, ("asyncio", "zmq.asyncio", "zmq.utils.monitor")) == []


def test_submitting_a_fleet_operation_leaves_the_nodes_side_behind():
    """``ckptctl fleet migrate`` records an operation and follows it: the node's side of a
    migration (its steps, the controller's configuration and roster) stays unloaded; it was
    a sixth of the command's start, which a client waits through before the move begins."""
    modules = loaded_by("from ckpt_controller.fleet.drivers import SUBMIT")
    assert "ckpt_controller.fleet.migration.record" in modules
    assert heavy(modules, ("ckpt_controller.fleet.migration.steps",
                           "ckpt_controller.controller.config",
                           "ckpt_controller.controller.roster")) == []


def test_the_engine_side_still_arrives_by_its_old_names():
    modules = loaded_by("from ckpt_controller.agent import Agent, AgentClient, AdmissionGate, "
                        "EngineHooks, MemoryManager, NoMemory\n"
                        "import ckpt_controller.agent as a\n"
                        "assert a.Agent.__module__ == 'ckpt_controller.agent.server'\n"
                        "assert set(a.__all__) <= set(dir(a))")
    assert "ckpt_controller.agent.server" in modules
    import ckpt_controller.agent as agent

    with pytest.raises(AttributeError, match="NoSuchThing"):
        getattr(agent, "NoSuchThing")


# ---------------------------------------------------------------- the shared helpers


def test_free_port_is_free_on_loopback():
    from ckpt_controller.endpoints import free_port

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:  # nobody holds it: a listener may bind it at once
        s.bind(("127.0.0.1", port))


def test_the_cli_and_the_controller_derive_one_runtime_dir(tmp_path, monkeypatch):
    from ckpt_controller.cli import default_controller
    from ckpt_controller.endpoints import runtime_dir, runtime_dir_path

    monkeypatch.delenv("CKPT_CONTROLLER", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", f"{tmp_path}/")  # a trailing slash, as some set it
    assert runtime_dir_path() == tmp_path / "ckpt-controller"
    assert not runtime_dir_path().exists()  # naming it (for --help) creates nothing
    assert default_controller() == f"ipc://{tmp_path}/ckpt-controller/controller.sock"
    assert runtime_dir() == runtime_dir_path() and runtime_dir_path().is_dir()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_dir_path() == Path(f"/tmp/ckpt-controller-{os.getuid()}")
    monkeypatch.setenv("CKPT_CONTROLLER", "tcp://127.0.0.1:1")
    assert default_controller() == "tcp://127.0.0.1:1"


_SERVER = """
import sys, time
from ckpt_controller.procutil import StopSignals
stop = StopSignals()
print("ready", flush=True)
try:
    stop.wait(poll_s=30)
finally:
    print("cleaned up", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_wait_and_the_cleanup_runs(sig):
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=scaled(20, below=30))  # before the 30 s poll: a handler
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, out, err) == (0, "cleaned up\n", "")


def test_the_startup_bench_measures_each_command(tmp_path):
    out = tmp_path / "startup.json"
    run = subprocess.run([sys.executable, "bench/startup.py", "--repeat", "2", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=scaled(240))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "ckptctl --help: median" in run.stdout and f"wrote {out}" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "startup" and doc["results"]["goal_help_s"] == 0.3
    rows = {row["command"]: row for row in doc["results"]["commands"]}
    assert {"ckptctl --help", "import ckpt_controller",
            "from ckpt_controller.agent import AgentClient"} < set(rows)
    assert all(len(row["runs_s"]) == len(row["cpu_s"]) == 2 and row["min_s"] > 0
               for row in rows.values())
