"""Real CRIU: the shipped hooks dump a PREPARED reference engine and bring it back.

Needs CRIU 4.2+ from ``make criu`` (or ``CKPT_CRIU``); skips with the reason otherwise. The
engines listen on TCP loopback: CRIU closes established TCP connections on restore
(``--tcp-close``) and ZMQ peers reconnect, while a unix stream connection to a peer outside the
dump cannot be checkpointed at all."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ckpt_controller.agent import AgentClient
from ckpt_controller.engine.client import EngineClient

ROOT = Path(__file__).resolve().parent.parent
CRIU = os.environ.get("CKPT_CRIU") or str(ROOT / ".cache" / "criu" / "bin" / "criu")


def _criu_works() -> str | None:
    if not os.path.exists(CRIU):
        return f"no CRIU at {CRIU}: run `make criu` (CRIU 4.2+ from Debian unstable)"
    if os.geteuid() != 0:
        return "CRIU needs root here"
    check = subprocess.run([CRIU, "check"], capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        return f"criu check fails: {check.stdout[-300:]} {check.stderr[-300:]}"
    return None


_reason = _criu_works()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_engine(spawn_reference, name: str):
    api, ctl = free_port(), free_port()
    return spawn_reference(name, api=f"tcp://127.0.0.1:{api}",
                           control=f"tcp://127.0.0.1:{ctl}")


def install_hook(ctl, point: str, name: str, hook: str) -> None:
    folder = ctl.dir / "hooks" / point
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).symlink_to(ROOT / "hooks" / hook)


def config_for(eng) -> str:
    return (f'[defaults]\ndrain = "keep"\nlevel = 2\n\n[[engine]]\nname = "{eng.name}"\n'
            f'control = "{eng.control}"\n')


def test_cycle_with_a_real_dump_keeps_serving(spawn_reference, spawn_controller):
    eng = tcp_engine(spawn_reference, "crl")
    ctl = spawn_controller(config_for(eng))
    install_hook(ctl, "dump", "10-criu-dump", "criu-dump")
    with EngineClient(eng.api) as api:
        prompts = [[i, 2, 9] for i in range(4)]
        ids = [api.submit(pr, 300) for pr in prompts]
        time.sleep(0.1)
        out = ctl.ckptctl("cycle", "crl", "--json", "--op-id", "dump1")
        assert out.returncode == 0, out.stdout + out.stderr
        (o,) = json.loads(out.stdout)["engines"]
        (dump,) = [h for h in o["hooks"] if h["point"] == "dump"]
        assert dump["exit_code"] == 0 and "dumped pid" in dump["stdout_tail"]
        images = ctl.dir / "state" / "images" / "crl"
        assert (images / "dump1" / "inventory.img").exists()
        assert (images / "latest").resolve() == (images / "dump1").resolve()
        deadline = time.monotonic() + 60
        while not all(api.requests[i].ended for i in ids) and time.monotonic() < deadline:
            api.poll(0.2)
        assert [api.requests[i].token_ids for i in ids] == \
            [api.generate(pr, 300).token_ids for pr in prompts]


def test_dump_stops_the_engine_and_restore_brings_it_back(spawn_reference, spawn_controller,
                                                          monkeypatch):
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")  # hooks get the controller's environment
    eng = tcp_engine(spawn_reference, "crs")
    try:
        _stop_and_restore(eng, spawn_controller)
    finally:  # the restored copy is no child of ours: end it by name
        subprocess.run(["pkill", "-f", f"--name {eng.name} "], check=False)


def _stop_and_restore(eng, spawn_controller) -> None:
    ctl = spawn_controller(config_for(eng))
    install_hook(ctl, "dump", "10-criu-dump", "criu-dump")
    install_hook(ctl, "pre-restore", "10-criu-restore", "criu-restore")
    with EngineClient(eng.api) as api:
        want = api.generate([5, 6, 7], 40).token_ids
        kept = api.submit([8, 8, 8], 400)
        time.sleep(0.1)
        assert ctl.ckptctl("prepare", "crs").returncode == 0
        out = ctl.ckptctl("capture", "crs", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        eng.proc.wait(timeout=10)  # the dump ended it; reaped, its PID is free for the restore
        out = ctl.ckptctl("restore", "crs", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        (o,) = json.loads(out.stdout)["engines"]
        assert o["state"] == "running"
        with AgentClient(eng.control) as agent:
            st = agent.status()
        assert st.restored_from_image and st.incarnation >= 1 and st.pid == eng.pid
        assert api.generate([5, 6, 7], 40).token_ids == want
        deadline = time.monotonic() + 60
        while not api.requests[kept].ended and time.monotonic() < deadline:
            api.poll(0.2)
        assert api.requests[kept].finish_reason == "length"
        assert api.requests[kept].token_ids == api.generate([8, 8, 8], 400).token_ids


def test_restore_hook_without_an_image_fails_the_engine(spawn_controller, tmp_path):
    env = dict(os.environ, CKPT_ENGINE_PID="999999999", CKPT_IMAGE_DIR=str(tmp_path),
               CKPT_CRIU=CRIU)
    out = subprocess.run([str(ROOT / "hooks" / "criu-restore")], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2 and "no CRIU image" in out.stderr
    shutil.rmtree(tmp_path, ignore_errors=True)
