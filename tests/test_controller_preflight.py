"""What the controller checks before an operation exists, and who goes first: an operator's
operation before the reconciler's probing. Real ``ckptctl serve`` processes and real engine
processes."""

from __future__ import annotations

import json
import threading
import time

from ckpt_controller.agent import AgentClient
from ckpt_controller.controller.journal import Journal


def _toml(*engines) -> str:
    """[[engine]] tables for engine processes (``.control``) or in-process agents (``.endpoint``)."""
    return "".join(f'[[engine]]\nname = "{e.name}"\n'
                   f'control = "{getattr(e, "control", None) or e.endpoint}"\n' for e in engines)


def _wait_state(control: str, state: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    with AgentClient(control) as agent:
        while agent.status().state != state:
            assert time.monotonic() < deadline, f"never {state}"
            time.sleep(0.01)


def _unsettled_and_dead(spawn_engine, ctl_of, name: str):
    """An engine killed in the middle of a prepare: the operation lost contact with it."""
    eng = spawn_engine(name, weights_mib=4, kv_mib=1, step_s=0.05)
    ctl = ctl_of(eng)
    eng.submit("long", 100_000)
    box = {}
    t = threading.Thread(target=lambda: box.update(out=ctl.ckptctl(
        "prepare", name, "--drain", "wait", "--json", "--op-id", "lost")))
    t.start()
    _wait_state(eng.control, "preparing")
    eng.proc.kill()
    t.join(60)
    assert box["out"].returncode == 4, box["out"].stdout + box["out"].stderr
    return eng, ctl


def test_an_operators_restore_goes_before_the_reconcilers_probe(spawn_engine, spawn_controller):
    """The reconciler probes an unreachable unsettled engine all the time (every 0.05 s, each
    probe waiting for an answer that never comes); an operator's restore of it is still run
    (and fails as unreachable), never refused as busy."""
    eng, ctl = _unsettled_and_dead(spawn_engine, lambda e: spawn_controller(
        _toml(e), controller_keys="reconcile_interval_s = 0.05\n"), "un1")
    status = json.loads(ctl.ckptctl("status", "--json").stdout)
    assert status["engines"][0]["unsettled_by"] == "lost"
    out = ctl.ckptctl("restore", "un1", "--json")
    assert "BusyError" not in out.stdout, out.stdout
    assert out.returncode == 4, out.stdout + out.stderr
    assert json.loads(out.stdout)["error"]["kind"] == "UnreachableError"
