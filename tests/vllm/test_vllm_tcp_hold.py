"""A vLLM-like HTTP server captured with CRIU (stop mode) and restored while a client that never
retries keeps sending requests: with ``CKPT_CRIU_TCP=established`` (open connections are kept
under CRIU's nftables network lock) and ``hooks/tcp-hold`` (new connections wait while the
server is gone), no request is lost; and the sidecar's ``status`` says the server was restored
from an image. The server is a stand-in (``tests/vllm/standin_server.py``: the dev-mode
endpoints, one Python process), driven by the real sidecar, controller, hooks and CRIU; the same
against a real vLLM is in ``test_vllm_criu.py`` (``-m vllm``). Needs CRIU 4.2+ and nft from
``make criu``, and root; skips, saying which, otherwise."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from ckpt_controller.adapters.vllm import VllmHttp
from ckpt_controller.errors import CkptError
from ckpt_controller.procutil import ReadyProcess
from support import ROOT
from support.cli import CKPTCTL
from support.config import engines_toml
from support.criu import CRIU, criu_missing
from support.hooks import CRIU_TCP_HOLD_HOOKS, link_hooks
from support.timing import deadline_in, scaled
from support.vllm import STANDIN_SERVER

NFT = ROOT / ".cache" / "criu" / "bin" / "nft"
pytestmark = [
    pytest.mark.skipif(criu_missing() is not None, reason=criu_missing() or ""),
    pytest.mark.skipif(not NFT.exists(), reason="no nft next to CRIU: run `make criu`"),
]


@dataclass
class Sent:
    sent: float
    ended: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


class SteadyLoad:
    """A client that does not retry: a new connection and one completion every ``every_s``
    seconds, each on its own thread, until ``stop()``, which waits for every one to end."""

    def __init__(self, url: str, every_s: float = 0.1, max_tokens: int = 8) -> None:
        self.http = VllmHttp(url, timeout_s=300)
        self.http.model_name  # asked once, before the load starts
        self.every_s, self.max_tokens = every_s, max_tokens
        self.requests: list[Sent] = []
        self._stop, self._threads = threading.Event(), []
        self._sender = threading.Thread(target=self._send, daemon=True)

    def _one(self, i: int, rec: Sent) -> None:
        try:
            out = self.http.complete(f"request {i} of a steady load", self.max_tokens,
                                     ignore_eos=True)
            rec.finish_reason = out.finish_reason
        except CkptError as err:
            rec.error = str(err)
        rec.ended = time.time()

    def _send(self) -> None:
        while not self._stop.wait(self.every_s):
            rec = Sent(sent=time.time())
            self.requests.append(rec)
            t = threading.Thread(target=self._one, args=(len(self.requests), rec), daemon=True)
            self._threads.append(t)
            t.start()

    def start(self) -> "SteadyLoad":
        self._sender.start()
        return self

    def stop(self) -> list[Sent]:
        self._stop.set()
        self._sender.join()
        for t in self._threads:
            t.join(timeout=scaled(300))
        return self.requests


def assert_none_lost(sent: list[Sent], gone: float, back: float) -> None:
    """Every request of a ``SteadyLoad`` ended whole, and at least ten were sent between
    ``gone`` and ``back`` (wall times: the capture and restore window was really exercised)."""
    lost = [r for r in sent if r.error or r.finish_reason != "length"]
    while_gone = [r for r in sent if gone <= r.sent <= back]
    print(f"\n{len(sent)} requests, {len(while_gone)} sent during the capture and restore "
          f"({back - gone:.1f} s), {len(lost)} lost; the slowest took "
          f"{max(r.ended - r.sent for r in sent):.1f} s")
    assert len(while_gone) >= 10
    assert not lost, [(r.error, r.finish_reason) for r in lost][:5]


class Standin:
    """The stand-in server in its own session (CRIU dumps a session leader), logging to a
    file (a pipe to us could not be restored)."""

    def __init__(self, tmp: Path) -> None:
        self.log = tmp / "standin.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(STANDIN_SERVER)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        end = deadline_in(30)
        while not self.log.read_text().strip():
            assert self.proc.poll() is None and time.monotonic() < end, self.log.read_text()
            time.sleep(0.05)
        info = json.loads(self.log.read_text().splitlines()[0])
        self.url, self.pid = info["url"], info["pid"]

    def stop(self) -> None:
        # restored, it is no child of ours; it leads its own process group
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=scaled(10))


@pytest.fixture
def standin(ipc_dir):
    server = Standin(ipc_dir)
    yield server
    server.stop()


def test_no_request_is_lost_across_a_stop_capture_and_restore(standin, spawn_controller,
                                                              ipc_dir, monkeypatch):
    monkeypatch.setenv("CKPT_CRIU", CRIU)  # the hooks get the controller's environment
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")
    monkeypatch.setenv("CKPT_CRIU_TCP", "established")
    side = ReadyProcess([*CKPTCTL, "agent", "vllm", "--url",
                         standin.url, "--control", f"ipc://{ipc_dir}/sv", "--name", "sv",
                         "--heartbeat", "0.5"], ipc_dir / "sv.log", "vLLM sidecar", cwd=ROOT)
    try:
        assert side.info["engine_pid"] == standin.pid
        hooks = ipc_dir / "hooks"
        link_hooks(hooks, CRIU_TCP_HOLD_HOOKS)
        ctl = spawn_controller(engines_toml(("sv", side.info["control"]), kind="vllm"))
        load = SteadyLoad(standin.url).start()
        time.sleep(0.5)
        out = ctl.ckptctl("prepare", "sv", "--drain", "keep", "--level", "1", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        time.sleep(0.5)  # requests sent while PREPARED are held by the paused server
        gone = time.time()
        out = ctl.ckptctl("capture", "sv", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        said = " ".join(h["stdout_tail"] for h in json.loads(out.stdout)["engines"][0]["hooks"])
        assert "tcp-hold: holding new connections" in said and "dumped pid" in said, said
        standin.proc.wait(timeout=scaled(30))  # the dump ended it; reaped, its PID is free again
        assert not psutil.pid_exists(standin.pid)
        time.sleep(1.5)  # the server is gone: clients that connect now must wait, not fail
        out = ctl.ckptctl("restore", "sv", "--json")
        back = time.time()
        assert out.returncode == 0, out.stdout + out.stderr
        time.sleep(0.5)
        sent = load.stop()
        status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
    finally:
        side.stop()
    assert_none_lost(sent, gone, back)
    assert status["state"] == "running" and status["pid"] == standin.pid
    # the sidecar's own process never left: the server's fingerprint tells the restore
    assert status["restored_from_image"] and status["incarnation"] == 1


def run_hook(action: str, pid: int, tmp: Path, **env: str) -> subprocess.CompletedProcess:
    """``hooks/tcp-hold`` for ``action``, as the engine named after ``tmp``: its nftables
    table is this test's own (one name for two tests run at once by two workers, and one's
    ``pre-restore`` lifted the other's hold)."""
    engine = "th_" + hashlib.sha256(str(tmp).encode()).hexdigest()[:12]
    env = {**os.environ, "CKPT_ACTION": action, "CKPT_ENGINE": engine,
           "CKPT_ENGINE_PID": str(pid), "CKPT_IMAGE_DIR": str(tmp), **env}
    return subprocess.run([str(ROOT / "hooks" / "tcp-hold")], capture_output=True, text=True,
                          timeout=scaled(60), env=env)


def test_a_held_connection_waits_and_connects_once_let_go(tmp_path):
    """While held, a connection request is dropped, not refused; its kernel sends it again
    and it connects after the hold ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        out = run_hook("dump", os.getpid(), tmp_path)
        assert out.returncode == 0 and f"ports {port}" in out.stdout, out.stdout + out.stderr
        box: list = []

        def connect() -> None:
            start = time.monotonic()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=30).close()
                box.append(time.monotonic() - start)
            except OSError as err:
                box.append(err)

        t = threading.Thread(target=connect)
        t.start()
        time.sleep(1.5)
        assert not box  # neither connected nor refused: waiting
        out = run_hook("pre-restore", os.getpid(), tmp_path)
        assert out.returncode == 0, out.stderr
        t.join(scaled(30))
        assert box and isinstance(box[0], float) and box[0] >= 1.5, box
    finally:
        run_hook("pre-restore", os.getpid(), tmp_path)
        listener.close()


def test_a_connection_left_in_the_accept_queue_fails_the_hold_and_lets_go(tmp_path):
    """The engine never accepts it (here: nobody calls accept): CRIU could not keep it, so
    the hook exits 1, naming it, and takes its hold away."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    waiting = socket.create_connection(("127.0.0.1", port))
    try:
        out = run_hook("dump", os.getpid(), tmp_path, CKPT_TCP_HOLD_WAIT_S="0.5")
        assert out.returncode == 1 and "still wait to be accepted" in out.stderr, out.stderr
        late = socket.create_connection(("127.0.0.1", port), timeout=5)  # not held any more
        late.close()
    finally:
        run_hook("pre-restore", os.getpid(), tmp_path)
        waiting.close()
        listener.close()
