"""Shared fixtures: real engine processes on ipc endpoints in a private temp directory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import msgspec
import pytest
import zmq

from ckpt_controller.procutil import ReadyProcess

ROOT = Path(__file__).resolve().parent.parent

#: CI sets this: every real part (CRIU, nftables, vLLM, network namespaces) can be installed
#: there, so a test that would skip for want of one fails instead. Only a GPU may be missing.
REQUIRE_PARTS = os.environ.get("CKPT_REQUIRE_PARTS") == "1"
_MAY_SKIP = ("cuda", "gpu")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_PARTS and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple)
                     else report.longrepr)
        if not any(word in reason.lower() for word in _MAY_SKIP):
            report.outcome = "failed"
            report.longrepr = f"CKPT_REQUIRE_PARTS=1, but this test would skip: {reason}"
STEP_ENGINE = Path(__file__).resolve().parent / "engines" / "step_engine.py"


class EngineProcess(ReadyProcess):
    """A step engine child process and a client for its request API."""

    def __init__(self, tmp: Path, name: str, **opts) -> None:
        self.name = name
        self.control = f"ipc://{tmp}/{name}.ctl"
        self.api = f"ipc://{tmp}/{name}.api"
        args = [sys.executable, str(STEP_ENGINE), "--name", name, "--control", self.control,
                "--api", self.api, "--dir", str(tmp)]
        for key, value in opts.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        super().__init__(args, tmp / f"{name}.log", f"step engine {name}", cwd=ROOT)
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.api)
        self.results: dict[str, dict] = {}

    def submit(self, rid: str, steps: int, seed: int = 0) -> None:
        self.sock.send(msgspec.msgpack.encode({"op": "add", "id": rid, "steps": steps,
                                               "seed": seed}))

    def introspect(self, timeout_s: float = 10.0) -> dict:
        self.sock.send(msgspec.msgpack.encode({"op": "introspect"}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = msgspec.msgpack.decode(self.sock.recv())
                if "param_ids" in msg:
                    return msg
                self.results[msg["id"]] = msg
        raise TimeoutError("introspect got no answer")

    def collect(self, ids, timeout_s: float = 30.0) -> dict[str, dict]:
        """Wait until every id in ``ids`` has an answer (finished or rejected)."""
        want = set(ids)
        deadline = time.monotonic() + timeout_s
        while not want <= self.results.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(want - self.results.keys())
                raise TimeoutError(f"no answer for {missing[:5]} ({len(missing)} missing)")
            if self.sock.poll(int(min(left, 0.2) * 1000)):
                msg = msgspec.msgpack.decode(self.sock.recv())
                self.results[msg["id"]] = msg
        return {i: self.results[i] for i in ids}

    def stop(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()
        super().stop(grace_s=5)


@pytest.fixture
def ipc_dir(tmp_path_factory):
    # ipc paths must stay under ~100 bytes: a short private dir, not pytest's long tmp path
    d = Path("/tmp") / f"ckpt-t-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def spawn_engine(ipc_dir):
    started: list[EngineProcess] = []

    def spawn(name: str = "eng", **opts) -> EngineProcess:
        eng = EngineProcess(ipc_dir, name, **opts)
        started.append(eng)
        return eng

    yield spawn
    for eng in started:
        eng.stop()


class ReferenceProcess(ReadyProcess):
    """``ckptctl engine serve`` as a child process."""

    def __init__(self, tmp: Path, model_dir: Path, name: str, *extra: str,
                 api: str | None = None, control: str | None = None) -> None:
        self.name = name
        self.api = api or f"ipc://{tmp}/{name}.api"
        self.control = control or f"ipc://{tmp}/{name}.ctl"
        super().__init__([sys.executable, "-m", "ckpt_controller", "engine", "serve", "--name",
                          name, "--api", self.api, "--control", self.control, "--model-dir",
                          str(model_dir), "--heartbeat", "0.2", *extra],
                         tmp / f"{name}.log", f"engine {name}", cwd=ROOT)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models")
    yield path
    # engines restored from a CRIU image are no children of ours: every engine of this session
    # names this folder on its command line, so nothing it started outlives the session
    subprocess.run(["pkill", "-9", "-f", "--", str(path)], check=False)


@pytest.fixture
def spawn_reference(ipc_dir, model_dir):
    started: list[ReferenceProcess] = []

    def spawn(name: str = "ref", *extra: str, **endpoints) -> ReferenceProcess:
        eng = ReferenceProcess(ipc_dir, model_dir, name, *extra, **endpoints)
        started.append(eng)
        return eng

    yield spawn
    for eng in started:
        eng.stop()


class ControllerProcess(ReadyProcess):
    """``ckptctl serve --config`` as a child process, with a config written for the test."""

    def __init__(self, tmp: Path, config_text: str, endpoint: str | None = None,
                 controller_keys: str = "") -> None:
        self.dir = tmp
        self.endpoint = endpoint or f"ipc://{tmp}/controller.sock"
        self.state_dir = tmp / "state"
        self.config = tmp / "controller.toml"
        (tmp / "hooks").mkdir(mode=0o700, exist_ok=True)  # a hooks_dir must exist at start
        self.config.write_text(f'[controller]\nendpoint = "{self.endpoint}"\n'
                               f'state_dir = "{tmp}/state"\nhooks_dir = "{tmp}/hooks"\n'
                               f'heartbeat_interval_s = 0.2\n{controller_keys}' + config_text)
        super().__init__([sys.executable, "-m", "ckpt_controller", "serve", "--config",
                          str(self.config)], tmp / "controller.log", "controller", cwd=ROOT)
        self.endpoint = self.info.get("endpoint", self.endpoint)  # tcp://...:0 -> the port

    def ckptctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckpt_controller", "--controller",
                               self.endpoint, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)


@pytest.fixture
def spawn_controller(ipc_dir):
    started: list[ControllerProcess] = []

    def spawn(config_text: str, **kw) -> ControllerProcess:
        ctl = ControllerProcess(ipc_dir, config_text, **kw)
        started.append(ctl)
        return ctl

    yield spawn
    for ctl in started:
        ctl.stop()


# ---------------------------------------------------------------------------- vLLM (-m vllm)

VLLM_PY = ROOT / ".cache" / "vllm" / "bin" / "python"
#: asks for the AMX permission at start, which vLLM's worker may not do before using AMX
AMX_PERMISSION = ROOT / ".cache" / "vllm" / "lib" / "amx-permission.so"


class VllmServer:
    """A real vLLM CPU server (``make vllm``) on a tiny random Llama, in dev mode."""

    def __init__(self, model: Path) -> None:
        self.model = model
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = model / "server.log"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   HF_HUB_OFFLINE="1")
        if AMX_PERMISSION.exists():  # on a CPU with AMX (docs/vllm.md; make vllm)
            env["LD_PRELOAD"] = str(AMX_PERMISSION)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [str(VLLM_PY), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model",
             str(model), "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 240
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited: {self.log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:  # not up yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("vLLM did not start in 240 s") from None
                time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One vLLM server for the whole session (it takes about 35 s to start)."""
    if not VLLM_PY.exists():
        pytest.skip("no vLLM venv: run `make vllm`")
    model = tmp_path_factory.mktemp("tinyllama")
    subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "vllm" / "make_tiny_llama.py"),
                    str(model)], check=True, capture_output=True, timeout=300)
    server = VllmServer(model)
    yield server
    server.stop()
