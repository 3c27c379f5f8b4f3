"""The vLLM launcher: a vLLM server and its sidecar started together under one process, so that
CRIU dumps (and a migration moves) both in one image.

``unshare --pid --fork setsid ckptctl agent vllm-launch --url URL --control ENDPOINT --name N
--log-dir DIR -- VLLM COMMAND...`` makes this process its PID namespace's init. It starts the
vLLM command, waits until ``URL/health`` answers, then starts ``ckptctl agent vllm
--engine-is-parent``: the sidecar reports this init's host PID as the engine's (what
``criu-dump`` dumps: the whole tree, the sidecar included) and reads it again after a restore,
where the copy runs under another host PID. Then it prints one JSON ready line and only reaps:

- its children's output goes to files in ``--log-dir``, and its own stdio is moved there once
  it is ready (a dumped tree must hold no file descriptor from outside that changes);
- SIGTERM or SIGINT ends both children (SIGTERM, SIGKILL after a grace period) and itself;
- either child ending ends the other and this process (the engine is whole or not at all);
- SIGCONT (a migration's source resumed after a stopped dump: ``criu dump --leave-stopped``
  stops every process of the tree, and the fleet continues the PID it dumped, this one) is
  passed on to every process of its PID namespace;
- any other process that ends in the namespace is reaped, as an init must.

The signal handlers are set before anything starts (a SIGTERM while vLLM starts ends what
started; a SIGCONT right after the ready line is passed on) and only set flags; the loop
polls them and reaps every 0.2 s. (Not
``sigtimedwait``: after a CRIU restore, and after a stopped dump's SIGCONT, it was seen to
return a SIGINT nobody sent, ``si_pid`` garbage, and the launcher ended the engine.) Neighbours: ``sidecar`` (the agent it starts), ``cli.agent_cmds`` (the command),
``docs/vllm.md`` ("Migrating vLLM").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ckpt_controller.adapters.vllm.http import VllmHttp
from ckpt_controller.agent.incarnation import host_pid
from ckpt_controller.errors import OperationError

log = logging.getLogger("ckpt_controller.vllm")

#: how long a child has after SIGTERM before SIGKILL
GRACE_S = 20.0
#: how often the loop looks at its flags and reaps
TICK_S = 0.2


class Launcher:
    """The init of a vLLM engine's PID namespace: vLLM and its sidecar as children."""

    def __init__(self, vllm_cmd: list[str], *, url: str, sidecar_args: list[str],
                 log_dir: Path, start_timeout_s: float = 600.0) -> None:
        self.vllm_cmd, self.url, self.sidecar_args = vllm_cmd, url, sidecar_args
        self.log_dir, self.start_timeout_s = log_dir, start_timeout_s
        self.vllm: subprocess.Popen | None = None
        self.sidecar: subprocess.Popen | None = None
        #: the signals caught and not yet acted on (``catch_signals``)
        self.flags: dict[int, bool] = {}

    def catch_signals(self) -> None:
        """From now on SIGTERM, SIGINT and SIGCONT only set a flag, which ``start`` and
        ``run`` act on. Called before anything starts: a signal that came between the ready
        line and ``run`` was once missed (a SIGCONT to a tree stopped right after it started
        continued the launcher alone), and a SIGTERM then ended the launcher untidily."""
        def flag(signum: int, frame: object) -> None:
            self.flags[signum] = True  # a signal handler only sets a flag

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCONT):
            signal.signal(sig, flag)

    def _stop_asked(self) -> int | None:
        """SIGTERM or SIGINT, when one came (taken), else None."""
        stop = [s for s in (signal.SIGTERM, signal.SIGINT) if self.flags.pop(s, False)]
        return stop[0] if stop else None

    def _spawn(self, args: list[str], log_name: str, stdout=None) -> subprocess.Popen:
        with open(self.log_dir / log_name, "ab") as out:
            return subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                    stdout=out if stdout is None else stdout, stderr=out)

    def start(self) -> dict:
        """vLLM serving, then the sidecar ready: its ready line (``OperationError`` when
        either did not come up; whatever started is ended)."""
        try:
            self.vllm = self._spawn(self.vllm_cmd, "vllm.log")
            http = VllmHttp(self.url, timeout_s=5.0)
            deadline = time.monotonic() + self.start_timeout_s
            while not http.healthy(timeout_s=2.0):
                if (sig := self._stop_asked()) is not None:
                    raise OperationError(f"{signal.Signals(sig).name} before vLLM served: "
                                         "ended", signal=signal.Signals(sig).name)
                if self.vllm.poll() is not None:
                    raise OperationError(f"vLLM exited ({self.vllm.returncode}) before it "
                                         f"served; see {self.log_dir / 'vllm.log'}",
                                         returncode=self.vllm.returncode)
                if time.monotonic() > deadline:
                    raise OperationError(f"vLLM did not answer {self.url}/health within "
                                         f"{self.start_timeout_s:.0f} s",
                                         timeout_s=self.start_timeout_s)
                time.sleep(0.5)
            self.sidecar = self._spawn(
                [sys.executable, "-m", "ckpt_controller", "agent", "vllm", "--url", self.url,
                 "--engine-is-parent", *self.sidecar_args], "sidecar.log",
                stdout=subprocess.PIPE)
            line = self.sidecar.stdout.readline()  # the sidecar's one ready line, or EOF
            self.sidecar.stdout.close()
            try:
                ready = json.loads(line)
            except ValueError:  # policy: no ready line: it did not start; say where to look
                raise OperationError(f"the sidecar did not start; see "
                                     f"{self.log_dir / 'sidecar.log'}",
                                     first_line=line[:200].decode(errors="replace")) from None
        except BaseException:  # policy: nothing half started is left running; raised on
            self.stop()
            raise
        # ``pid``: this launcher's host PID (the engine's, as the sidecar reports it); the
        # children's are as this process sees them (in its PID namespace)
        return {**ready, "event": "ready", "pid": host_pid(), "vllm_pid": self.vllm.pid,
                "sidecar_pid": self.sidecar.pid}

    def run(self) -> int:
        """Reap until a stop signal or a child's end; the exit status: 0 after a stop
        signal, else the status of the child that ended first."""
        children = {self.vllm.pid: "vLLM", self.sidecar.pid: "sidecar"}
        while True:
            if (sig := self._stop_asked()) is not None:  # also one that came while starting
                log.warning("launcher: %s: ending vLLM and its sidecar",
                            signal.Signals(sig).name)
                self.stop()
                return 0
            if self.flags.pop(signal.SIGCONT, False) and os.getpid() == 1:
                os.kill(-1, signal.SIGCONT)  # from a PID namespace's init: all of its own
            ended = self._reap()
            if ended:
                log.info("launcher: reaped %s", ended)
            for pid, status in ended:
                if pid in children:
                    log.warning("launcher: %s (pid %d) ended (%s): ending the engine",
                                children[pid], pid, status)
                    self.stop()
                    return status if status > 0 else 128 - status
            time.sleep(TICK_S)

    def _reap(self) -> list[tuple[int, int]]:
        """Every child that ended, reaped: (pid, exit status, or minus the signal)."""
        out = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # policy: no children left: nothing to reap
                return out
            if pid == 0:
                return out
            for child in (self.vllm, self.sidecar):
                if child is not None and child.pid == pid:
                    child.returncode = os.waitstatus_to_exitcode(status)
            out.append((pid, os.waitstatus_to_exitcode(status)))

    def stop(self) -> None:
        """SIGTERM to both children (vLLM's own children follow it), SIGKILL after
        ``GRACE_S``, then everything left in the namespace."""
        live = [c for c in (self.sidecar, self.vllm) if c is not None and c.returncode is None]
        for child in live:
            try:
                child.terminate()
            except ProcessLookupError:  # policy: already gone
                pass
        deadline = time.monotonic() + GRACE_S
        while any(c.returncode is None for c in live) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.1)
        if os.getpid() == 1:  # a namespace's init: whatever is left goes now
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:  # policy: nothing left to end
                pass
        for child in live:
            if child.returncode is None:
                child.kill()
        self._reap()


def launch(vllm_cmd: list[str], *, url: str, sidecar_args: list[str], log_dir: Path,
           start_timeout_s: float = 600.0) -> int:
    """Run the launcher: the ready line on stdout, then stdio moved to ``log_dir``; returns
    the exit status (``Launcher.run``)."""
    log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    launcher = Launcher(vllm_cmd, url=url, sidecar_args=sidecar_args, log_dir=log_dir,
                        start_timeout_s=start_timeout_s)
    launcher.catch_signals()
    ready = launcher.start()
    print(json.dumps(ready), flush=True)
    own = os.open(log_dir / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((0, null), (1, own), (2, own)):
        os.dup2(to, fd)
    os.close(own)
    os.close(null)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log.info("launcher: serving (pid %d here)", os.getpid())
    return launcher.run()
