"""vLLM for the tests: the vLLM suite's own venv (``make vllm``), a real vLLM CPU server on a
tiny random Llama made offline, and the paths of the vLLM stand-ins in ``tests/vllm/``.

Neighbours: ``tests/vllm/conftest.py`` (the session's ``vllm_server``),
``tests/vllm/make_tiny_llama.py``, ``tests/vllm/standin_server.py``,
``tests/vllm/checkpoint_server.py`` (vLLM 0.34's checkpoint router), docs/vllm.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from ckpt_controller.endpoints import free_port
from ckpt_controller.procutil import ReadyProcess
from support import ROOT
from support.timing import deadline_in

VLLM_PY = ROOT / ".cache" / "vllm" / "bin" / "python"
#: why a vLLM test cannot run here, for its skip mark
NO_VLLM = "no vLLM venv: run `make vllm`"
#: vLLM runs on the first CPU only, its OpenMP threads bound there: on a 2-CPU machine a vLLM
#: generating on both stalled every other process (the controllers, their hooks, etcd, the
#: test itself) for seconds at a time, process starts most of all (one took 5.9 s), and
#: completions ended before a drain the test had released long before could begin. The
#: other CPU is the control plane's, as a production node keeps CPUs for its system services.
VLLM_CPU = ("taskset", "-c", "0")
VLLM_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
#: asks for the AMX permission at start, which vLLM's worker may not do before using AMX
AMX_PERMISSION = ROOT / ".cache" / "vllm" / "lib" / "amx-permission.so"
#: the dev-mode vLLM HTTP stand-in (a real process and real HTTP, not vLLM)
STANDIN_SERVER = ROOT / "tests" / "vllm" / "standin_server.py"
MAKE_TINY_LLAMA = ROOT / "tests" / "vllm" / "make_tiny_llama.py"


#: vLLM 0.34's source and its checkpoint router's imports (``make vllm-checkpoint``)
CHECKPOINT_PY = ROOT / ".cache" / "vllm-checkpoint" / "bin" / "python"
NO_CHECKPOINT = "no vLLM 0.34 venv: run `make vllm-checkpoint`"
#: vLLM 0.34's own /checkpoint router over a reference engine (a test server, not vLLM)
CHECKPOINT_SERVER = ROOT / "tests" / "vllm" / "checkpoint_server.py"


class CheckpointServer(ReadyProcess):
    """``checkpoint_server.py`` over the reference engine ``engine`` (a ``ReferenceProcess``),
    with the server's own flags (``--checkpoint-prepare-on-startup``, ...)."""

    def __init__(self, engine, folder: Path, *flags: str) -> None:
        self.engine = engine
        super().__init__([str(CHECKPOINT_PY), str(CHECKPOINT_SERVER), "--engine-api",
                          engine.api, "--engine-control", engine.control, *flags],
                         folder / f"checkpoint-server-{engine.name}.log",
                         "vLLM checkpoint test server", cwd=ROOT)
        self.url = self.info["url"]


def make_tiny_llama(folder: Path) -> Path:
    """A tiny random Llama in ``folder``, made offline with the vLLM venv's python."""
    subprocess.run([str(VLLM_PY), str(MAKE_TINY_LLAMA), str(folder)], check=True,
                   capture_output=True, timeout=300)
    return folder


class VllmServer:
    """A real vLLM CPU server (``make vllm``) on a tiny random Llama, in dev mode."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.port = free_port()
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
        self._wait_healthy(240)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = deadline_in(timeout_s)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited: {self.log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:  # policy: not up yet: try again until the deadline
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"vLLM did not start in {timeout_s} s") from None
                time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # policy: deaf to SIGTERM: kill the group
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
