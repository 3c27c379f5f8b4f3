"""The child processes a test starts, and ending them: step engines (``EngineProcess``), the
reference engine (``ReferenceProcess``) and the controller (``ControllerProcess``), each a
``ReadyProcess`` that is up once it printed its ready line.

Neighbours: ``cli`` (the controller's ``ckptctl``), ``tests/conftest.py`` (the fixtures that
start these and stop them after each test), ``tests/engines/step_engine.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import msgspec
import psutil
import zmq

from ckpt_controller.procutil import ReadyProcess
from support import ROOT, zygote
from support.cli import CKPTCTL, ckptctl
from support.timing import deadline_in

STEP_ENGINE = ROOT / "tests" / "engines" / "step_engine.py"


def private_dir() -> Path:
    """A new folder only this user may enter, under ``/tmp``: ipc paths must stay under ~100
    bytes, so not pytest's long tmp path."""
    d = Path("/tmp") / f"ckpt-t-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    d.mkdir(mode=0o700)
    return d


class ForkableProcess(ReadyProcess):
    """A ``ReadyProcess`` forked from this worker's zygote where it may be (``zygote``: the
    engine's imports done once per worker), else exec'd as the product does."""

    def _spawn(self):
        forked = zygote.spawn(self.args, cwd=self.cwd, env=self.env,
                              stdout=subprocess.PIPE, stderr=self.log)
        return forked if forked is not None else super()._spawn()


class EngineProcess(ForkableProcess):
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
        """The engine's own view of its tensors (``timeout_s``: ``timing.scaled``)."""
        self.sock.send(msgspec.msgpack.encode({"op": "introspect"}))
        deadline = deadline_in(timeout_s)
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = msgspec.msgpack.decode(self.sock.recv())
                if "param_ids" in msg:
                    return msg
                self.results[msg["id"]] = msg
        raise TimeoutError("introspect got no answer")

    def collect(self, ids, timeout_s: float = 30.0) -> dict[str, dict]:
        """Wait until every id in ``ids`` has an answer (finished or rejected), up to
        ``timeout_s`` (``timing.scaled``)."""
        want = set(ids)
        deadline = deadline_in(timeout_s)
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


class ReferenceProcess(ForkableProcess):
    """``ckptctl engine serve`` as a child process."""

    def __init__(self, tmp: Path, model_dir: Path, name: str, *extra: str,
                 api: str | None = None, control: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.api = api or f"ipc://{tmp}/{name}.api"
        self.control = control or f"ipc://{tmp}/{name}.ctl"
        super().__init__([*CKPTCTL, "engine", "serve", "--name", name, "--api", self.api,
                          "--control", self.control, "--model-dir", str(model_dir),
                          "--heartbeat", "0.2", *extra],
                         tmp / f"{name}.log", f"engine {name}", cwd=ROOT, env=env)


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
        super().__init__([*self.wrap, *CKPTCTL, "serve", "--config", str(self.config)],
                         tmp / "controller.log", "controller", cwd=ROOT)
        self.endpoint = self.info.get("endpoint", self.endpoint)  # tcp://...:0 -> the port

    def ckptctl(self, *args: str, timeout: float | None = None):
        """``ckptctl --controller ENDPOINT ARGS`` to this controller (``cli.ckptctl``)."""
        return ckptctl(*args, timeout=timeout, wrap=self.wrap, endpoint=self.endpoint)


def gone(pid: int) -> bool:
    """No process ``pid`` any more, or only its zombie (exited, not yet reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # policy: no such process is what this asks about
        return True


def settled(eng, timeout_s: float = 30.0) -> bool:
    """The engine process lives, its agent says RUNNING, and nothing is in flight (waiting up
    to ``timeout_s`` for requests left by an earlier test to end)."""
    from ckpt_controller.agent import AgentClient
    from ckpt_controller.errors import CkptError

    if eng.proc.poll() is not None:
        return False
    try:
        with AgentClient(eng.control, timeout_s=5) as agent:
            deadline = deadline_in(timeout_s)
            while True:
                st = agent.status()
                if st.state != "running" or not st.in_flight:
                    return st.state == "running"
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    except CkptError:  # policy: an engine that does not answer is not one to hand out
        return False


def wait_state(control: str, state: str, timeout_s: float = 20.0) -> None:
    """Poll the agent at ``control`` until it says ``state`` (``timing.scaled`` timeout)."""
    from ckpt_controller.agent import AgentClient

    deadline = deadline_in(timeout_s)
    with AgentClient(control) as agent:
        while agent.status().state != state:
            assert time.monotonic() < deadline, f"never {state}"
            time.sleep(0.005)


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


class Started:
    """A factory that keeps what it made: ``Started(make)(...)`` is ``make(...)``, and
    ``stop()`` stops every child made so far together (``stop_all``); a fixture yields it."""

    def __init__(self, make) -> None:
        self._make = make
        self.children: list = []

    def __call__(self, *args, **kwargs):
        child = self._make(*args, **kwargs)
        self.children.append(child)
        return child

    def stop(self) -> None:
        stop_all(self.children)


def stop_all(children) -> None:
    """Stop these ``ReadyProcess`` children together: SIGTERM to every one first, then each
    is waited for (and killed after its grace period), so their shutdowns overlap."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.terminate()
    for child in children:
        child.stop()


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


def sigstop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until each of its threads is stopped: the signal is delivered
    asynchronously, and on a loaded host a request that arrives meanwhile may still be
    answered (a test that then expects silence would see an answer)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = deadline_in(timeout_s)
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):  # policy: a thread that ended has no state to wait on
                continue
        if all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.005)
