"""A migration refused before anything moves when it could only fail late: an engine not the
init of a PID namespace of its own, and two nodes sharing one network namespace (both once
ran the whole send and failed at ``criu restore ... failed (1)``). A node whose ``[fleet]
address`` is not its own is refused at its start: ``tests/core/test_host_address.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ckpt_controller.errors import UsageError
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.migration import procs
from ckpt_controller.fleet.migration.record import preflight
from support.cli import ckptctl
from support.timing import scaled


def _node(name: str, netns: str | None) -> r.NodeRecord:
    return r.NodeRecord(node=name, controller="ipc:///x", pid=1, host="h1", started=0.0,
                        version="0", lease=1, netns=netns)


def _engine(own: bool | None) -> r.EngineRecord:
    return r.EngineRecord(engine="m", node="n1", state="running", pid=4242,
                          own_pid_namespace=own)


def test_an_engine_without_a_pid_namespace_of_its_own_is_refused_up_front():
    with pytest.raises(UsageError, match="does not run in a PID namespace of its own on n1") as info:
        preflight(_engine(False), _node("n1", "b/1"), _node("n2", "b/2"))
    assert "unshare --pid --fork setsid" in info.value.message and info.value.exit_code == 2
    preflight(_engine(True), _node("n1", "b/1"), _node("n2", "b/2"))
    preflight(_engine(None), _node("n1", "b/1"), _node("n2", "b/2"))  # a node that does not say


def test_two_nodes_in_one_network_namespace_are_refused_up_front():
    with pytest.raises(UsageError, match="n1 and n2 share one network namespace") as info:
        preflight(_engine(True), _node("n1", "b/7"), _node("n2", "b/7"))
    assert info.value.exit_code == 2 and info.value.details["target"] == "n2"
    preflight(_engine(True), _node("n1", "b/7"), _node("n2", "c/7"))  # another host's
    preflight(_engine(True), _node("n1", None), _node("n2", None))


def test_a_process_in_a_pid_namespace_of_its_own_is_told_from_one_that_is_not():
    assert procs.own_pid_namespace(os.getpid()) is False
    assert procs.own_pid_namespace(0) is None and procs.own_pid_namespace("1") is None
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a PID namespace needs root and unshare")
    with subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c",
                           "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as proc:
        try:
            import psutil

            from support.timing import wait_until

            kids = wait_until(lambda: psutil.Process(proc.pid).children(), scaled(10),
                              "unshare's child")
            assert procs.own_pid_namespace(kids[0].pid) is True
        finally:
            proc.stdin.close()
            proc.wait(scaled(10))


def test_the_network_namespace_is_told_apart():
    here = procs.net_namespace()
    assert here is not None and here.count("/") == 1
    code = ("from ckpt_controller.fleet.migration.procs import net_namespace; "
            "print(net_namespace())")
    same = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=scaled(60))
    assert same.stdout.strip() == here
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a network namespace needs root and unshare")
    other = subprocess.run(["unshare", "--net", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=scaled(60))
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() not in ("", here, "None")


def test_fleet_migrate_between_two_nodes_of_one_namespace_exits_2_before_anything(etcd):
    """Through etcd and the CLI: the records say one network namespace; ``fleet migrate``
    exits 2 naming both nodes, and writes no operation."""
    from ckpt_controller.fleet.etcd import Etcd
    from ckpt_controller.fleet.keys import Keys

    keys = Keys("/ckpt")
    with Etcd(etcd.urls) as store:
        for name in ("n1", "n2"):
            store.put(keys.node(name), r.encode(_node(name, "boot/4026531840")))
        store.put(keys.engine("m"), r.encode(_engine(True)))
        store.put(keys.owner("m"), "n1")
        out = ckptctl("--etcd", ",".join(etcd.urls), "fleet", "migrate", "m", "--to", "n2")
        assert out.returncode == 2, out.stdout + out.stderr
        assert "n1 and n2 share one network namespace" in out.stderr
        assert store.get_prefix(keys.ops) == []
