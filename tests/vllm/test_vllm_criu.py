"""A whole vLLM server captured with the shipped CRIU hooks while PREPARED, stopped, and
restored from the image serving the same completions; restore-to-first-token against vLLM's
cold start. Marked ``vllm``; needs the vLLM venv (``make vllm``), CRIU 4.2+ (``make criu``),
root, and a writable ``kernel.io_uring_disabled`` (vLLM's event loop opens an io_uring, which
CRIU cannot dump, unless io_uring is off while it starts). Skips, saying which, otherwise."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from ckpt_controller.adapters.vllm import VllmHttp
from ckpt_controller.procutil import ReadyProcess
from support import ROOT
from support.cli import CKPTCTL
from support.config import engines_toml
from support.criu import CRIU, criu_missing
from support.hooks import CRIU_HOOKS, CRIU_TCP_HOLD_HOOKS, link_hooks
from support.timing import deadline_in, scaled
from support.vllm import NO_VLLM, VLLM_PY, VllmServer, make_tiny_llama
from test_vllm_tcp_hold import SteadyLoad, assert_none_lost

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=NO_VLLM),
    pytest.mark.skipif(criu_missing() is not None, reason=criu_missing() or ""),
]

URING = Path("/proc/sys/kernel/io_uring_disabled")
PROMPT = "the restored engine says"


@pytest.fixture(scope="module")
def capturable_vllm(tmp_path_factory):
    """A vLLM server started with io_uring off (the sysctl is put back as soon as it serves),
    and its cold start: process start to the first token."""
    try:
        old = URING.read_text().strip()
        URING.write_text("2")
    except OSError as err:
        pytest.skip(f"cannot turn io_uring off while vLLM starts ({URING}): {err}")
    model = make_tiny_llama(tmp_path_factory.mktemp("tinyllama-criu"))
    start = time.monotonic()
    try:
        server = VllmServer(model)
    finally:
        URING.write_text(old)
    VllmHttp(server.url, timeout_s=120).complete(PROMPT, 1)
    server.cold_start_s = time.monotonic() - start
    yield server
    # the restored tree is no child of ours, but it leads its own process group: SIGTERM (vLLM
    # then removes its shared memory), SIGKILL if it lingers
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        end = deadline_in(wait_s)
        while os.path.exists(f"/proc/{server.pid}") and time.monotonic() < end:
            time.sleep(0.2)
    server.stop()


def test_vllm_captured_stopped_and_restored_from_its_image(capturable_vllm, spawn_controller,
                                                           ipc_dir, monkeypatch):
    server = capturable_vllm
    monkeypatch.setenv("CKPT_CRIU", CRIU)  # hooks get the controller's environment
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")
    side = ReadyProcess([*CKPTCTL, "agent", "vllm", "--url",
                         server.url, "--control", f"ipc://{ipc_dir}/vc", "--name", "vc",
                         "--heartbeat", "1.0"], ipc_dir / "vc.log", "vLLM sidecar", cwd=ROOT)
    try:
        ctl = spawn_controller(engines_toml(("vc", side.info["control"]), kind="vllm"))
        link_hooks(ctl, CRIU_HOOKS)
        http = VllmHttp(server.url, timeout_s=120)
        want = http.complete(PROMPT, 16, ignore_eos=True).text

        out = ctl.ckptctl("prepare", "vc", "--level", "1", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        out = ctl.ckptctl("capture", "vc", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        (eng,) = json.loads(out.stdout)["engines"]
        said = eng["hooks"][0]["stdout_tail"]
        assert "criu-dump: dumped pid" in said
        image_bytes = int(said.split(": ")[2].split(" bytes")[0])
        server.proc.wait(timeout=scaled(60))  # the dump ended it; reaped, its PIDs are free again
        assert not http.healthy()

        start = time.monotonic()
        out = ctl.ckptctl("restore", "vc", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        got = http.complete(PROMPT, 16, ignore_eos=True).text
        restore_s = time.monotonic() - start
        (eng,) = json.loads(out.stdout)["engines"]
        assert eng["state"] == "running"
        assert "restored the engine" in eng["hooks"][0]["stdout_tail"]
        assert got == want  # the same weights, the same greedy completion
        status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
        assert status["state"] == "running" and status["pid"] == server.pid
        assert status["restored_from_image"] and status["incarnation"] == 1  # vLLM's own
        print(f"\nvLLM (tiny Llama, CPU): cold start to first token {server.cold_start_s:.1f} s; "
              f"CRIU restore (restore op + first completion) {restore_s:.1f} s; image "
              f"{image_bytes / 2**30:.2f} GiB")
        if os.environ.get("CKPT_BENCH_JSON"):  # bench/vllm_restore.py runs this test
            Path(os.environ["CKPT_BENCH_JSON"]).write_text(json.dumps({
                "cold_start_to_first_token_s": server.cold_start_s,
                "restore_to_first_completion_s": restore_s, "image_bytes": image_bytes}))
        assert restore_s < server.cold_start_s
    finally:
        side.stop()


def test_vllm_under_load_loses_no_request_across_a_stop_capture_and_restore(
        capturable_vllm, spawn_controller, ipc_dir, monkeypatch):
    """Open connections are kept (CRIU's --tcp-established, its nftables network lock) and new
    ones wait (hooks/tcp-hold drops their SYNs while vLLM is captured): a client that never
    retries loses nothing, although vLLM's process is gone for a while."""
    server = capturable_vllm
    monkeypatch.setenv("CKPT_CRIU", CRIU)
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")
    monkeypatch.setenv("CKPT_CRIU_TCP", "established")
    side = ReadyProcess([*CKPTCTL, "agent", "vllm", "--url",
                         server.url, "--control", f"ipc://{ipc_dir}/vl", "--name", "vl",
                         "--heartbeat", "1.0"], ipc_dir / "vl.log", "vLLM sidecar", cwd=ROOT)
    try:
        hooks = ipc_dir / "hooks"
        link_hooks(hooks, CRIU_TCP_HOLD_HOOKS)
        ctl = spawn_controller(engines_toml(("vl", side.info["control"]), kind="vllm"))
        load = SteadyLoad(server.url, every_s=0.25, max_tokens=24).start()
        time.sleep(3)
        out = ctl.ckptctl("prepare", "vl", "--drain", "keep", "--level", "1", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        gone = time.time()
        out = ctl.ckptctl("capture", "vl", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        said = " ".join(h["stdout_tail"] for h in json.loads(out.stdout)["engines"][0]["hooks"])
        assert "tcp-hold: holding new connections" in said and "dumped pid" in said
        if server.proc.poll() is None:  # our child, unless an earlier test restored it
            server.proc.wait(timeout=scaled(60))
        end = deadline_in(30)
        while psutil.pid_exists(server.pid):  # a restored one is reaped by someone else
            assert time.monotonic() < end, "vLLM's process outlived its dump"
            time.sleep(0.1)
        time.sleep(3)  # vLLM is gone: clients connecting now must wait, not be refused
        out = ctl.ckptctl("restore", "vl", "--json")
        back = time.time()
        assert out.returncode == 0, out.stdout + out.stderr
        time.sleep(3)
        sent = load.stop()
        status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
    finally:
        side.stop()
    assert len(sent) >= 48
    assert_none_lost(sent, gone, back)
    assert status["state"] == "running" and status["restored_from_image"]
