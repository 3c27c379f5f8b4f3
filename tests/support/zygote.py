"""Engines forked from a process that has already imported torch: a test's start-up cost.

Most of an engine's start is ``import torch`` (about 3 s of CPU here), and the default suite
starts some seventy engines: on two cores that alone was more than a minute and a half of
``make test``. So each pytest-xdist worker keeps one *zygote*: a Python that imported the
third-party packages an engine needs (torch, numpy, pyzmq, msgspec, psutil, transitions; not
``ckpt_controller``, so the project reads its environment afresh in every child) and then
only waits. An engine is started by asking it to fork: the child leads a session of its own
(``setsid``, as ``ReadyProcess`` asks of every child), takes the stdin, stdout and stderr
the test passed over the socket (``SCM_RIGHTS``), the test's folder, environment and
arguments, and runs ``python -m MODULE`` or ``python SCRIPT`` in-process (``runpy``) from
there: the same code as an exec'd engine, minus the import.

What a forked engine lacks is its own command line: ``/proc/PID/cmdline`` is the zygote's.
Tests that find engines by their command line (``processes.pids_naming``; CRIU's restored
copies) are marked ``exec_engines`` and start theirs with ``exec`` as before. The zygote is
used only under pytest-xdist (``make test``), where ``tests/conftest.py`` sets one OpenMP
thread before anything imports torch, and only while it has a single thread: a zygote that
finds a second thread after its imports (OpenBLAS starts one per core unless told not to)
refuses, and engines are exec'd. ``CKPT_TEST_FORK=0`` turns it off.

The zygote forks from a single-threaded state that never ran a torch operation nor made a
zmq context, so a child inherits no thread pool and no socket. It ends with the worker (its
stdin closes) and takes its children with it (each child has ``PDEATHSIG`` = SIGKILL).

Neighbours: ``processes`` (``EngineProcess``, ``ReferenceProcess`` start through
``spawn``), ``ckpt_controller.procutil.ReadyProcess`` (``_spawn``), ``tests/conftest.py``.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

#: what the zygote imports before it forks (an engine's imports; never the project's own)
PRELOAD = ("numpy", "torch", "zmq", "msgspec", "psutil", "transitions")
#: the most bytes one spawn request (argv, folder, environment) may take
REQUEST_MAX = 1 << 20
_PR_SET_PDEATHSIG = 1

#: whether the test now running allows forked engines (``tests/conftest.py`` clears it for a
#: test marked ``exec_engines``)
allowed = True
_lock = threading.Lock()
_zygote: "Zygote | None" = None


def wanted() -> bool:
    """Whether an engine started now should be forked (see the module)."""
    return (allowed and bool(os.environ.get("PYTEST_XDIST_WORKER"))
            and os.environ.get("CKPT_TEST_FORK", "1") != "0")


def spawn(args, *, cwd, env, stdout, stderr) -> "ForkedProcess | None":
    """``args`` (``[sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, SCRIPT, ...]``)
    forked from this worker's zygote, with stdin from /dev/null, ``stdout`` (``PIPE``: a text
    pipe, as ``Popen(text=True)`` makes) and ``stderr`` (a file); None when it cannot be
    forked (not wanted, other arguments, no zygote), and the caller execs it instead."""
    global _zygote
    if not wanted() or len(args) < 2 or args[0] != sys.executable or stdout != subprocess.PIPE:
        return None
    if args[1] == "-m":
        target, argv = {"module": args[2]}, [args[2], *args[3:]]
    elif not args[1].startswith("-"):
        target, argv = {"script": str(args[1])}, [str(a) for a in args[1:]]
    else:
        return None
    with _lock:
        if _zygote is None or not _zygote.alive():
            _zygote = Zygote.start()
        zygote = _zygote
    if not zygote.ready:
        return None
    request = {**target, "argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()),
               "env": dict(os.environ if env is None else env)}
    return zygote.fork(request, stderr)


def shutdown() -> None:
    """End this worker's zygote, if it made one (at the end of the session)."""
    global _zygote
    with _lock:
        if _zygote is not None and _zygote.alive():
            _zygote.close()
        _zygote = None


class Zygote:
    """The test's side of one zygote process."""

    def __init__(self, proc: subprocess.Popen, path: str, ready: bool) -> None:
        self.proc, self.path, self.ready = proc, path, ready

    @classmethod
    def start(cls) -> "Zygote":
        folder = Path("/tmp") / f"ckpt-zygote-{os.getpid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        path = str(folder / "sock")
        proc = subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = proc.stdout.readline()  # the imports, or a refusal, or its end
        try:
            ready = json.loads(line).get("event") == "ready"
        except ValueError:  # policy: no ready line: engines are exec'd instead
            ready = False
        return cls(proc, path, ready)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout_s: float = 10.0) -> None:
        """End the zygote (its stdin closes) and with it every child it still has."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:  # policy: wedged: it goes, and its children
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def fork(self, request: dict, stderr) -> "ForkedProcess | None":
        data = json.dumps(request).encode()
        if len(data) > REQUEST_MAX:
            return None
        read_end, write_end = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(30.0)  # it answers at once, or it is wedged: exec instead
            conn.connect(self.path)
            socket.send_fds(conn, [data], [devnull, write_end, stderr.fileno()])
            pid = json.loads(conn.recv(4096))["pid"]
        except (OSError, ValueError, KeyError):  # policy: the zygote went away: exec instead
            conn.close()
            os.close(read_end)
            return None
        finally:
            os.close(write_end)
            os.close(devnull)
        return ForkedProcess(pid, conn, os.fdopen(read_end, "r"))


class ForkedProcess:
    """A child of the zygote, with the part of ``subprocess.Popen``'s surface the tests and
    ``ReadyProcess`` use: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``, ``stdout``. The zygote reaps it and sends its exit status
    (negative: the signal that ended it, as Popen says) on the child's own connection."""

    def __init__(self, pid: int, conn: socket.socket, stdout) -> None:
        self.pid, self._conn, self.stdout = pid, conn, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._collect(timeout) is None:
            raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
        return self.returncode

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                data = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):  # policy: still running
                return None
            # the zygote sends the status; a zygote gone without it took the child with it
            self.returncode = json.loads(data)["returncode"] if data else -signal.SIGKILL
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # policy: it ended just now; wait() says how
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# --- the zygote itself (this file run as a script) ---------------------------------------

def _serve(path: str):
    """Import, say ready, then fork on request until stdin closes. Returns, in a child
    only, what that child is to run."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    threads = os.listdir("/proc/self/task")
    if len(threads) > 1:
        print(json.dumps({"event": "refused", "threads": len(threads)}), flush=True)
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                data, fds, _, _ = socket.recv_fds(conn, REQUEST_MAX, 3)
                pid = os.fork()
                if pid == 0:
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    sel.close()
                    for other in (listener, conn, *children.values()):
                        other.close()  # another child's connection is no business of this one
                    return json.loads(data), fds
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode())
                children[pid] = conn
            elif key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):  # the worker is gone
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))
                    return None
            else:
                os.read(wake_r, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps(
                        {"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:  # policy: the test stopped listening (it ended)
                    pass
                conn.close()


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: become what ``request`` asks for, as an exec'd one would be."""
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    if "module" in request:
        sys.path[0] = request["cwd"]  # as `python -m` puts the current folder first
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = str(Path(request["script"]).resolve().parent)
        runpy.run_path(request["script"], run_name="__main__")


if __name__ == "__main__":
    _child = _serve(sys.argv[1])
    if _child is not None:
        _become(*_child)  # returns (or raises SystemExit) as the child's program does
