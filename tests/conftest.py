"""Shared fixtures: real engine processes on ipc endpoints in a private temp directory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from ckpt_controller.procutil import ReadyProcess

ROOT = Path(__file__).resolve().parent.parent

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite on a few workers per core (most tests wait on processes);
    # torch's OpenMP threads spin while they wait, so several workers' engines each with a
    # thread per core slow each other down many times over. One compute thread each, set
    # before anything imports torch, for this worker and every process it starts.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

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

    def forget_results(self) -> None:
        """Read and drop every answer waiting on the socket, and forget those collected: the
        next test starts with none (an engine shared by a module's tests)."""
        while self.sock.poll(0):
            self.sock.recv()
        self.results.clear()

    def stop(self) -> None:
        if self.sock.closed:
            return
        self.sock.close(linger=0)
        self._ctx.term()
        super().stop(grace_s=5)


def _private_dir() -> Path:
    # ipc paths must stay under ~100 bytes: a short private dir, not pytest's long tmp path
    d = Path("/tmp") / f"ckpt-t-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def ipc_dir():
    d = _private_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait_until(condition, timeout_s: float = 10.0, what: str = "the condition",
               every_s: float = 0.02):
    """Poll ``condition()`` until it returns something true (returned) or ``timeout_s``
    passes (``AssertionError`` naming ``what``): a readiness wait instead of a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(every_s)


def gone(pid: int) -> bool:
    """No process ``pid`` any more, or only its zombie (exited, not yet reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # policy: no such process is what this asks about
        return True


def ipc_connections(pid: int, endpoint: str) -> frozenset[int]:
    """The sockets (their inodes) process ``pid`` holds on its bound ipc ``endpoint``: the
    listening one and one per connection it accepted (``/proc/net/unix`` names the path on
    the accepting side). Inodes, not a count: a client that just closed may still be counted
    while a new one connects, and a count then stays the same."""
    path = endpoint.removeprefix("ipc://")
    on_path = set()
    with open("/proc/net/unix") as table:
        next(table)
        for row in table:
            cols = row.split()
            if len(cols) >= 8 and cols[7] == path:
                on_path.add(int(cols[6]))
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            held.add(int(link[8:-1]))
    return frozenset(on_path & held)


def wait_connected(pid: int, endpoint: str, before: frozenset[int],
                   timeout_s: float = 30.0) -> None:
    """Wait until process ``pid`` accepted a connection on ``endpoint`` that is not among the
    ``before`` sockets it had (``ipc_connections``): a client started meanwhile (``watch``)
    is there."""
    wait_until(lambda: ipc_connections(pid, endpoint) - before, timeout_s,
               f"a new connection to {endpoint}")


class StreamedLines:
    """The lines of a child's ``stream`` (its stdout, ``text=True``), read on a thread of
    their own as the child prints them: a test waits for the lines it needs
    (``wait_until``) instead of for a child that stops after a fixed time."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def join(self, timeout_s: float = 20.0) -> list[str]:
        """Every line, once the child closed its end (it exited)."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the child's output never ended"
        return self.lines


def settled(eng, timeout_s: float = 30.0) -> bool:
    """The engine process lives, its agent says RUNNING, and nothing is in flight (waiting up
    to ``timeout_s`` for requests left by an earlier test to end)."""
    from ckpt_controller.agent import AgentClient
    from ckpt_controller.errors import CkptError

    if eng.proc.poll() is not None:
        return False
    try:
        with AgentClient(eng.control, timeout_s=5) as agent:
            deadline = time.monotonic() + timeout_s
            while True:
                st = agent.status()
                if st.state != "running" or not st.in_flight:
                    return st.state == "running"
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    except CkptError:  # policy: an engine that does not answer is not one to hand out
        return False


def stop_all(children) -> None:
    """Stop these ``ReadyProcess`` children together: SIGTERM to every one first, then each
    is waited for (and killed after its grace period), so their shutdowns overlap."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.terminate()
    for child in children:
        child.stop()


class SharedEngine:
    """One engine process kept for the tests of a module that only need it RUNNING and idle
    (its start-up, mostly importing torch, is most of such a test's time). ``get`` hands it
    out settled (``settled``); one left otherwise by a test (FAILED, killed, still busy) is
    stopped and replaced by a fresh one, so no test sees what another left behind."""

    def __init__(self, make) -> None:
        self._make = make
        self.engine = None

    def get(self):
        if self.engine is not None and not settled(self.engine):
            self.engine.stop()
            self.engine = None
        if self.engine is None:
            self.engine = self._make()
        if isinstance(self.engine, EngineProcess):
            self.engine.forget_results()
        return self.engine


@pytest.fixture(scope="module")
def shared_engines(model_dir):
    """``shared(kind, name, *args, **opts)``: a ``SharedEngine`` for this module, made once
    per name; ``kind`` is ``"step"`` (``EngineProcess``, in a folder of its own, so its
    weights file is its own) or ``"reference"`` (``ReferenceProcess``)."""
    root = _private_dir()
    made: dict[str, SharedEngine] = {}

    def shared(kind: str, name: str, *args: str, **opts) -> SharedEngine:
        if name not in made:
            if kind == "step":
                def make(name=name):
                    folder = root / name
                    folder.mkdir(mode=0o700, exist_ok=True)
                    return EngineProcess(folder, name, **opts)
            else:
                def make(name=name):
                    return ReferenceProcess(root, model_dir, name, *args)
            made[name] = SharedEngine(make)
        return made[name]

    yield shared
    stop_all([one.engine for one in made.values() if one.engine is not None])
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def spawn_engine(ipc_dir):
    started: list[EngineProcess] = []

    def spawn(name: str = "eng", **opts) -> EngineProcess:
        eng = EngineProcess(ipc_dir, name, **opts)
        started.append(eng)
        return eng

    yield spawn
    stop_all(started)


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


def pids_naming(marker: str) -> set[int]:
    """The processes whose command line holds ``marker``: a path or an endpoint of this run's
    own (a private folder, a port it was given), so never another run's processes, as a
    name such as ``--name crs`` could be."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or ()):
            found.add(proc.pid)
    return found


def kill_naming(marker: str, pids=None) -> None:
    """SIGKILL the processes of ``pids`` (default: every one ``pids_naming(marker)`` finds)
    whose command line still holds ``marker``: an engine restored from a CRIU image is no
    child of ours (it comes back under the dumped engine's PID, or another one in a PID
    namespace of its own), so it is ended by its PID, once checked to be that engine."""
    for pid in pids_naming(marker) if pids is None else pids:
        try:
            proc = psutil.Process(pid)
            if marker in " ".join(proc.cmdline()):
                proc.kill()
        except psutil.Error:  # policy: already gone (or never ours): nothing to end
            continue


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models")
    yield path
    # engines restored from a CRIU image are no children of ours: every engine of this session
    # names this folder on its command line, so nothing it started outlives the session
    kill_naming(str(path))


@pytest.fixture
def spawn_reference(ipc_dir, model_dir):
    started: list[ReferenceProcess] = []

    def spawn(name: str = "ref", *extra: str, **endpoints) -> ReferenceProcess:
        eng = ReferenceProcess(ipc_dir, model_dir, name, *extra, **endpoints)
        started.append(eng)
        return eng

    yield spawn
    stop_all(started)


class ControllerProcess(ReadyProcess):
    """``ckptctl serve --config`` as a child process, with a config written for the test.
    ``wrap`` goes before its command and before each ``ckptctl`` (``["ip", "netns", "exec",
    NAME]``: the controller and the commands to it in a network namespace); it must exec the
    command, so that the child's PID is the controller's."""

    def __init__(self, tmp: Path, config_text: str, endpoint: str | None = None,
                 controller_keys: str = "", wrap: Sequence[str] = ()) -> None:
        self.dir = tmp
        self.wrap = list(wrap)
        self.endpoint = endpoint or f"ipc://{tmp}/controller.sock"
        self.state_dir = tmp / "state"
        self.config = tmp / "controller.toml"
        (tmp / "hooks").mkdir(mode=0o700, exist_ok=True)  # a hooks_dir must exist at start
        self.config.write_text(f'[controller]\nendpoint = "{self.endpoint}"\n'
                               f'state_dir = "{tmp}/state"\nhooks_dir = "{tmp}/hooks"\n'
                               f'heartbeat_interval_s = 0.2\n{controller_keys}' + config_text)
        super().__init__([*self.wrap, sys.executable, "-m", "ckpt_controller", "serve",
                          "--config", str(self.config)], tmp / "controller.log", "controller",
                         cwd=ROOT)
        self.endpoint = self.info.get("endpoint", self.endpoint)  # tcp://...:0 -> the port

    def ckptctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*self.wrap, sys.executable, "-m", "ckpt_controller",
                               "--controller", self.endpoint, *args], capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def spawn_controller(ipc_dir):
    started: list[ControllerProcess] = []

    def spawn(config_text: str, **kw) -> ControllerProcess:
        ctl = ControllerProcess(ipc_dir, config_text, **kw)
        started.append(ctl)
        return ctl

    yield spawn
    stop_all(started)


# ---------------------------------------------------------------------------- vLLM (-m vllm)

VLLM_PY = ROOT / ".cache" / "vllm" / "bin" / "python"
#: vLLM runs on the first CPU only, its OpenMP threads bound there: on a 2-CPU machine a vLLM
#: generating on both stalled every other process (the controllers, their hooks, etcd, the
#: test itself) for seconds at a time, process starts most of all (one took 5.9 s), and
#: completions ended before a drain the test had released long before could begin. The
#: other CPU is the control plane's, as a production node keeps CPUs for its system services.
VLLM_CPU = ("taskset", "-c", "0")
VLLM_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
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
                   HF_HUB_OFFLINE="1", **VLLM_CPU_ENV)
        if AMX_PERMISSION.exists():  # on a CPU with AMX (docs/vllm.md; make vllm)
            env["LD_PRELOAD"] = str(AMX_PERMISSION)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [*VLLM_CPU, str(VLLM_PY), "-m", "vllm.entrypoints.launchers.api_server.entry",
             "--model", str(model), "--enforce-eager", "--dtype", "float32", "--host",
             "127.0.0.1", "--port", str(self.port)],
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


def prometheus_tool(name: str) -> Path:
    """``make prometheus``'s ``prometheus`` or ``promtool`` (``.cache/prometheus/bin``); skips
    the calling test with the reason when it is not installed."""
    path = ROOT / ".cache" / "prometheus" / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.skip(f"{name} is not installed: run `make prometheus`")
    return path


@pytest.fixture
def etcd(tmp_path):
    """One real etcd member (``make etcd``); skips with the reason when it is not installed."""
    import etcd_cluster

    if not etcd_cluster.installed():
        pytest.skip("etcd is not installed: run `make etcd`")
    cluster = etcd_cluster.EtcdCluster(tmp_path / "etcd", size=1)
    yield cluster
    cluster.close()


def write_hook(ctl, point: str, name: str, body: str) -> None:
    """An executable shell hook ``name`` at ``point`` in ``ctl``'s hooks folder."""
    folder = ctl.dir / "hooks" / point
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.fixture
def silent_server(ipc_dir):
    """A ROUTER that takes whatever arrives and never answers: ``(endpoint, received)``,
    ``received()`` counting what came (a client's checks must send nothing)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{ipc_dir}/silent.sock"
    sock.bind(endpoint)

    def received() -> int:
        n = 0
        while sock.poll(300, zmq.POLLIN):
            sock.recv_multipart()
            n += 1
        return n

    yield endpoint, received
    sock.close(linger=0)
