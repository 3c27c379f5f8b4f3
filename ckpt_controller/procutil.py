"""Child processes that announce readiness with one JSON line on stdout.

``ckptctl engine serve`` and ``ckptctl serve`` print ``{"event": "ready", ...}`` once their
sockets are bound; ``ReadyProcess`` starts such a command, waits for that line (with a
deadline), and stops it the way product.md asks for any child: SIGTERM, a grace period,
then SIGKILL. Used by the demo (and the tests, and drills). stderr goes to a log file.

Each child leads its own session (``setsid``): CRIU can only dump a process whose session
leader lives in the same PID namespace, and a child that inherited a session from outside a
container's namespace could not be captured. It also keeps a terminal's Ctrl-C from reaching
the child directly; the parent stops it in order instead.

``ProcessTree`` keeps track of every descendant of a child that was made a subreaper
(``hook_preexec`` before it execs), including those that leave its session or process
group, as ``criu restore --restore-detached`` makes a restored tree do, so a child that fails
or times out can be ended whole (``HookRunner`` in ``controller.hooks`` does); the same
``hook_preexec`` has the child told (SIGTERM) when its parent dies.

``StopSignals`` is the child's side of that: a server (the reference engine, the controller,
the vLLM sidecar) runs until SIGTERM or SIGINT, whose handler only sets a flag, and cleans up
on its main thread once ``wait()`` returns.
Neighbours: the CLI's demo and drill, the tests, ``controller.hooks``; ``engine.server``,
``controller.server`` and ``adapters.vllm.sidecar`` (``StopSignals``).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil

from ckpt_controller.errors import OperationError

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl


class StopSignals:
    """SIGTERM and SIGINT ask this process to stop. Made on the main thread (``signal``
    allows handlers nowhere else); from then on either signal only sets ``stop``, and
    ``wait()`` returns once one came, leaving the cleanup to the caller's ``finally``."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.stop = threading.Event()
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.stop.set()  # a signal handler only sets a flag

    def wait(self, poll_s: float = 0.5) -> None:
        """Block until a stop signal came (woken every ``poll_s`` so a handler always runs)."""
        while not self.stop.wait(poll_s):
            pass


class ReadyProcess:
    def __init__(self, args: list[str], log: Path, what: str, *, timeout_s: float = 120.0,
                 cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.args, self.log_path, self.what, self.cwd, self.env = args, log, what, cwd, env
        self.info: dict = {}
        self.start(timeout_s)

    def start(self, timeout_s: float = 120.0) -> None:
        self.log = self.log_path.open("a")
        self.proc = self._spawn()
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        line = box[0] if box else ""
        try:
            self.info = json.loads(line)
        except ValueError:  # policy: no ready line means it did not start; say where to look
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise OperationError(f"{self.what} did not start (see {self.log_path})",
                                 what=self.what, first_line=line[:200], log_tail=tail) from None

    def _spawn(self) -> subprocess.Popen:
        """The child itself: ``args`` with stdout a text pipe, stderr the log, no stdin, in a
        session of its own. A subclass may start it another way (the tests fork engines from
        a process that imported torch already) with the same part of Popen's surface."""
        return subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.log,
                                stdin=subprocess.DEVNULL, text=True, cwd=self.cwd, env=self.env,
                                start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_pipes()

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
        if not self.log.closed:
            self.log.close()


def ended_within(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether ``proc`` ended within ``timeout_s`` (then it is reaped). Woken by the exit
    itself through a pidfd: ``Popen.wait(timeout)`` polls with sleeps that grow to 50 ms, and
    a hook's end seen that late adds to an engine's downtime. Without pidfds (an older
    kernel), that polling wait."""
    if proc.poll() is not None:
        return True
    try:
        fd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):  # policy: no pidfds here (or the child already reaped)
        try:
            proc.wait(timeout=max(0.0, timeout_s))
            return True
        except subprocess.TimeoutExpired:  # policy: still running: the caller's answer
            return False
    try:
        watch = select.poll()  # not select(): a controller may hold descriptors past 1024
        watch.register(fd, select.POLLIN)
        ended = bool(watch.poll(max(0, int(timeout_s * 1000 + 0.999))))
    finally:
        os.close(fd)
    if ended:
        proc.wait()
    return ended


def hook_preexec(parent: int):
    """A ``preexec_fn`` for a hook started by process ``parent``: the reaper of its
    orphaned descendants (``PR_SET_CHILD_SUBREAPER``: it stays the ancestor of whatever it
    starts, even of a tree that detaches), told SIGTERM when the thread that started it dies
    with its process (``PR_SET_PDEATHSIG``); both are kept across ``exec``. So a hook whose
    controller was killed is ended as at its timeout (criu-restore stops its criu), not left
    to restore a copy no controller follows: under ``KillMode=process`` systemd leaves it
    running. A parent gone before the call: SIGTERM at once. Only system calls through
    functions bound at import, so it is safe between fork and exec."""
    term = int(signal.SIGTERM)

    def preexec() -> None:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _prctl(_PR_SET_PDEATHSIG, term, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), term)
    return preexec


class ProcessTree:
    """The descendants of process ``root`` seen so far (``look`` adds those there now; call
    it while the root lives). A process is only ever signalled if it is still the one seen
    (psutil checks its start time), so a reused PID is safe."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, psutil.Process] = {}
        #: the PIDs signalled here while they ran
        self.signalled: set[int] = set()

    def look(self) -> None:
        """Add the descendants there now (walking ``/proc/PID/task/*/children`` down from the
        root: it costs the tree's size, not the machine's process count)."""
        frontier, found = [self.root], []
        while frontier:
            kids = [kid for pid in frontier for kid in _children(pid)]
            found += kids
            frontier = kids
        for pid in found:
            known = self.seen.get(pid)
            if known is None or not known.is_running():  # new, or a PID used again
                try:
                    self.seen[pid] = psutil.Process(pid)
                except psutil.Error:  # policy: already gone: nothing to follow
                    pass

    def record(self) -> str:
        """One ``PID START_TIME`` line per process seen, for ``recorded`` in another process
        (a controller restarted after a crash)."""
        return "".join(f"{pid} {proc.create_time()!r}\n" for pid, proc in self.seen.items()
                       if _running(proc))

    @classmethod
    def recorded(cls, root: int, text: str) -> "ProcessTree":
        """The tree ``record`` wrote, keeping the processes that still run and are still the
        ones recorded (same start time), not others that took a PID since."""
        tree = cls(root)
        for line in text.splitlines():
            try:
                pid, started = line.split()
                proc = psutil.Process(int(pid))
                if proc.create_time() == float(started):
                    tree.seen[proc.pid] = proc
            except (ValueError, psutil.Error):  # policy: malformed or gone: nothing to stop
                continue
        return tree

    def alive(self) -> list[psutil.Process]:
        return [p for p in self.seen.values() if _running(p)]

    def signal(self, sig: int) -> None:
        for proc in self.alive():
            try:
                proc.send_signal(sig)
                self.signalled.add(proc.pid)
            except psutil.Error:  # policy: gone (or not ours to signal) in the meantime
                pass

    def end(self, grace_s: float) -> None:
        """SIGTERM every seen descendant still alive, SIGKILL what is left after
        ``grace_s``."""
        if self.alive():
            self.signal(signal.SIGTERM)
            if not self.wait(grace_s):
                self.signal(signal.SIGKILL)
                self.wait(5.0)

    def wait(self, timeout_s: float) -> bool:
        """Whether every seen descendant ended (a zombie counts) within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (none when it is gone)."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except OSError:  # policy: gone (or a thread gone) meanwhile: what was read is all
        pass
    return kids


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # policy: vanished between the two questions
        return False


class OutputReader:
    """Reads a child's pipes (stdout, stderr) on a thread, keeping the last ``keep`` bytes of
    each, until they close or ``finish`` is called: unlike ``communicate`` it does not wait
    for every process that inherited a pipe (one that detached may hold it for ever)."""

    def __init__(self, *pipes, keep: int = 1 << 16) -> None:
        self.pipes, self.keep = pipes, keep
        self.data = [bytearray() for _ in pipes]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="output-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            for i, pipe in enumerate(self.pipes):
                sel.register(pipe.fileno(), selectors.EVENT_READ, i)
            while sel.get_map():
                events = sel.select(timeout=0.05)
                for key, _ in events:
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    buf = self.data[key.data]
                    buf += chunk
                    del buf[:-self.keep]
                if self._stop.is_set() and not events:
                    return  # asked to finish, and nothing more is waiting to be read

    def finish(self, timeout_s: float = 2.0) -> list[bytes]:
        """What was read, once what the pipes already hold is read too; closes them."""
        self._stop.set()
        self._thread.join(timeout_s)
        for pipe in self.pipes:
            pipe.close()
        return [bytes(buf) for buf in self.data]
