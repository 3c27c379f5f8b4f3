"""Multi-host: the controller and an engine in two network namespaces joined by a veth pair
(link-local 169.254.77.1 and .2, made and removed here), over CURVE-authenticated TCP. A
cycle works across the link; a link cut while the engine is PREPARING fails the operation
within the heartbeat timeout, and once the link is back the controller's reconciler rolls
the engine back to RUNNING, journaled; no request is lost. Needs root and ``ip netns``."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.controller.journal import Journal
from ckpt_controller.engine.client import EngineClient
from ckpt_controller.procutil import ReadyProcess
from ckpt_controller.security import generate
from support import ROOT
from support.cli import CKPTCTL, ckptctl
from support.config import engines_toml
from support.netns_util import Namespaces, ip, run_tag
from support.timing import deadline_in, scaled, wait_until

CTL_IP, ENG_IP = "169.254.77.1", "169.254.77.2"


@pytest.fixture
def two_hosts():
    tag = run_tag()
    ctl_ns, eng_ns = f"ckpt-c{tag}", f"ckpt-e{tag}"
    ctl_if, eng_if = f"vckc{tag}", f"vcke{tag}"
    made = Namespaces.or_skip(ctl_ns)
    try:
        made.add(eng_ns)
        made.join(ctl_ns, ctl_if, CTL_IP, eng_ns, eng_if, ENG_IP)
        yield {"ctl_ns": ctl_ns, "eng_ns": eng_ns, "ctl_if": ctl_if}
    finally:
        made.remove()


def _state(endpoint: str) -> dict:
    out = ckptctl("status", "--json", endpoint=endpoint)
    (view,) = json.loads(out.stdout)["engines"]
    return view


def test_cycle_and_link_cut_across_network_namespaces(two_hosts, tmp_path, model_dir):
    keys = {n: generate(tmp_path / "keys", n) for n in ("engine", "controller")}
    admitted = tmp_path / "engine-clients"
    admitted.mkdir()
    (admitted / "controller.key").write_text(keys["controller"][0].read_text())
    py = list(CKPTCTL)
    api = f"ipc://{tmp_path}/far.api"  # the request API over a shared path, for the test
    eng = ReadyProcess(
        ["ip", "netns", "exec", two_hosts["eng_ns"], *py, "engine", "serve", "--name", "far",
         "--api", api, "--control", f"tcp://{ENG_IP}:7700", "--model-dir", str(model_dir),
         "--max-batch", "1", "--curve-secret-key", str(keys["engine"][1]),
         "--curve-clients", str(admitted)], tmp_path / "engine.log", "engine", cwd=ROOT)
    endpoint = f"ipc://{tmp_path}/ctl.sock"
    (tmp_path / "ctl.toml").write_text(
        f'[controller]\nendpoint = "{endpoint}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'curve_secret_key = "{keys["controller"][1]}"\nreconcile_interval_s = 1\n\n'
        + engines_toml(("far", f"tcp://{ENG_IP}:7700"),
                       extra=f'curve_server_key = "{keys["engine"][0]}"'))
    ctl = ReadyProcess(["ip", "netns", "exec", two_hosts["ctl_ns"], *py, "serve", "--config",
                        str(tmp_path / "ctl.toml")], tmp_path / "controller.log", "controller",
                       cwd=ROOT)
    try:
        out = ckptctl("cycle", "far", "--json", endpoint=endpoint)
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["status"] == "succeeded"

        with EngineClient(api) as client, ControllerClient(endpoint) as watcher:
            # one at a time: several seconds of decoding (about 5 s on a quiet machine, more
            # on a busy one), so the prepare, a command that must start first (seconds on a
            # busy machine), still finds them in flight; 1,800 tokens could all be done by then
            ids = [client.submit([5, i], 900) for i in range(6)]
            client.poll(0.5)
            prep = subprocess.Popen(
                [*py, "--controller", endpoint, "prepare", "far", "--op-id", "cut", "--drain",
                 "wait", "--drain-timeout", "8", "--on-deadline", "keep", "--json"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            # asked in this process (a status command per look would take a second or more)
            view = wait_until(lambda: (v := watcher.status().engines[0]).status is not None
                              and v.status.state == "preparing" and v, 30, "PREPARING", 0.1)
            assert view.status.in_flight > 0  # the drain is waiting for requests
            ip("-n", two_hosts["ctl_ns"], "link", "set", two_hosts["ctl_if"], "down")
            cut = time.monotonic()
            stdout, _ = prep.communicate(timeout=scaled(60))
            failed_after = time.monotonic() - cut
            result = json.loads(stdout)
            assert prep.returncode == 4, stdout  # unreachable, within the heartbeat timeout
            assert result["status"] == "failed" and failed_after < 15, failed_after
            view = _state(endpoint)
            assert not view["reachable"] and view["unsettled_by"] == "cut"
            ip("-n", two_hosts["ctl_ns"], "link", "set", two_hosts["ctl_if"], "up")
            deadline = deadline_in(60)
            while True:
                view = _state(endpoint)
                if view["reachable"] and view["unsettled_by"] is None \
                        and view["status"]["state"] == "running":
                    break
                assert time.monotonic() < deadline, view
                time.sleep(0.5)
            while not all(client.requests[r].ended for r in ids):
                assert time.monotonic() < deadline + 180
                client.poll(0.5)
            assert {client.requests[r].finish_reason for r in ids} == {"length"}
        journal = Journal(tmp_path / "state" / "journal.sqlite3")
        try:
            types = [r.type for r in journal.records(engine="far", limit=500)]
            assert "contact_lost" in types and "reconciled" in types
            assert types.index("reconciled") > types.index("contact_lost")
            assert journal.check() == [] and journal.unfinished() == []
        finally:
            journal.close()
    finally:
        ctl.stop()
        eng.stop()
