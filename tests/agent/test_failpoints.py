"""Agent failpoints (what a drill arms through CKPT_FAILPOINTS): parsing, and each action's
effect on a real agent with a real MemoryRegistry over real sockets. ``kill`` is driven by
the drill tests (it ends the process)."""

from __future__ import annotations

import time

import pytest
import torch

from ckpt_controller.agent import Agent, AgentClient
from ckpt_controller.agent.failpoints import Failpoints, parse
from ckpt_controller.errors import (
    ConfigError,
    ResidualOverBudgetError,
    UnreachableError,
    VerificationError,
)
from ckpt_controller.memory import MemoryRegistry, measure
from ckpt_controller.memory.safetensors_io import save_file
from support.timing import deadline_in, scaled


def test_parse_and_refuse():
    fps = parse("drain:kill, release:stall=2.5,rewake:corrupt,release:ballast=64MiB")
    assert [str(x) for x in fps] == ["drain:kill", "release:stall=2.5", "rewake:corrupt",
                                     f"release:ballast={64 << 20}"]
    assert parse("") == []
    for bad, words in [("seal:kill", "unknown point"), ("drain:explode", "unknown action"),
                       ("drain:corrupt", "only at rewake"), ("drain:stall", "needs =AMOUNT"),
                       ("drain:kill=3", "takes no amount"), ("drain:stall=0", "seconds"),
                       ("release:ballast=lots", "size")]:
        with pytest.raises(ConfigError, match=words):
            parse(bad)


def _agent(ipc_dir, spec: str, registry: MemoryRegistry | None = None) -> Agent:
    return Agent("fp", memory=registry, control=f"ipc://{ipc_dir}/fp.ctl",
                 heartbeat_interval_s=0.05, failpoints=Failpoints(parse(spec)))


def _registry(tmp_path, source: bool = False) -> tuple[MemoryRegistry, torch.Tensor]:
    w = torch.arange(4096, dtype=torch.float32)
    reg = MemoryRegistry()
    path = None
    if source:
        path = tmp_path / "w.safetensors"
        save_file({"w": w}, path)
    reg.register("weights", {"w": w}, source=path)
    reg.register("kv_cache", {"kv": torch.zeros(8192)})
    return reg, w


@pytest.mark.parametrize("source", [True, False])
def test_corrupt_flips_a_weight_bit_that_verification_catches(ipc_dir, tmp_path, source):
    reg, w = _registry(tmp_path, source)
    want = w.clone()
    with _agent(ipc_dir, "rewake:corrupt", reg) as agent, \
            AgentClient(agent.endpoint, timeout_s=5) as c:
        c.prepare(op_id="p1", level=1, drain="abort")
        with pytest.raises(VerificationError) as info:
            c.restore(op_id="r1")
        assert info.value.details["tensor"] == "w" and c.status().state == "failed"
        assert info.value.details["got"] != info.value.details["expected"]
        assert agent.failpoints.armed == []  # fired once
        # (with a source file the weights are released again: not to be read until restored)
        if source:  # recovery from FAILED reloads the weights from their file and checks them
            assert "reloads weights" in info.value.details["recovery"]
            c.restore(op_id="r2")
            assert c.status().state == "running" and torch.equal(w, want)
        else:  # no file to reload from: the bad bytes are never served
            assert not torch.equal(w, want)
            with pytest.raises(VerificationError):
                c.restore(op_id="r2")
            assert c.status().state == "failed"


def test_ballast_makes_the_residual_exceed_its_budget_and_rolls_back(ipc_dir, tmp_path):
    reg, _ = _registry(tmp_path)
    budget = measure.rss_bytes() + (64 << 20)
    with _agent(ipc_dir, "release:ballast=256MiB", reg) as agent, \
            AgentClient(agent.endpoint, timeout_s=10) as c:
        with pytest.raises(ResidualOverBudgetError) as info:
            c.prepare(op_id="p1", level=1, drain="abort", residual_budget_bytes=budget)
        assert info.value.details["residual_bytes"] > budget
        assert info.value.details["rolled_back"] is True and c.status().state == "running"
        c.prepare(op_id="p2", level=1, drain="abort", residual_budget_bytes=budget)  # no ballast
        assert c.status().state == "prepared"


def test_stall_silences_the_agent_then_it_finishes(ipc_dir):
    with _agent(ipc_dir, "release:stall=1.5") as agent:
        with AgentClient(agent.endpoint, timeout_s=0.5, retries=0,
                         heartbeat_interval_s=0.05, missed_beats=4) as c:
            c.subscribe()
            start = time.monotonic()
            with pytest.raises(UnreachableError):
                c.prepare(op_id="p1", level=0, drain="abort")
            assert time.monotonic() - start < scaled(1.2, below=1.5)  # gone, not the 1.5 s stall
        time.sleep(1.5)
        with AgentClient(agent.endpoint, timeout_s=5) as c:
            deadline = deadline_in(5)
            while c.status().current_op and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.status().state == "prepared"  # the operation went on after the stall
