"""``hooks/tcp-hold``'s bound: new connections are held at most ``CKPT_TCP_HOLD_MAX_S``.

A client whose SYN the hold drops sends it again at 1, 3, 7, 15, 31 and 63 s (the kernel's
default ``tcp_syn_retries`` of 6), then gives up: a hold past its last retry loses it. So
``criu-dump`` ends a dump that, with the restore still to come, would hold past the bound (the
engine goes on, the capture is undone, the hold let go), and a hold that lasted longer anyway
(the restore asked for later) says so when it is let go, which the controller logs and the
progress shows. Real CRIU and nft from ``make criu``; skips, saying which, otherwise."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ckpt_controller.engine.client import EngineClient
from support import ROOT
from support.criu import criu_missing, required
from support.hooks import CRIU_TCP_HOLD_HOOKS, link_hooks
from support.processes import kill_naming
from support.timing import scaled, wait_until
from test_criu import config_for, stop_capture_restore, tcp_engine

NFT = ROOT / ".cache" / "criu" / "bin" / "nft"
_reason = required(criu_missing(), "the tcp-hold tests") or (
    None if NFT.exists() else "no nft next to CRIU: run `make criu`")
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.exec_engines]


def tcp_hold(action: str, pid: int, images: Path, **env: str) -> subprocess.CompletedProcess:
    """``hooks/tcp-hold`` at ``action`` for the engine named after ``images``' parent."""
    env = {**os.environ, "CKPT_ACTION": action, "CKPT_ENGINE": images.parent.name,
           "CKPT_ENGINE_PID": str(pid), "CKPT_IMAGE_DIR": str(images), **env}
    return subprocess.run([str(ROOT / "hooks" / "tcp-hold")], capture_output=True, text=True,
                          timeout=scaled(60), env=env)


def _tables() -> str:
    return subprocess.run([str(NFT), "list", "tables"], capture_output=True, text=True).stdout


@pytest.fixture
def images(tmp_path) -> Path:
    folder = tmp_path / f"hold{os.getpid()}" / "op1"
    folder.mkdir(parents=True)
    return folder


def test_the_hold_is_bounded_by_the_kernels_syn_retries_unless_told(images):
    retries = int(Path("/proc/sys/net/ipv4/tcp_syn_retries").read_text())
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        out = tcp_hold("dump", os.getpid(), images)
        assert out.returncode == 0, out.stderr
        assert f"for at most {(1 << retries) - 4} s" in out.stdout, out.stdout
        until = float((images / "tcp-hold-until").read_text())
        assert abs(until - time.time() - ((1 << retries) - 4)) < scaled(10)
        out = tcp_hold("pre-restore", os.getpid(), images)
        assert out.returncode == 0 and "(held " in out.stdout and out.stderr == "", out
        assert not (images.parent / "tcp-hold-since").exists()
        for bad in ("abc", "-1", "1.2.3", "0", "0.0", "nan", "1e9"):
            out = tcp_hold("dump", os.getpid(), images, CKPT_TCP_HOLD_MAX_S=bad)
            assert out.returncode == 2 and "CKPT_TCP_HOLD_MAX_S" in out.stderr, (bad, out)
        assert f"ckpt_hold_{images.parent.name}" not in _tables()
        # a hold is let go whatever the setting says by then
        assert tcp_hold("dump", os.getpid(), images).returncode == 0
        assert f"ckpt_hold_{images.parent.name}" in _tables()
        out = tcp_hold("pre-restore", os.getpid(), images, CKPT_TCP_HOLD_MAX_S="abc")
        assert out.returncode == 0 and "go through again" in out.stdout, out
        assert f"ckpt_hold_{images.parent.name}" not in _tables()
    finally:
        tcp_hold("pre-restore", os.getpid(), images)
        listener.close()


def test_a_hold_longer_than_its_bound_says_so_when_let_go(images):
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        out = tcp_hold("dump", os.getpid(), images, CKPT_TCP_HOLD_MAX_S="0.5")
        assert out.returncode == 0 and "for at most 0.5 s" in out.stdout, out
        time.sleep(1.0)
        out = tcp_hold("pre-restore", os.getpid(), images, CKPT_TCP_HOLD_MAX_S="0.5")
        assert out.returncode == 0, out.stderr
        held = float(re.search(r"held ([0-9.]+) s\)", out.stdout).group(1))
        assert held >= 1.0
        assert "past CKPT_TCP_HOLD_MAX_S (0.5 s)" in out.stderr, out.stderr
    finally:
        tcp_hold("pre-restore", os.getpid(), images)
        listener.close()


def _cycle_ended_by_the_bound(ctl, eng, api, said: str) -> None:
    out = ctl.ckptctl("cycle", eng.name, "--json")
    assert out.returncode == 1, out.stdout + out.stderr  # HookError, not a timeout (3)
    (o,) = json.loads(out.stdout)["engines"]
    assert o["status"] == "rolled_back" and o["state"] == "running", o
    dump = [h for h in o["hooks"] if h["point"] == "dump"][-1]
    assert not dump["timed_out"] and dump["exit_code"] == 1, dump
    assert said in o["error"]["message"], o["error"]  # the operator's error says why
    assert "tcp-hold" in o["error"]["message"] and "the engine goes on" in o["error"]["message"]
    # the undo let the hold go; CRIU's network lock went with the failed dump
    undo = [h for h in o["hooks"] if h["point"] == "pre-restore"]
    assert any("go through again" in h["stdout_tail"] for h in undo), undo
    tables = _tables()
    assert f"ckpt_hold_{eng.name}" not in tables and "CRIU-" not in tables, tables
    assert eng.proc.poll() is None  # the engine went on
    # on the connection it had, and on a new one
    assert api.generate([4, 5, 6], 5, timeout_s=scaled(20)).finish_reason == "length"
    with socket.create_connection(("127.0.0.1", int(eng.api.rsplit(":", 1)[1])),
                                  timeout=scaled(5)):
        pass


def test_a_dump_that_would_hold_past_the_bound_is_ended_and_the_engine_serves_on(
        spawn_reference, spawn_controller, monkeypatch, tmp_path):
    """A stop-mode dump under a hold of at most 4 s, the last restore of this engine known
    to take 2.5 s, slowed by 3 s (an action script at CRIU's pre-dump): failed by
    criu-dump's own check at CRIU's post-dump, long before the hook's 60 s timeout. The
    engine goes on, the hold and CRIU's network lock are let go, and the engine answers on
    the connection it had and on new ones. Then a capture and restore, the dump not slowed
    and no restore known, succeed (nothing of the first one's is held against it)."""
    slow = tmp_path / "slow.sh"
    slow.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = pre-dump ] && sleep 3\nexit 0\n')
    slow.chmod(0o755)
    monkeypatch.setenv("CKPT_CRIU_EXTRA", f"--action-script {slow}")
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")
    monkeypatch.setenv("CKPT_CRIU_TCP", "established")
    monkeypatch.setenv("CKPT_TCP_HOLD_MAX_S", "4")
    eng = tcp_engine(spawn_reference, "hb1")
    ctl = spawn_controller(config_for(eng) + "\n[deadlines]\nhook = 60\n")
    link_hooks(ctl, CRIU_TCP_HOLD_HOOKS)
    folder = ctl.dir / "state" / "images" / "hb1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "last-restore-s").write_text("2.50\n")
    with EngineClient(eng.api) as api:
        assert api.generate([1, 2, 3], 5).finish_reason == "length"  # the connection open
        _cycle_ended_by_the_bound(ctl, eng, api, "the last restore took 2.50 s")
    slow.write_text("#!/bin/sh\nexit 0\n")
    (folder / "last-restore-s").unlink()
    try:
        assert stop_capture_restore(ctl, eng)["state"] == "running"
        assert float((folder / "last-restore-s").read_text()) > 0  # this one's, for the next
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])


def test_a_restore_asked_for_after_the_bound_warns_of_the_long_hold(spawn_reference,
                                                                     spawn_controller,
                                                                     monkeypatch):
    """Captured (stop mode) under a hold of at most 3 s and restored later: the restore
    works, and the hold's release warns, in the controller's log and under the hook's line
    of the progress; criu-restore notes how long this engine's restore took."""
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")
    monkeypatch.setenv("CKPT_TCP_HOLD_MAX_S", "3")
    eng = tcp_engine(spawn_reference, "hb2")
    try:
        ctl = spawn_controller(config_for(eng))
        link_hooks(ctl, CRIU_TCP_HOLD_HOOKS)
        assert ctl.ckptctl("prepare", "hb2").returncode == 0
        out = ctl.ckptctl("capture", "hb2", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        eng.proc.wait(timeout=scaled(10))  # the dump ended it
        since = ctl.dir / "state" / "images" / "hb2" / "tcp-hold-since"
        held_from = float(since.read_text())
        wait_until(lambda: time.time() - held_from > 3.5, 10, "the hold past its bound")
        out = ctl.ckptctl("restore", "hb2")
        assert out.returncode == 0, out.stdout + out.stderr
        said = out.stdout + out.stderr
        line = re.search(r"hook pre-restore 30-tcp-hold done in [0-9.]+s\n"
                         r"(?:\[ *[0-9.]+s\] )?  \| (.*)", said)
        assert line and "past CKPT_TCP_HOLD_MAX_S (3 s)" in line.group(1), said
        log = (ctl.dir / "controller.log").read_text()
        assert re.search(r"WARNING.*hb2: pre-restore hook 30-tcp-hold: .*held [0-9.]+ s, past",
                         log), log[-3000:]
        assert float((since.parent / "last-restore-s").read_text()) > 0
        assert not since.exists()
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])
