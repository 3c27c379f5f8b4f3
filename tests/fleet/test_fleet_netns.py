"""The fleet across hosts: two node controllers, each in a network namespace of its own with its
two engines' agents, joined to the root namespace by a veth pair on link-local addresses
(made and removed here); one etcd member in the root namespace answers on the root side of
both. From the root namespace, ``ckptctl fleet`` sees both nodes and cycles all four engines
on their own nodes; a node whose link is cut is down within its lease's TTL while its own
controller still cycles its engines locally, and once the link is back it registers again
by itself and publishes what it did meanwhile. Needs root, ``ip netns`` and ``make etcd``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ckpt_controller.procutil import ReadyProcess
from support import ROOT, etcd_cluster
from support.cli import ckptctl
from support.config import node_toml
from support.netns_util import Namespaces, ip, run_tag
from support.processes import ControllerProcess, stop_all
from support.timing import scaled, wait_until

pytestmark = pytest.mark.fleet

AGENTS = ROOT / "tests" / "engines" / "agents.py"
TTL_S = 2
#: each node's engines, on its namespace's own loopback: no other namespace can reach them
ENGINES = {"n1": {"a0": "tcp://127.0.0.1:7701", "a1": "tcp://127.0.0.1:7702"},
           "n2": {"b0": "tcp://127.0.0.1:7701", "b1": "tcp://127.0.0.1:7702"}}


@pytest.fixture
def apart():
    """Two namespaces, each with a veth pair to the root namespace: for each node, its
    namespace, the root side's interface and address, and its own address."""
    tag = run_tag()
    hosts = {node: {"ns": f"ckpt-f{node}-{tag}", "root_if": f"vckf{node}r{tag}",
                    "ns_if": f"vckf{node}n{tag}"} for node in ENGINES}
    made = Namespaces.or_skip(hosts["n1"]["ns"])
    try:
        made.add(hosts["n2"]["ns"])
        for host in hosts.values():
            host["root_ip"], host["ns_ip"] = made.join_root(host["ns"], host["root_if"],
                                                            host["ns_if"])
            host["wrap"] = made.exec_in(host["ns"])
        yield hosts
    finally:
        made.remove()


@pytest.fixture
def etcd_on_links(apart, tmp_path):
    """One etcd member in the root namespace answering on the root side of both links."""
    if not etcd_cluster.installed():
        pytest.skip("etcd is not installed: run `make etcd`")
    cluster = etcd_cluster.EtcdCluster(tmp_path / "etcd", size=1,
                                       hosts=[h["root_ip"] for h in apart.values()])
    yield cluster
    cluster.close()


def fleet(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``ckptctl --etcd URL fleet ARGS`` in the root namespace."""
    return ckptctl("--etcd", url, "fleet", *args, timeout=timeout)


def status(url: str) -> tuple[int, dict]:
    r = fleet(url, "status", "--json", timeout=60)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {})


def engines_of(doc: dict) -> dict[str, dict]:
    return {row["engine"]["engine"]: dict(row["engine"], node_up=row["node_up"])
            for row in doc.get("engines", [])}


def all_running(doc: dict, names) -> bool:
    engines = engines_of(doc)
    return all(name in engines and engines[name]["state"] == "running"
               and engines[name]["node_up"] and engines[name]["reachable"] for name in names)


def in_namespace(pid: int, ns: str) -> bool:
    """Process ``pid`` runs in network namespace ``ns`` (not in the root namespace)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{ns}").st_ino


def test_nodes_in_network_namespaces_cycle_and_one_cut_off_comes_back(apart, etcd_on_links,
                                                                       ipc_dir):
    from ckpt_controller.fleet.keys import Keys

    etcd = etcd_on_links
    url = etcd.urls_on(apart["n1"]["root_ip"])[0]  # the root namespace asks through n1's side
    started: list[ReadyProcess] = []
    controllers: dict[str, ControllerProcess] = {}
    try:
        for node, host in apart.items():
            d = ipc_dir / node
            d.mkdir()
            pairs = [f"{name}={control}" for name, control in ENGINES[node].items()]
            started.append(ReadyProcess([*host["wrap"], sys.executable, str(AGENTS), *pairs],
                                        d / "agents.log", f"{node}'s agents", cwd=ROOT))
            text = node_toml(etcd, node, ENGINES[node].items(), ttl=TTL_S, host=host["root_ip"])
            controllers[node] = ControllerProcess(d, text, wrap=host["wrap"])
            started.append(controllers[node])
            assert in_namespace(started[-2].pid, host["ns"])
            assert in_namespace(started[-1].pid, host["ns"])
        n2 = controllers["n2"]
        names = [name for engines in ENGINES.values() for name in engines]
        rc, doc = wait_until(lambda: (got := status(url))[1] and all_running(got[1], names)
                             and len(got[1]["nodes"]) == 2 and got, timeout_s=30,
                             what="two nodes and four engines RUNNING", every_s=0.2)
        assert rc == 0
        assert sorted(n["node"] for n in doc["nodes"]) == ["n1", "n2"]
        assert {name: e["node"] for name, e in engines_of(doc).items()} == {
            "a0": "n1", "a1": "n1", "b0": "n2", "b1": "n2"}

        r = fleet(url, "cycle", "--all", "--max-unavailable", "2", "--op-id", "apart-1",
                  "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads(r.stdout)
        assert result["op"]["status"] == "succeeded"
        assert {p["engine"]: (p["node"], p["status"]) for p in result["parts"]} == {
            "a0": ("n1", "succeeded"), "a1": ("n1", "succeeded"),
            "b0": ("n2", "succeeded"), "b1": ("n2", "succeeded")}
        wait_until(lambda: (d := status(url)[1]) and all_running(d, names) and all(
            e["generation"] == 1 for e in engines_of(d).values()), timeout_s=10,
            what="every engine RUNNING, one generation on", every_s=0.2)

        # n2's link cut on the root side: its lease runs out, n1 stays
        keys = Keys("/ckpt")
        with etcd.client(timeout_s=1.0) as c:
            ip("link", "set", apart["n2"]["root_if"], "down")
            cut = time.monotonic()
            wait_until(lambda: c.get(keys.node("n2")) is None, timeout_s=10,
                       what="n2's record gone with its lease")
            assert time.monotonic() - cut < scaled(TTL_S + 1.5)  # the TTL, and etcd's rounding
            assert c.get(keys.node("n1")) is not None
        r = fleet(url, "status")
        assert r.returncode == 4, r.stdout + r.stderr
        assert "NODE-DOWN (running)" in r.stdout and "down: n2" in r.stdout
        rc, doc = status(url)
        engines = engines_of(doc)
        assert rc == 4 and [n["node"] for n in doc["nodes"]] == ["n1"]
        assert all_running(doc, ["a0", "a1"])
        assert not engines["b0"]["node_up"] and not engines["b1"]["node_up"]

        # cut off, n2's own controller still cycles its engines (nothing local waits for etcd)
        t0 = time.monotonic()
        r = n2.ckptctl("cycle", "b0", "--json")
        local_s = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["status"] == "succeeded"
        assert local_s < scaled(15), local_s

        # the link back: n2 registers again by itself and publishes what it did meanwhile
        ip("link", "set", apart["n2"]["root_if"], "up")
        # (its node record comes first, its engines' records in the same round after it)
        back = wait_until(lambda: (got := status(url)) and got[0] == 0
                          and all_running(got[1], names)
                          and engines_of(got[1])["b0"]["generation"] == 2 and got[1],
                          timeout_s=20, every_s=0.2,
                          what="n2 registered again, its engines RUNNING, b0's local cycle "
                               "(while cut off) published")
        assert sorted(n["node"] for n in back["nodes"]) == ["n1", "n2"]
        assert engines_of(back)["b1"]["generation"] == 1
        assert "etcd unavailable" in n2.log_path.read_text()
    finally:
        stop_all(started)
