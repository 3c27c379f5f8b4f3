"""The fleet layer's node side against a real etcd (``make etcd``): registration under a lease,
engine records current within about a second, a node that dies or stops, a name two nodes
claim, etcd lost and back, TLS with client certificates, and a node without ``[fleet]`` that
loads nothing of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ckpt_controller.agent import Agent
from ckpt_controller.agent.engine import EngineHooks
from support import ROOT, etcd_cluster
from support.cli import CKPTCTL, ckptctl
from support.config import engines_toml, node_toml
from support.processes import ControllerProcess, stop_all
from support.timing import scaled, wait_until

pytestmark = pytest.mark.fleet


class OutOfService(EngineHooks):
    """Counts the engines paused at once (out of service) across every agent sharing
    ``shared``, and the most ever; each pause takes ``seconds``."""

    def __init__(self, shared: dict, seconds: float) -> None:
        self.shared, self.seconds = shared, seconds

    def pause_scheduling(self) -> None:
        with self.shared["lock"]:
            self.shared["now"] += 1
            self.shared["most"] = max(self.shared["most"], self.shared["now"])
        time.sleep(self.seconds)

    def resume_scheduling(self) -> None:
        with self.shared["lock"]:
            self.shared["now"] -= 1


def fleet_json(cluster, *extra: str) -> tuple[int, dict | None]:
    args = ["--etcd", ",".join(cluster.urls)]
    if cluster.certs is not None:
        c = cluster.certs
        args += ["--etcd-ca", str(c.ca), "--etcd-cert", str(c.client), "--etcd-key",
                 str(c.client_key)]
    r = ckptctl(*args, *extra, "fleet", "status", "--json")
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else None)


def engines_of(doc: dict | None) -> dict[str, dict]:
    return {row["engine"]["engine"]: dict(row["engine"], node_up=row["node_up"])
            for row in (doc or {}).get("engines", [])}


@pytest.fixture
def agents(ipc_dir):
    started = []

    def make(*names: str, hooks=None):
        new = [Agent(n, hooks=hooks, control=f"ipc://{ipc_dir}/{n}.ctl",
                     heartbeat_interval_s=0.2).start() for n in names]
        started.extend(new)
        return new

    yield make
    for a in started:
        a.close()


@pytest.fixture
def nodes(ipc_dir):
    started: list[ControllerProcess] = []

    def spawn(name: str, text: str) -> ControllerProcess:
        d = ipc_dir / name
        d.mkdir(exist_ok=True)
        ctl = ControllerProcess(d, text)
        started.append(ctl)
        return ctl

    yield spawn
    stop_all(started)


def test_a_node_registers_and_its_engines_follow_their_state(etcd, agents, nodes):
    a, b = agents("fa", "fb")
    ctl = nodes("n1", node_toml(etcd, "n1", [a, b], labels={"model": "llama-8b", "pool": "a"}))
    doc = wait_until(lambda: (d := fleet_json(etcd)[1]) and len(engines_of(d)) == 2 and d,
                     what="both engines published")
    assert [n["node"] for n in doc["nodes"]] == ["n1"]
    assert doc["version"] == 1 and doc["nodes"][0]["controller"] == ctl.endpoint
    for name, agent in (("fa", a), ("fb", b)):
        rec = engines_of(doc)[name]
        assert rec["node"] == "n1" and rec["node_up"] and rec["reachable"]
        assert rec["state"] == "running" and rec["generation"] == 0
        assert rec["labels"] == {"model": "llama-8b", "pool": "a"}
        assert rec["endpoints"] == {"control": agent.endpoint}

    # a change is in etcd within about a second of the operation's end (read from etcd
    # here: each `fleet status` is a process of its own, and two of them could take the 1.5 s)
    from ckpt_controller.fleet.keys import Keys

    with etcd.client() as c:
        r = ctl.ckptctl("prepare", "fa", "--op-id", "fleet-p1", "--json")
        assert r.returncode == 0, r.stderr
        ended = time.monotonic()
        got = wait_until(lambda: (kv := c.get(Keys("/ckpt").engine("fa"))) and json.loads(
            kv.value)["state"] == "prepared", timeout_s=5, what="fa PREPARED in etcd")
        assert got and time.monotonic() - ended < scaled(1.5)
    rec = engines_of(fleet_json(etcd)[1])["fa"]
    assert rec["last_op"] == "fleet-p1" and rec["holder"] is None and rec["age_s"] >= 0
    assert rec["since_at"].endswith("Z") and rec["since_at_unix"] > 0
    assert engines_of(fleet_json(etcd)[1])["fb"]["state"] == "running"

    # the table an operator reads ($CKPT_ETCD for --etcd)
    r = ckptctl("fleet", "status", env={"CKPT_ETCD": etcd.urls[0]})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NODE", "NAME", "STATE", "GEN", "HELD-BY", "LAST-OP", "AGE"]
    row = next(line.split() for line in lines if " fa " in f" {line} ")
    assert row[:4] == ["n1", "fa", "prepared", "0"] and row[5] == "fleet-p1"
    assert "1 node(s) up" in r.stdout

    assert ctl.ckptctl("restore", "fa", "--json").returncode == 0
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("fa", {}).get("state")
               == "running", timeout_s=5, what="fa RUNNING again in etcd")


def test_a_node_killed_is_shown_down_within_its_lease_and_returns(etcd, agents, nodes):
    (a,) = agents("ka")
    text = node_toml(etcd, "n1", [a], ttl=2)
    ctl = nodes("n1", text)
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("ka", {}).get("node_up"),
               what="ka published")
    from ckpt_controller.fleet.keys import Keys

    with etcd.client() as c:  # read from etcd here, not through a `fleet status` process
        os.kill(ctl.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: c.get(Keys("/ckpt").node("n1")) is None, timeout_s=10,
                   what="the node's record gone with its lease")
        assert time.monotonic() - killed < scaled(2 + 3.0)  # the TTL, etcd's rounding
    assert fleet_json(etcd)[1]["nodes"] == []
    rc, doc = fleet_json(etcd)
    rec = engines_of(doc)["ka"]
    assert rc == 4 and not rec["node_up"] and rec["state"] == "running"  # the last known
    r = ckptctl("--etcd", etcd.urls[0], "fleet", "status")
    assert r.returncode == 4 and "NODE-DOWN (running)" in r.stdout and "down: n1" in r.stdout

    ctl.proc.wait()
    ctl2 = nodes("n1", text)  # restarted: the same state dir (its node id)
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("ka", {}).get("node_up"),
               what="the node back and its engine up")
    assert fleet_json(etcd)[1]["nodes"][0]["pid"] == ctl2.pid


def test_a_node_stopped_cleanly_leaves_the_fleet_at_once(etcd, agents, nodes):
    (a,) = agents("sa")
    ctl = nodes("n1", node_toml(etcd, "n1", [a], ttl=30))
    wait_until(lambda: fleet_json(etcd)[1]["nodes"], what="registered")
    ctl.proc.terminate()
    ctl.proc.wait(timeout=scaled(20))
    # a lease of 30 s: gone at once only because the controller revoked it
    assert fleet_json(etcd)[1]["nodes"] == []
    assert not engines_of(fleet_json(etcd)[1])["sa"]["node_up"]


def test_an_engine_name_two_nodes_claim_is_published_by_the_first_only(etcd, agents, nodes,
                                                                        ipc_dir):
    (a,) = agents("dup")
    nodes("n1", node_toml(etcd, "n1", [a]))
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("dup"), what="dup published")
    other = Agent("dup", control=f"ipc://{ipc_dir}/dup2.ctl", heartbeat_interval_s=0.2).start()
    try:
        n2 = nodes("n2", node_toml(etcd, "n2", [other]))
        wait_until(lambda: len(fleet_json(etcd)[1]["nodes"]) == 2, what="both nodes up")
        wait_until(lambda: "registered by node n1" in n2.log_path.read_text(), timeout_s=10,
                   what="n2 saying who owns dup")
        # prepare on n2's own engine: etcd still shows n1's, which stays RUNNING
        assert n2.ckptctl("prepare", "dup", "--json").returncode == 0
        time.sleep(1.0)  # several publish intervals: n2 must not have written it
        rec = engines_of(fleet_json(etcd)[1])["dup"]
        assert rec["node"] == "n1" and rec["state"] == "running"
        assert rec["endpoints"]["control"] == a.endpoint
    finally:
        other.close()


def test_etcd_lost_the_node_serves_on_and_registers_again(etcd, agents, nodes):
    (a,) = agents("la")
    ctl = nodes("n1", node_toml(etcd, "n1", [a], ttl=2))
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("la"), what="la published")
    etcd.stop(0)
    # fleet commands fail fast and say why; the node's own operations go on
    t0 = time.monotonic()
    rc, _ = fleet_json(etcd)
    r = ckptctl("--etcd", etcd.urls[0], "fleet", "status")
    assert rc == 4 and r.returncode == 4 and "etcd is unavailable" in r.stderr
    assert time.monotonic() - t0 < scaled(10)
    for _ in range(2):
        r = ctl.ckptctl("cycle", "la", "--json")
        assert r.returncode == 0, r.stderr
    assert ctl.ckptctl("prepare", "la", "--json").returncode == 0
    time.sleep(3)  # longer than the lease: it expires while etcd is away
    etcd.start(0)
    etcd.wait_healthy()
    rec = wait_until(lambda: (e := engines_of(fleet_json(etcd)[1]).get("la")) and e["node_up"]
                     and e["state"] == "prepared" and e, timeout_s=15,
                     what="the node registered again and la's state current")
    assert rec["generation"] == 2
    assert "etcd unavailable" in ctl.log_path.read_text()


@pytest.mark.skipif(not etcd_cluster.installed(), reason="etcd is not installed: run `make etcd`")
def test_tls_with_client_certificates(tmp_path, agents, nodes):
    cluster = etcd_cluster.EtcdCluster(tmp_path / "etcd", size=1, tls=True)
    try:
        (a,) = agents("ta")
        nodes("n1", node_toml(cluster, "n1", [a]))
        wait_until(lambda: engines_of(fleet_json(cluster)[1]).get("ta"), what="published over TLS")
        c = cluster.certs
        url = cluster.urls[0]
        # without a client certificate, or trusting another CA: refused, exit 4, said why
        r = ckptctl("--etcd", url, "--etcd-ca", str(c.ca), "fleet", "status")
        assert r.returncode == 4 and "etcd is unavailable" in r.stderr
        assert "TLS handshake failed" in r.stderr
        r = ckptctl("--etcd", url, "--etcd-ca", str(c.other_ca), "--etcd-cert", str(c.client),
                    "--etcd-key", str(c.client_key), "fleet", "status")
        assert r.returncode == 4 and "CERTIFICATE_VERIFY_FAILED" in r.stderr, r.stderr
        r = ckptctl("--etcd", url, "--etcd-cert", str(c.client), "fleet", "status")
        assert r.returncode == 2 and "go together" in r.stderr
    finally:
        cluster.close()


@pytest.mark.skipif(not etcd_cluster.installed(), reason="etcd is not installed: run `make etcd`")
def test_three_members_one_stopped_the_fleet_goes_on(tmp_path, agents, nodes):
    cluster = etcd_cluster.EtcdCluster(tmp_path / "etcd", size=3)
    try:
        (a,) = agents("ma")
        ctl = nodes("n1", node_toml(cluster, "n1", [a], ttl=3))
        wait_until(lambda: engines_of(fleet_json(cluster)[1]).get("ma"), what="published")
        cluster.stop(0)  # the member the node talked to first
        assert ctl.ckptctl("prepare", "ma", "--json").returncode == 0
        wait_until(lambda: engines_of(fleet_json(cluster)[1]).get("ma", {}).get("state")
                   == "prepared", timeout_s=10, what="published through the other members")
        assert fleet_json(cluster)[1]["nodes"][0]["node"] == "n1"  # the lease held
    finally:
        cluster.close()


def test_a_node_without_fleet_loads_nothing_of_it(ipc_dir):
    """The process ``ckptctl serve`` composes (``serve.NodeService``) with no ``[fleet]``:
    nothing of the fleet layer (etcd's client with it) is imported."""
    code = f"""
import sys
from ckpt_controller.controller.config import parse_config
from ckpt_controller.serve import NodeService
s = NodeService(parse_config('[controller]\\nendpoint = "ipc://{ipc_dir}/c.sock"\\nstate_dir = "{ipc_dir}/st"\\n')).start()
assert s.fleet is None
s.close()
print(sorted(m for m in sys.modules if m.startswith("ckpt_controller.fleet")))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=scaled(60), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def fleet(cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return ckptctl("--etcd", ",".join(cluster.urls), "fleet", *args, timeout=timeout)


def two_nodes(etcd, agents, nodes, hooks=None, per: int = 2, ttl: int = 2):
    a = agents(*[f"a{i}" for i in range(per)], hooks=hooks)
    b = agents(*[f"b{i}" for i in range(per)], hooks=hooks)
    n1 = nodes("n1", node_toml(etcd, "n1", a, labels={"pool": "a"}, ttl=ttl))
    n2 = nodes("n2", node_toml(etcd, "n2", b, labels={"pool": "b"}, ttl=ttl))
    wait_until(lambda: len(engines_of(fleet_json(etcd)[1])) == 2 * per
               and len(fleet_json(etcd)[1]["nodes"]) == 2, what="both nodes and engines up")
    return a, b, n1, n2


def test_a_fleet_cycle_rolls_across_nodes_under_max_unavailable(etcd, agents, nodes):
    import threading

    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    two_nodes(etcd, agents, nodes, hooks=OutOfService(shared, 0.3))
    # 50% of the four named: two at most
    r = fleet(etcd, "cycle", "--all", "--max-unavailable", "50%", "--op-id", "roll-1", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["op"]["status"] == "succeeded" and doc["op"]["max_unavailable"] == 2
    assert [p["status"] for p in doc["parts"]] == ["succeeded"] * 4
    assert {p["engine"]: p["node"] for p in doc["parts"]} == {
        "a0": "n1", "a1": "n1", "b0": "n2", "b1": "n2"}
    assert shared["most"] == 2  # two at once across the nodes, never three
    # back in service: nothing counted as unavailable, every engine RUNNING, one generation on
    with etcd.client() as c:
        from ckpt_controller.fleet import unavailable
        from ckpt_controller.fleet.keys import Keys

        assert unavailable.read(c, Keys("/ckpt"))[0] == {}
    recs = wait_until(lambda: (e := engines_of(fleet_json(etcd)[1])) and all(
        x["generation"] > 0 for x in e.values()) and e, what="generations published")
    assert {x["state"] for x in recs.values()} == {"running"}
    gens = {n: x["generation"] for n, x in recs.items()}
    assert len(set(gens.values())) == 1
    # the same id again: the same result, nothing run twice
    again = fleet(etcd, "cycle", "--all", "--op-id", "roll-1", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["op"] == doc["op"]
    time.sleep(0.6)  # three publish intervals
    assert {n: x["generation"] for n, x in engines_of(fleet_json(etcd)[1]).items()} == gens
    # the same id for something else is refused
    other = fleet(etcd, "prepare", "a0", "--op-id", "roll-1")
    assert other.returncode == 2 and "already used" in other.stderr
    # no limit named: a quarter of the four (one) at a time, never all at once
    shared["most"] = 0
    r = fleet(etcd, "cycle", "--all", "--op-id", "roll-2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["op"]["max_unavailable"] == 1 and shared["most"] == 1
    assert [p["status"] for p in doc["parts"]] == ["succeeded"] * 4


def test_a_fleet_prepare_holds_its_places_until_restored(etcd, agents, nodes):
    two_nodes(etcd, agents, nodes)
    r = fleet(etcd, "prepare", "--selector", "pool=a", "--max-unavailable", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("prepared") == 2
    # a capture of PREPARED engines runs on their node (no dump hook here: nothing dumped)
    r = fleet(etcd, "capture", "a0", "a1", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(p["status"], p["state"]) for p in json.loads(r.stdout)["parts"]] == [
        ("succeeded", "prepared")] * 2
    # two are out: a prepare (or a cycle) that would pass the limit is refused up front
    r = fleet(etcd, "prepare", "b0", "--max-unavailable", "2")
    assert r.returncode == 2 and "cannot hold" in r.stderr and "a0, a1" in r.stderr
    r = fleet(etcd, "cycle", "b0", "b1", "--max-unavailable", "2")
    assert r.returncode == 2 and "cannot hold" in r.stderr
    # a node-local prepare counts too: with a0 back, b0 prepared on its node fills the place
    assert fleet(etcd, "restore", "a0").returncode == 0
    n2_ctl = [n for n in fleet_json(etcd)[1]["nodes"] if n["node"] == "n2"][0]["controller"]
    assert ckptctl("--controller", n2_ctl, "prepare", "b0").returncode == 0
    r = fleet(etcd, "prepare", "b1", "--max-unavailable", "2")
    assert r.returncode == 2 and "cannot hold" in r.stderr
    assert fleet(etcd, "rollback", "a1", "b0").returncode == 0
    assert fleet(etcd, "prepare", "b1", "--max-unavailable", "1").returncode == 0
    assert fleet(etcd, "restore", "b1").returncode == 0


def test_one_operation_per_engine_across_the_fleet(etcd, agents, nodes):
    import threading

    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    (a,) = agents("slow", hooks=OutOfService(shared, 3.0))
    ctl = nodes("n1", node_toml(etcd, "n1", [a]))
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("slow"), what="published")
    proc = subprocess.Popen([*CKPTCTL, "--controller",
                             ctl.endpoint, "prepare", "slow", "--op-id", "local-1"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with etcd.client() as c:
            from ckpt_controller.fleet.keys import Keys

            wait_until(lambda: c.get(Keys("/ckpt").lock("slow")), what="the lock in etcd")
            assert c.get(Keys("/ckpt").lock("slow")).value == b"local-1"
        r = fleet(etcd, "cycle", "slow", "--json")
        assert r.returncode == 1
        part = json.loads(r.stdout)["parts"][0]
        assert part["status"] == "failed" and "held by operation local-1" in part["error"]
    finally:
        assert proc.wait(timeout=scaled(30)) == 0
    with etcd.client() as c:
        assert c.get(Keys("/ckpt").lock("slow")) is None  # freed at the end


class Counting(OutOfService):
    """``OutOfService`` that also counts each engine's pauses (a step run twice shows)."""

    def __init__(self, shared: dict, seconds: float, name: str) -> None:
        super().__init__(shared, seconds)
        self.name = name

    def pause_scheduling(self) -> None:
        with self.shared["lock"]:
            self.shared.setdefault("pauses", {}).setdefault(self.name, 0)
            self.shared["pauses"][self.name] += 1
        super().pause_scheduling()


def counted_agents(ipc_dir, names, shared, seconds):
    return [Agent(n, hooks=Counting(shared, seconds, n), control=f"ipc://{ipc_dir}/{n}.ctl",
                  heartbeat_interval_s=0.2).start() for n in names]


def part_status(cluster, op_id: str) -> dict[str, str]:
    from ckpt_controller.fleet import ops
    from ckpt_controller.fleet.keys import Keys

    with cluster.client() as c:
        return {n: p.status for n, (p, _) in ops.read_parts(c, Keys("/ckpt"), op_id).items()}


def cycle_then_kill(cluster, args: list[str], shared: dict, node, what: str):
    """``fleet cycle ARGS --max-unavailable 1`` started in the background; once one part is
    paused (``what``), ``node`` is killed (SIGKILL); the command, still running."""
    proc = subprocess.Popen([*CKPTCTL, "--etcd", cluster.urls[0], "fleet", "cycle", *args,
                             "--max-unavailable", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_until(lambda: shared["now"] == 1, what=what)
    os.kill(node.pid, signal.SIGKILL)
    node.proc.wait()
    return proc


def coordinator_of(cluster) -> str | None:
    from ckpt_controller.fleet.keys import Keys

    with cluster.client() as c:
        kv = c.get(Keys("/ckpt").coordinator)
        return kv.value.decode() if kv else None


def test_the_operation_outlives_the_command_that_started_it(etcd, ipc_dir, nodes):
    import threading

    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    # each pause 1.5 s: the operation still runs when the second command is interrupted
    a = counted_agents(ipc_dir, ["o0", "o1", "o2"], shared, 1.5)
    try:
        nodes("n1", node_toml(etcd, "n1", a))
        wait_until(lambda: len(engines_of(fleet_json(etcd)[1])) == 3, what="published")
        args = [*CKPTCTL, "--etcd", etcd.urls[0], "fleet",
                "cycle", "--all", "--max-unavailable", "1", "--op-id", "outlive"]
        first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        wait_until(lambda: "started" in part_status(etcd, "outlive").values(),
                   what="a part started")
        first.kill()  # kill -9 of the operator's ckptctl
        first.wait()
        second = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        said = second.stderr.readline()  # following it now (its first line)
        assert said.startswith("fleet cycle outlive:"), said
        second.send_signal(signal.SIGINT)  # Ctrl-C: the command ends, the operation does not
        out, err = second.communicate(timeout=scaled(30))
        assert second.returncode == 130 and "goes on" in err
        r = fleet(etcd, "cycle", "--all", "--op-id", "outlive", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert [p["status"] for p in json.loads(r.stdout)["parts"]] == ["succeeded"] * 3
        assert shared["pauses"] == {"o0": 1, "o1": 1, "o2": 1} and shared["most"] == 1
    finally:
        for agent in a:
            agent.close()


def _coordinators_and_workers(etcd, ipc_dir, nodes, shared, seconds, engines=4):
    """Two engine-less nodes that may coordinate (c0 first, so it does) and two that may not,
    with the engines."""
    c0 = nodes("c0", node_toml(etcd, "c0"))
    wait_until(lambda: coordinator_of(etcd) == "c0", what="c0 coordinating")
    c1 = nodes("c1", node_toml(etcd, "c1"))
    half = engines // 2
    a = counted_agents(ipc_dir, [f"w{i}" for i in range(half)], shared, seconds)
    b = counted_agents(ipc_dir, [f"w{i}" for i in range(half, engines)], shared, seconds)
    workers = [nodes(n, node_toml(etcd, n, ag, extra="coordinator = false\n"))
               for n, ag in (("n1", a), ("n2", b))]
    wait_until(lambda: len(engines_of(fleet_json(etcd)[1])) == engines
               and len(fleet_json(etcd)[1]["nodes"]) == 4, what="four nodes and the engines")
    return {"c0": c0, "c1": c1}, workers, a + b


def test_the_coordinator_killed_mid_operation_another_finishes_it(etcd, ipc_dir, nodes):
    import threading

    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    coords, _, agents_ = _coordinators_and_workers(etcd, ipc_dir, nodes, shared, 0.4)
    try:
        proc = subprocess.Popen([*CKPTCTL, "--etcd",
                                 etcd.urls[0], "fleet", "cycle", "--all", "--max-unavailable",
                                 "1", "--op-id", "failover", "--json"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: "started" in part_status(etcd, "failover").values(),
                   what="a part started")
        os.kill(coords["c0"].pid, signal.SIGKILL)
        killed = time.monotonic()
        # when c1 takes over, seen from here while the commands below start (each a process)
        took_over = []

        def see_c1() -> None:
            end = time.monotonic() + scaled(20)
            while time.monotonic() < end and coordinator_of(etcd) != "c1":
                time.sleep(0.05)
            took_over.append(time.monotonic())

        seer = threading.Thread(target=see_c1, daemon=True)
        seer.start()
        # meanwhile the operation is listed as running, and can be watched by anyone
        rc, doc = fleet_json(etcd)
        assert [o["op_id"] for o in doc["operations"]] == ["failover"]
        assert doc["operations"][0]["total"] == 4
        watch = subprocess.Popen([*CKPTCTL, "--etcd",
                                  etcd.urls[0], "fleet", "watch", "failover", "--json"],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        seer.join()
        assert coordinator_of(etcd) == "c1", "c1 did not take over"
        assert took_over[0] - killed < scaled(2 + 3.0)  # within the lease's TTL
        w_out, w_err = watch.communicate(timeout=scaled(60))
        assert watch.returncode == 0, w_out + w_err
        lines = [json.loads(line) for line in w_out.splitlines()]
        assert lines[-1]["op"]["status"] == "succeeded"
        ends = {x["part"]["engine"] for x in lines[:-1] if x["part"]["status"] == "succeeded"}
        assert ends == {"w0", "w1", "w2", "w3"}
        out, err = proc.communicate(timeout=scaled(60))
        assert proc.returncode == 0, out + err
        assert [p["status"] for p in json.loads(out)["parts"]] == ["succeeded"] * 4
        assert shared["pauses"] == {f"w{i}": 1 for i in range(4)}  # none ran twice
        assert shared["most"] == 1
    finally:
        for agent in agents_:
            agent.close()


def test_a_node_killed_mid_operation_its_part_is_lost_and_it_converges(etcd, ipc_dir, nodes):
    import threading

    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    fast = counted_agents(ipc_dir, ["a0", "a1"], shared, 0.0)
    slow = counted_agents(ipc_dir, ["b0"], shared, 3.0)
    try:
        nodes("n1", node_toml(etcd, "n1", fast))
        wait_until(lambda: coordinator_of(etcd) == "n1", what="n1 coordinating")
        text = node_toml(etcd, "n2", slow)
        n2 = nodes("n2", text)
        wait_until(lambda: len(engines_of(fleet_json(etcd)[1])) == 3, what="published")
        proc = cycle_then_kill(etcd, ["b0", "a0", "a1", "--op-id", "lose-n2", "--json"],
                               shared, n2, "b0's part running on n2")
        out, err = proc.communicate(timeout=scaled(60))
        assert proc.returncode == 4, out + err  # a part lost: the node is unreachable
        parts = {p["engine"]: p for p in json.loads(out)["parts"]}
        assert parts["b0"]["status"] == "lost" and "n2 was lost" in parts["b0"]["error"]
        assert parts["a0"]["status"] == parts["a1"]["status"] == "skipped"  # none started
        assert shared["pauses"] == {"b0": 1}
        with etcd.client() as c:
            from ckpt_controller.fleet import unavailable
            from ckpt_controller.fleet.keys import Keys

            out_of_service = unavailable.read(c, Keys("/ckpt"))[0]
            assert out_of_service == {"b0": "lost:lose-n2"}
        # the node comes back: it reconciles b0 from its own journal, and the fleet converges
        nodes("n2", text)
        wait_until(lambda: (x := engines_of(fleet_json(etcd)[1]).get("b0")) and x["node_up"]
                   and x["state"] == "running", timeout_s=30, what="b0 RUNNING, its node up")
        with etcd.client() as c:
            wait_until(lambda: unavailable.read(c, Keys("/ckpt"))[0] == {}, timeout_s=10,
                       what="b0 back in service")
    finally:
        for agent in fast + slow:
            agent.close()


def test_a_node_dead_before_its_part_started_fails_it_after_a_bound(etcd, ipc_dir, nodes):
    """n2 dies while its engine's part is still pending (the limit lets one part run at a
    time): the command says what it waits on, and once n2 has been down for six of its
    leases (12 s here) the part ends failed, never started, and so does the operation (it
    once waited for ever, saying only "1/2 done")."""
    import threading

    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    slow = counted_agents(ipc_dir, ["a0"], shared, 3.0)
    fast = counted_agents(ipc_dir, ["b0"], shared, 0.0)
    try:
        nodes("n1", node_toml(etcd, "n1", slow))
        wait_until(lambda: coordinator_of(etcd) == "n1", what="n1 coordinating")
        n2 = nodes("n2", node_toml(etcd, "n2", fast))
        wait_until(lambda: len(engines_of(fleet_json(etcd)[1])) == 2, what="published")
        proc = cycle_then_kill(etcd, ["a0", "b0", "--op-id", "orphan"], shared, n2,
                               "a0's part running on n1")
        out, err = proc.communicate(timeout=scaled(90))
        assert proc.returncode == 1, out + err
        assert "not started: node n2 was not up for 12 s" in out, out
        assert "waits on b0 pending on n2 (node down)" in err, err
        assert shared["pauses"] == {"a0": 1}  # b0 never left service
    finally:
        for agent in slow + fast:
            agent.close()


def test_two_fleet_operations_at_once_share_the_limit(etcd, agents, nodes):
    import threading

    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    two_nodes(etcd, agents, nodes, hooks=OutOfService(shared, 0.4), per=3)
    procs = [subprocess.Popen([*CKPTCTL, "--etcd",
                               etcd.urls[0], "fleet", "cycle", "--selector", f"pool={pool}",
                               "--max-unavailable", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for pool in ("a", "b")]
    for proc in procs:
        out, err = proc.communicate(timeout=scaled(120))
        assert proc.returncode == 0, out + err
    assert shared["most"] == 2  # two operations of limit 2: never more than two out at once


@pytest.mark.slow
def test_the_coordinator_killed_at_twenty_random_moments(etcd, ipc_dir, nodes):
    """Each time the coordinator is killed (kill -9) at a random moment of a fleet cycle, the
    other takes over within the lease's TTL and the operation ends succeeded, every engine's
    step run exactly once; the killed node is started again for the next kill."""
    import random
    import threading

    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    coords, _, agents_ = _coordinators_and_workers(etcd, ipc_dir, nodes, shared, 0.3,
                                                   engines=6)
    rng = random.Random(1216)
    ran: dict[str, int] = {}
    ops_done = 0
    try:
        kills = 0
        while kills < 20:
            op_id = f"kill-{kills}"
            proc = subprocess.Popen([*CKPTCTL, "--etcd",
                                     etcd.urls[0], "fleet", "cycle", "--all",
                                     "--max-unavailable", "2", "--op-id", op_id, "--json"],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            while proc.poll() is None and kills < 20:
                time.sleep(rng.uniform(0.05, 1.2))
                victim = wait_until(lambda: coordinator_of(etcd), timeout_s=10,
                                    what="a coordinator")
                os.kill(coords[victim].pid, signal.SIGKILL)
                coords[victim].proc.wait()
                killed = time.monotonic()
                kills += 1
                other = "c1" if victim == "c0" else "c0"
                wait_until(lambda: coordinator_of(etcd) == other, timeout_s=10,
                           what=f"{other} took over (kill {kills})")
                assert time.monotonic() - killed < scaled(2 + 3.0)
                coords[victim] = nodes(victim, node_toml(etcd, victim))
            out, err = proc.communicate(timeout=scaled(120))
            assert proc.returncode == 0, out + err
            parts = json.loads(out)["parts"]
            assert [p["status"] for p in parts] == ["succeeded"] * 6
            ops_done += 1
            for p in parts:
                ran[p["engine"]] = ran.get(p["engine"], 0) + 1
        assert shared["pauses"] == ran  # every step once per operation: none twice
        assert shared["most"] <= 2
    finally:
        for agent in agents_:
            agent.close()


@pytest.mark.skipif(not etcd_cluster.installed(), reason="etcd is not installed: run `make etcd`")
def test_quorum_lost_mid_operation_local_work_goes_on_and_the_fleet_resumes(tmp_path, ipc_dir,
                                                                            nodes):
    import threading

    cluster = etcd_cluster.EtcdCluster(tmp_path / "etcd", size=3)
    shared = {"lock": threading.Lock(), "now": 0, "most": 0}
    a = counted_agents(ipc_dir, ["q0", "q1", "q2"], shared, 1.0)
    try:
        ctl = nodes("n1", node_toml(cluster, "n1", a))
        wait_until(lambda: len(engines_of(fleet_json(cluster)[1])) == 3, what="published")
        proc = subprocess.Popen([*CKPTCTL, "--etcd",
                                 ",".join(cluster.urls), "fleet", "cycle", "q0", "q1",
                                 "--max-unavailable", "1", "--op-id", "quorum", "--json"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        wait_until(lambda: shared["now"] == 1, what="q0's part running")
        cluster.stop(1)
        cluster.stop(2)  # one member of three left: no quorum
        # the part under way ends on its node: q0 is not left out of service by etcd's loss
        wait_until(lambda: a[0].lifecycle.state == "running" and shared["now"] == 0,
                   timeout_s=20, what="q0 RUNNING again")
        # the fleet pauses: commands fail fast, exit 4; the node's own operations go on
        t0 = time.monotonic()
        rc, _ = fleet_json(cluster)
        assert rc == 4 and time.monotonic() - t0 < scaled(3 * 1.5 + 3)
        r = ctl.ckptctl("cycle", "q2", "--json")
        assert r.returncode == 0, r.stderr
        assert shared["pauses"] == {"q0": 1, "q2": 1}  # q1 not started while etcd is away
        # the command that was following it says so and ends; the operation does not
        out, err = proc.communicate(timeout=scaled(30))
        assert proc.returncode == 4 and "goes on when etcd is back" in err, out + err
        cluster.start(1)
        cluster.start(2)
        cluster.wait_healthy()
        r = ckptctl("--etcd", ",".join(cluster.urls), "fleet", "cycle", "q0", "q1",
                    "--op-id", "quorum", "--json", timeout=90)
        assert r.returncode == 0, r.stdout + r.stderr
        assert [p["status"] for p in json.loads(r.stdout)["parts"]] == ["succeeded"] * 2
        assert shared["pauses"] == {"q0": 1, "q1": 1, "q2": 1}
        wait_until(lambda: (x := engines_of(fleet_json(cluster)[1])) and all(
            e["state"] == "running" and e["node_up"] for e in x.values()), timeout_s=15,
            what="registrations and records recovered")
    finally:
        for agent in a:
            agent.close()
        cluster.close()


def test_reference_engines_under_load_cycled_by_the_fleet_lose_nothing(etcd, nodes,
                                                                       spawn_reference):
    """Two reference engines, each on its own node, under load: a fleet cycle (keep drain,
    one at a time) loses no request, and every completed output is exactly what an engine
    that never went through a cycle gives (same seed, same model)."""
    import threading

    from ckpt_controller.agent import AgentClient
    from ckpt_controller.engine.load import replay, run_load

    engines = [spawn_reference("r1"), spawn_reference("r2")]
    straight = spawn_reference("straight")
    for i, eng in enumerate(engines, 1):
        nodes(f"n{i}", node_toml(etcd, f"n{i}")
              + engines_toml(eng, defaults='drain = "keep"\nlevel = 2'))
    wait_until(lambda: len(engines_of(fleet_json(etcd)[1])) == 2, what="both published")
    results: dict[str, tuple] = {}
    loads = [threading.Thread(target=lambda e=eng, s=seed: results.__setitem__(
        e.name, run_load(e.api, rate=30, duration_s=3.0, seed=s, settle_s=60)))
        for eng, seed in zip(engines, (21, 22))]
    for t in loads:
        t.start()
    for eng in engines:  # each has requests in flight before the cycle begins
        with AgentClient(eng.control, timeout_s=30) as a:
            wait_until(lambda: a.status().in_flight >= 1, timeout_s=30,
                       what=f"{eng.name} busy")
    r = fleet(etcd, "cycle", "--all", "--max-unavailable", "1", "--json", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p["state"] for p in json.loads(r.stdout)["parts"]] == ["running", "running"]
    for t in loads:
        t.join(scaled(120))
    for eng, seed in zip(engines, (21, 22)):
        report, requests = results[eng.name]
        assert report.sent >= 30 and report.lost == 0, report
        assert report.completed + report.aborted + report.rejected == report.sent
        completed = {rid: c.token_ids for rid, c in requests.items()
                     if c.finish_reason in ("stop", "length")}
        assert completed and completed == replay(straight.api, seed, list(completed))


def test_a_damaged_record_of_every_kind_is_said_and_the_fleet_goes_on(etcd, agents, nodes):
    """Garbage in a record of each kind (an operation, a part, an engine, a node, an owner, a
    migration, a step's end, a task in an inbox): ``fleet status`` and its ``--json`` exit 0
    and name every damaged key, none with a traceback; a fleet cycle of all engines and one
    of a named engine go on; both nodes go on running and publishing (once, each of these
    exited 1 with msgspec's ``JSON is malformed``)."""
    from ckpt_controller.fleet.keys import Keys

    k = Keys("/ckpt")
    a, b, n1, n2 = two_nodes(etcd, agents, nodes, per=1)
    garbage = {k.op("dmg-op"): b"{not json", k.part("dmg-op", "a0"): b"\x00\xff",
               k.engine("ghost"): b"[1, 2", k.node("ghost-node"): b"42",
               k.owner("ghost"): b'{"node": 7}', k.migration("dmg-mig"): b"[]",
               k.step_end("dmg-mig", "receive"): b"{", k.todo("n2", "dmg-op", "b0"): b"\xff"}
    with etcd.client() as c:
        for key, raw in garbage.items():
            c.put(key, raw)
    listed = (k.op("dmg-op"), k.engine("ghost"), k.node("ghost-node"))  # what status reads
    code, doc = fleet_json(etcd)
    assert code == 0 and doc is not None, doc
    assert set(listed) <= set(doc["unreadable"]), doc["unreadable"]
    r = fleet(etcd, "status")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert all(f"unreadable record {key}" in r.stderr for key in listed), r.stderr
    for args in (("cycle", "a0"), ("cycle", "--all")):
        r = fleet(etcd, *args, "--json")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert {p["status"] for p in json.loads(r.stdout)["parts"]} == {"succeeded"}
    assert n1.proc.poll() is None and n2.proc.poll() is None
    assert "Traceback" not in n1.log_path.read_text() + n2.log_path.read_text()
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("b0", {}).get("generation") == 1,
               what="n2 still publishing its engine's new generation")


def test_damaged_keys_and_a_second_copy_of_a_node_leave_the_fleet_working(etcd, agents, nodes):
    """Garbage under ops/ and in a node's inbox is said and left alone (or removed), and a
    second controller with a node name already registered is refused its registration (it
    says so and tries again), while the fleet goes on."""
    from ckpt_controller.fleet.keys import Keys

    k = Keys("/ckpt")
    a, b, n1, n2 = two_nodes(etcd, agents, nodes, per=1)
    with etcd.client() as c:
        c.put(k.op("garbage"), b"{not json")
        c.put(k.todo("n1", "garbage", "a0"), b"\x00\xff")
        c.put(k.nodes + "broken", b"[]")
    (twin_agent,) = agents("twin")
    twin = nodes("twin", node_toml(etcd, "n1", [twin_agent]))  # a second "n1"
    wait_until(lambda: "registered by another controller" in twin.log_path.read_text(),
               timeout_s=15, what="the second n1 saying it is refused")
    r = fleet(etcd, "cycle", "--all", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert {p["engine"]: p["node"] for p in json.loads(r.stdout)["parts"]} == {
        "a0": "n1", "b0": "n2"}
    with etcd.client() as c:
        wait_until(lambda: c.get(k.todo("n1", "garbage", "a0")) is None,
                   what="the garbage task removed from the inbox")
        node = json.loads(c.get(k.node("n1")).value)
        assert node["pid"] == n1.pid  # still the first n1's registration
    assert "twin" not in engines_of(fleet_json(etcd)[1])
    logs = n1.log_path.read_text() + n2.log_path.read_text()
    assert "is no fleet operation" in logs and "is no task" in n1.log_path.read_text()
    # the record the limits count on, damaged: no fleet operation starts a part, and says
    # why; node-local work goes on; repaired, the fleet goes on
    with etcd.client() as c:
        c.put(k.unavailable, b"[[[")
    r = fleet(etcd, "cycle", "--all")
    assert r.returncode == 2 and "DamagedRecordError" in r.stderr and "is damaged" in r.stderr
    assert "etcdctl put" in r.stderr
    assert n1.ckptctl("cycle", "a0", "--json").returncode == 0
    with etcd.client() as c:
        c.put(k.unavailable, b"{}")
    assert fleet(etcd, "cycle", "--all").returncode == 0


def test_keys_deleted_or_overwritten_by_hand_are_repaired_and_said(etcd, agents, nodes):
    """A live node's record deleted: written again within a few rounds (it showed as down
    for good). The coordinator key put by hand under no lease: a node takes it over (no
    node coordinated again). A stopped node's record overwritten by hand: the node, started
    again, replaces it (it waited for it for ever). Each said in the node's log."""
    from ckpt_controller.fleet.keys import Keys

    k = Keys("/ckpt")
    a, b, n1, n2 = two_nodes(etcd, agents, nodes, per=1)
    with etcd.client() as c:
        c.delete(k.node("n1"))
        wait_until(lambda: c.get(k.node("n1")) is not None, 20,
                   what="n1's record written again")
        # said once written (a look at the log at once could come before the line)
        wait_until(lambda: "record /ckpt/nodes/n1 was gone while its lease lived"
                   in n1.log_path.read_text(), 20, what="n1 saying it wrote its record again")
        c.put(k.coordinator, "ghost")  # under no lease: no node's election
        wait_until(lambda: c.get(k.coordinator).value in (b"n1", b"n2"), 20,
                   what="a node coordinating again")
        n2.stop()
        wait_until(lambda: c.get(k.node("n2")) is None, 20, what="n2 deregistered")
        c.put(k.node("n2"), b"{written by hand")
    again = nodes("n2", node_toml(etcd, "n2", b, labels={"pool": "b"}, ttl=2))
    with etcd.client() as c:
        wait_until(lambda: c.get(k.node("n2")).lease != 0, 20,
                   what="n2 registered again over the record written by hand")
        assert json.loads(c.get(k.node("n2")).value)["pid"] == again.pid
    wait_until(lambda: "held no controller's registration" in again.log_path.read_text(), 20,
               what="n2 saying it replaced the record written by hand")
    assert fleet(etcd, "cycle", "--all").returncode == 0


def test_a_fleet_command_gives_up_following_at_its_timeout_and_says_why(etcd, agents, nodes):
    """No node may coordinate (``coordinator = false``): a fleet cycle never starts a part.
    With ``--timeout 2`` the command stops following at once after it, exit 3, saying that
    no node coordinates and that the operation goes on (it once waited for ever); ``fleet
    watch --timeout`` too."""
    (a,) = agents("nc0")
    nodes("n1", node_toml(etcd, "n1", [a], extra="coordinator = false\n"))
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("nc0"), what="published")
    started = time.monotonic()
    r = fleet(etcd, "cycle", "nc0", "--op-id", "nobody", "--timeout", "2", "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    assert time.monotonic() - started < scaled(30)
    err = json.loads(r.stdout)["error"]
    assert err["kind"] == "DeadlineError" and "within --timeout 2s" in err["message"]
    assert "no node coordinates" in err["message"]
    assert "ckptctl fleet watch nobody" in err["message"]
    w = fleet(etcd, "watch", "nobody", "--timeout", "1")
    assert w.returncode == 3 and "did not end within --timeout 1s" in w.stderr, w.stderr


def test_a_paused_node_keeps_its_name_and_engines_from_a_second_controller(etcd, agents,
                                                                           nodes):
    """A node controller SIGSTOPped past its lease, and a second controller started with its
    name (another state dir): the name belongs to the first one's node id, so the second is
    refused and deletes nothing (it once took the name, deleted the first's engine records,
    and the first, resumed, was refused). Resumed, the first registers again with its
    engines. ``fleet forget-node`` is refused while the name is registered; once the first
    is gone for good it frees the name, and the second takes it."""
    from ckpt_controller.fleet.keys import Keys

    k = Keys("/ckpt")
    (p0,) = agents("p0")
    first = nodes("np1", node_toml(etcd, "np", [p0], ttl=2))
    wait_until(lambda: "p0" in engines_of(fleet_json(etcd)[1]), what="p0 published by np")
    node_id = (first.state_dir / "node-id").read_text().strip()
    with etcd.client() as c:
        assert c.get(k.node_id("np")).value.decode() == node_id
    os.kill(first.pid, signal.SIGSTOP)
    try:
        with etcd.client() as c:
            wait_until(lambda: c.get(k.node("np")) is None, timeout_s=15,
                       what="the paused np's lease expired")
        (q0,) = agents("q0")
        twin = nodes("np2", node_toml(etcd, "np", [q0], ttl=2))
        wait_until(lambda: "belongs to another controller" in twin.log_path.read_text(),
                   timeout_s=15, what="the second np saying the name is not its own")
        assert "fleet forget-node np" in twin.log_path.read_text()
        with etcd.client() as c:
            assert c.get(k.node("np")) is None  # the twin never registered
            assert c.get(k.owner("p0")).value.decode() == "np"
        assert "p0" in engines_of(fleet_json(etcd)[1])  # its record never deleted
    finally:
        os.kill(first.pid, signal.SIGCONT)
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("p0", {}).get("node_up"),
               timeout_s=15, what="np (the first) registered again with p0")
    with etcd.client() as c:
        assert json.loads(c.get(k.node("np")).value)["pid"] == first.pid
    assert "q0" not in engines_of(fleet_json(etcd)[1])
    refused = fleet(etcd, "forget-node", "np")
    assert refused.returncode == 2 and "registered now" in refused.stderr, refused.stderr
    first.stop()
    freed = fleet(etcd, "forget-node", "np", "--json")
    assert freed.returncode == 0, freed.stderr
    assert json.loads(freed.stdout)["forgot"] == node_id
    wait_until(lambda: "q0" in engines_of(fleet_json(etcd)[1]), timeout_s=15,
               what="the second np registered with its engine once the name was freed")
    again = fleet(etcd, "forget-node", "nobody")
    assert again.returncode == 0 and "free already" in again.stdout
    for bad in ("", "a/b", "x" * 65):  # no node could have such a name: a usage error
        out = fleet(etcd, "forget-node", bad)
        assert out.returncode == 2 and "must be 1-64 letters" in out.stderr, out.stderr


def test_changed_since_gives_only_what_was_written_after_the_revision(etcd):
    """``Etcd.changed_since`` (``[migration] digest_ahead`` reads the engines' records with
    it): etcd's ``min_mod_revision`` through its JSON gateway."""
    with etcd.client() as c:
        c.put("/t/engines/a", "1")
        c.put("/t/engines/b", "1")
        c.put("/t/other", "1")
        kvs, rev = c.changed_since("/t/engines/", 0)
        assert [kv.key for kv in kvs] == ["/t/engines/a", "/t/engines/b"]
        assert c.changed_since("/t/engines/", rev) == ([], rev)
        c.put("/t/engines/a", "2")
        c.put("/t/engines/c", "1")
        kvs, after = c.changed_since("/t/engines/", rev)
        assert [(kv.key, kv.value) for kv in kvs] == [("/t/engines/a", b"2"),
                                                       ("/t/engines/c", b"1")]
        assert after == rev + 2


def test_an_engine_started_prepared_is_published_prepared_and_restored_by_the_fleet(
        etcd, nodes, spawn_reference):
    """A reference engine started PREPARED (``--prepare-on-startup``, as vLLM's
    ``--checkpoint-prepare-on-startup``) is its node's as any other: published PREPARED, and
    a ``fleet restore`` brings it to RUNNING on its node."""
    eng = spawn_reference("sp0", "--prepare-on-startup")
    nodes("n1", node_toml(etcd, "n1", [eng]))
    wait_until(lambda: engines_of(fleet_json(etcd)[1]).get("sp0", {}).get("state")
               == "prepared", what="sp0 published PREPARED")
    r = fleet(etcd, "restore", "sp0", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(p["status"], p["state"]) for p in json.loads(r.stdout)["parts"]] == [
        ("succeeded", "running")]
    wait_until(lambda: engines_of(fleet_json(etcd)[1])["sp0"]["state"] == "running",
               what="sp0 published RUNNING")
