"""The Python client as scripts use it (``ckpt_controller.ControllerClient``): the CLI's
parameters as typed keywords, the default endpoint from ``$CKPT_CONTROLLER``, every bad value
refused with the CLI's rule before anything is sent, and examples/cycle.py run against a real
controller. Neighbours: ``controller.client``, ``values``, docs/client.md, ``conftest``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from ckpt_controller import ControllerClient
from ckpt_controller.errors import ConfigError, UsageError
from ckpt_controller.vocab import DrainMode, ReleaseLevel
from support import ROOT
from support.cli import ckptctl
from support.config import engines_toml
from support.timing import scaled


#: (call, the keyword the error names, what it shows of the value)
BAD = [
    (lambda c: c.cycle("e", drain="sideways"), "drain", "'sideways'"),
    (lambda c: c.prepare("e", drain=True), "drain", "True"),
    (lambda c: c.prepare("e", level=3), "level", "3"),
    (lambda c: c.cycle("e", level="2"), "level", "'2'"),
    (lambda c: c.prepare("e", on_deadline="later"), "on_deadline", "'later'"),
    (lambda c: c.prepare("e", budget="lots"), "budget", "'lots'"),
    (lambda c: c.cycle("e", budget=-1), "budget", "-1"),
    (lambda c: c.cycle("e", budget=2**61), "budget", str(2**61)),
    (lambda c: c.prepare("e", drain_timeout=0), "drain_timeout", "0"),
    (lambda c: c.cycle("e", drain_timeout=math.inf), "drain_timeout", "inf"),
    (lambda c: c.capture("e", deadline=math.nan), "deadline", "nan"),
    (lambda c: c.restore("e", deadline=86_401), "deadline", "86401"),
    (lambda c: c.cycle("e", max_unavailable=0), "max_unavailable", "0"),
    (lambda c: c.cycle("e", max_unavailable=1.5), "max_unavailable", "1.5"),
    (lambda c: c.rollback("e", op_id="a b"), "op_id", "'a b'"),
    (lambda c: c.restore("e", image=""), "image", "''"),
    (lambda c: c.cycle(["e", "no good"]), "engines", "'no good'"),
    (lambda c: c.prepare("e", level=1, tags=["kv_cache"]), "tags", "kv_cache"),
    (lambda c: c.prepare("e", tags=[]), "tags", "[]"),
    (lambda c: c.rollback("e", reason="x" * 70_000), "reason", "70000 characters"),
    (lambda c: c.history(limit=0), "limit", "0"),
    # a Python caller gives numbers as numbers: the CLI's own rules refuse a float level
    # ("--level 2.0") and a Python script's text where a number goes ("5" seconds); only a
    # size takes text, as --budget does ("512MiB")
    (lambda c: c.prepare("e", level=2.0), "level", "2.0"),
    (lambda c: c.cycle("e", level=0.0), "level", "0.0"),
    (lambda c: c.cycle("e", deadline="5"), "deadline", "'5'"),
    (lambda c: c.prepare("e", drain_timeout="30"), "drain_timeout", "'30'"),
    (lambda c: c.rollback("e", deadline=b"5"), "deadline", "b'5'"),
    (lambda c: c.cycle("e", max_unavailable="2"), "max_unavailable", "'2'"),
    (lambda c: c.cycle("e", max_unavailable=2.0), "max_unavailable", "2.0"),
    (lambda c: c.cycle("e", max_unavailable="0%"), "max_unavailable", "'0%'"),
    (lambda c: c.cycle("e", max_unavailable="101%"), "max_unavailable", "'101%'"),
    (lambda c: c.cycle("e", max_unavailable="x%"), "max_unavailable", "'x%'"),
    # naming no engine acts on none: every engine only when said (all_engines=True)
    (lambda c: c.cycle(), "engines", "None"),
    (lambda c: c.prepare([]), "engines", "[]"),
    (lambda c: c.rollback(()), "engines", "()"),
    (lambda c: c.operation("prepare"), "engines", "None"),
    (lambda c: c.restore("e", all_engines=True), "engines", "'e'"),
    (lambda c: c.capture(all_engines=1), "all_engines", "1"),
    (lambda c: c.history(limit="5"), "limit", "'5'"),
    (lambda c: c.prepare("e", budget=1.5e9), "budget", "1500000000.0"),
    (lambda c: c.restore("e", image=5), "image", "5"),
    (lambda c: c.capture("e", timeout_s="60"), "timeout_s", "'60'"),
    (lambda c: c.operation("cycle", "e", deadline_s="5"), "deadline_s", "'5'"),
    (lambda c: c.operation("cycle", "e", level=2.0), "level", "2.0"),
]


@pytest.mark.parametrize("call,field,shown", BAD, ids=[f"{f}-{s[:10]}" for _, f, s in BAD])
def test_bad_values_are_refused_before_anything_is_sent(silent_server, call, field, shown):
    endpoint, received = silent_server
    with ControllerClient(endpoint, timeout_s=0.5, retries=0) as client:
        with pytest.raises(UsageError) as info:
            call(client)
    err = info.value
    assert err.exit_code == 2 and err.details["field"] == field, err
    assert shown in str(err), err
    assert received() == 0  # nothing reached the server


def test_bad_values_need_no_server_at_all(ipc_dir):
    """No process serves the endpoint: the typed error still comes at once, not an
    ``UnreachableError`` after the retries."""
    with ControllerClient(f"ipc://{ipc_dir}/nobody.sock", timeout_s=5) as client:
        for call, field, _ in BAD:
            with pytest.raises(UsageError) as info:
                call(client)
            assert info.value.details["field"] == field


def test_the_default_endpoint_is_the_clis(monkeypatch, tmp_path):
    from ckpt_controller.cli import build_parser

    monkeypatch.setenv("CKPT_CONTROLLER", "tcp://127.0.0.1:1")
    with ControllerClient() as client:
        assert client.endpoint == "tcp://127.0.0.1:1"
    assert build_parser().parse_args(["status"]).controller == "tcp://127.0.0.1:1"
    monkeypatch.delenv("CKPT_CONTROLLER")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with ControllerClient() as client:
        assert client.endpoint == f"ipc://{tmp_path}/ckpt-controller/controller.sock"
    assert build_parser().parse_args(["status"]).controller == client.endpoint


def test_a_garbage_ckpt_controller_is_named_as_the_variable(monkeypatch):
    """``$CKPT_CONTROLLER`` that is no endpoint: a ConfigError (exit 2) that says the value
    came from the variable (it said only "endpoint must start with ipc://..."), from the
    client and from ckptctl alike; an endpoint passed by hand is reported as before."""
    monkeypatch.setenv("CKPT_CONTROLLER", "garbage")
    with pytest.raises(ConfigError) as info:
        ControllerClient()
    assert str(info.value).startswith("$CKPT_CONTROLLER='garbage': endpoint must start with")
    assert info.value.details["variable"] == "CKPT_CONTROLLER"
    with pytest.raises(ConfigError) as info:
        ControllerClient("nonsense")
    assert "$CKPT_CONTROLLER" not in str(info.value)
    out = ckptctl("status")
    assert out.returncode == 2 and "$CKPT_CONTROLLER='garbage'" in out.stderr, out.stderr


def test_typed_keywords_reach_the_controller(spawn_reference, spawn_controller):
    eng = spawn_reference("ca1")
    ctl = spawn_controller(engines_toml(eng))
    with ControllerClient(ctl.endpoint) as client:
        client.subscribe()
        result = client.cycle("ca1", drain="keep", level=ReleaseLevel.OFFLOAD, budget="1GiB",
                              drain_timeout=5, on_deadline="keep", max_unavailable=1,
                              deadline=60, op_id="typed-1")
        assert result.status == "succeeded" and result.op_id == "typed-1", result
        (o,) = result.engines
        assert o.drain.mode == DrainMode.KEEP and o.released.level == ReleaseLevel.OFFLOAD
        assert o.released.budget_bytes == 1 << 30

        result = client.prepare(["ca1"], drain=DrainMode.ABORT, tags=["kv_cache"])
        (o,) = result.engines
        assert o.state == "prepared" and o.released.tags == ["kv_cache"], result
        assert client.rollback("ca1", reason="typed").status == "succeeded"
        hist = client.history(op_id="typed-1")
        assert hist.operations[0].kind == "cycle"
        (view,) = client.status("ca1").engines
        assert view.status.state == "running"


def test_the_example_script_runs_against_a_real_controller(spawn_reference, spawn_controller):
    eng = spawn_reference("ex1")
    ctl = spawn_controller(engines_toml(eng))
    env = {**os.environ, "CKPT_CONTROLLER": ctl.endpoint}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "cycle.py"), "ex1",
                          "--level", "1", "--budget", "1GiB"], capture_output=True, text=True,
                         env=env, timeout=scaled(120), cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "ex1: running"
    assert lines[1].startswith("cycle ") and ": succeeded in " in lines[1]
    assert lines[2].startswith("  ex1: succeeded, now running [prepare ")
    assert "released" in out.stdout and "at level 1" in out.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "examples" / "cycle.py"), "ex1",
                          "--drain", "sideways"], capture_output=True, text=True, env=env,
                         timeout=scaled(120), cwd=ROOT)
    assert bad.returncode == 2 and "UsageError: drain = 'sideways'" in bad.stderr, bad.stderr


def test_a_hand_built_frame_with_a_bad_limit_is_refused(spawn_reference, spawn_controller):
    """The wire's own checks: both limits at once, or a percentage outside 1..100, refused
    before anything runs (a client of another language sends what it likes)."""
    from ckpt_controller import protocol as p
    from ckpt_controller.errors import ProtocolError

    eng = spawn_reference("lim")
    ctl = spawn_controller(engines_toml(eng))
    with ControllerClient(ctl.endpoint) as client:
        both = p.OperationCommand(call_id=0, op_id="both", kind="cycle", engines=["lim"],
                                  max_unavailable=1, max_unavailable_percent=50)
        with pytest.raises(UsageError, match="not both"):
            client.call(p.RequestType.OPERATION, both, timeout_s=30)
        client.checks_commands = False  # as a client that does not check its own frames
        for percent in (0, 101):
            cmd = p.OperationCommand(call_id=0, op_id=f"pct{percent}", kind="cycle",
                                     engines=["lim"], max_unavailable_percent=percent)
            with pytest.raises(ProtocolError):
                client.call(p.RequestType.OPERATION, cmd, timeout_s=30)
        assert client.history(limit=5).operations == []  # nothing began
