"""The processes ``control.py`` and ``fleet.py`` measure, each a real process of its own:
agent hosts, controller hosts and a bare zmq echo; and the CPU clock that says what each of
them spent.

- ``Fleet``: ``n`` real ``Agent`` objects with nothing registered, at most ``per`` to a host
  process, each on its own ipc socket;
- ``ControllerHost``: a real node controller (``serve.NodeService``: its config given as TOML,
  with ``[fleet]`` its fleet node too) alone in its process, as ``ckptctl serve`` runs it
  (``ControllerHost.many``: several started at once);
- ``EchoHost`` and ``round_trips``: a ROUTER that sends every message back, and a DEALER that
  times each round trip: the transport's own cost, with none of this project's code in it;
- ``FloorHost``: a ROUTER that answers each request after doing the I/O a one-engine cycle
  must do at the least (two fsynced SQLite commits, two round trips to an agent, the reply),
  with none of this project's code: what a controller could not spend less than;
- ``cpu_s(pid)``: a process's CPU time (user + system, all its threads, also those that
  have ended) from its POSIX CPU clock, in nanoseconds; ``/proc/<pid>/stat`` counts in 10 ms
  ticks, too coarse for a few cycles.

Each host waits on its stdin and ends when it is closed. Neighbours: ``control`` and
``fleet`` (the users), ``ckpt_controller.agent`` and ``ckpt_controller.controller.server``
(what is hosted).
"""

from __future__ import annotations

import ctypes
import json
import select
import subprocess
import sys
import time
from pathlib import Path

import zmq

#: how long a host may take to say it is ready, and to end once its stdin is closed
HOST_START_S = 120.0
HOST_EXIT_S = 30.0
#: how long the echo may take to answer one message before the measurement is called broken
ECHO_TIMEOUT_MS = 5_000

AGENT_HOST = r"""
import sys, json
from ckpt_controller.agent import Agent
d, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
agents = [Agent(f"a{i}", control=f"ipc://{d}/a{i}.ctl", heartbeat_interval_s=1.0).start()
          for i in range(first, first + count)]
print(json.dumps({"event": "ready", "agents": count}), flush=True)
sys.stdin.read()   # until the benchmark closes our stdin
for a in agents:
    a.close()
"""

CONTROLLER_HOST = r"""
import sys, json
from pathlib import Path
from ckpt_controller.controller.config import parse_config
from ckpt_controller.serve import NodeService
node = NodeService(parse_config(Path(sys.argv[1]).read_text())).start()
print(json.dumps({"event": "ready", "endpoint": node.server.endpoint}), flush=True)
sys.stdin.read()   # until the benchmark closes our stdin
node.close()
"""

ECHO_HOST = r"""
import sys, json, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(sys.argv[1])
print(json.dumps({"event": "ready"}), flush=True)
while True:
    frames = sock.recv_multipart()
    if frames[1:] == [b"stop"]:
        break
    sock.send_multipart(frames)
sock.close()
ctx.term()
"""

FLOOR_HOST = r"""
import sys, json, sqlite3, zmq
endpoint, agent, path, records = *sys.argv[1:4], int(sys.argv[4])
ctx = zmq.Context()
front = ctx.socket(zmq.ROUTER)
front.setsockopt(zmq.LINGER, 0)
front.bind(endpoint)
back = ctx.socket(zmq.DEALER)
back.setsockopt(zmq.LINGER, 0)
back.connect(agent)
db = sqlite3.connect(path, isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=FULL")
db.execute("CREATE TABLE operations (op_id TEXT PRIMARY KEY, status TEXT, result BLOB)")
db.execute("CREATE TABLE records (seq INTEGER PRIMARY KEY, op_id TEXT, data TEXT)")
command, result = [b"\x01", bytes(64)], bytes(512)
print(json.dumps({"event": "ready"}), flush=True)
n = 0
while True:
    frames = front.recv_multipart()
    if frames[1:] == [b"stop"]:
        break
    n += 1
    op = str(n)
    db.execute("BEGIN IMMEDIATE")  # the operation's row, durable before any engine moves
    db.execute("INSERT INTO operations VALUES (?, 'running', NULL)", (op,))
    db.execute("COMMIT")
    for _ in range(2):  # prepare, restore
        back.send_multipart(command)
        back.recv_multipart()
    db.execute("BEGIN IMMEDIATE")  # its records and result, durable before the reply
    db.executemany("INSERT INTO records (op_id, data) VALUES (?, '{}')", [(op,)] * records)
    db.execute("UPDATE operations SET status = 'succeeded', result = ? WHERE op_id = ?",
               (result, op))
    db.execute("COMMIT")
    front.send_multipart([frames[0], frames[1], result])
front.close()
back.close()
ctx.term()
"""

_libc = ctypes.CDLL(None, use_errno=True)


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has spent so far, user and system, all its threads."""
    clock = ctypes.c_int()
    err = _libc.clock_getcpuclockid(pid, ctypes.byref(clock))
    if err:
        raise OSError(err, f"no CPU clock for process {pid}")
    return time.clock_gettime_ns(clock.value) / 1e9


def _popen(script: str, *argv: str, log: Path) -> subprocess.Popen:
    """A host started; what it logs goes to ``log`` (a controller warns once per engine and
    cycle that nothing was captured, which would bury the tables)."""
    with open(log, "ab") as err:
        return subprocess.Popen([sys.executable, "-c", script, *argv], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)


def _spawn(script: str, *argv: str, log: Path) -> tuple[subprocess.Popen, dict]:
    """A host started and ready: its process and what its ready line said."""
    proc = _popen(script, *argv, log=log)
    try:
        return proc, _ready(proc, log)
    except BaseException:  # policy: a host that failed to start is ended, the error goes on
        _end([proc])
        raise


def _ready(proc: subprocess.Popen, log: Path) -> dict:
    """The host's ready line; a host that ends, says something else first or says nothing
    for ``HOST_START_S`` is an error that shows the end of its log."""
    readable, _, _ = select.select([proc.stdout], [], [], HOST_START_S)
    line = proc.stdout.readline() if readable else f"(nothing in {HOST_START_S:.0f} s)"
    try:
        said = json.loads(line)
    except json.JSONDecodeError:  # policy: not a ready line: the host failed to start
        said = {}
    if said.get("event") != "ready":
        proc.kill()
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"a benchmark host did not start: {line!r}\n{tail}")
    return said


def _end(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(HOST_EXIT_S)
        except subprocess.TimeoutExpired:  # policy: a host that hangs on close is killed
            proc.kill()
            proc.wait()


class Fleet:
    """``n`` agents in processes of at most ``per`` agents each."""

    def __init__(self, d: Path, n: int, per: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        try:
            for first in range(0, n, per):
                self.logs.append(d / f"agents-{first}.log")
                self.procs.append(_popen(AGENT_HOST, str(d), str(first),
                                         str(min(per, n - first)), log=self.logs[-1]))
            for proc, log in zip(self.procs, self.logs):
                _ready(proc, log)
        except BaseException:  # policy: a fleet half started is ended before the error goes on
            self.close()
            raise

    def cpu_s(self) -> float:
        """CPU seconds all agent hosts have spent so far."""
        return sum(cpu_s(proc.pid) for proc in self.procs)

    def close(self) -> None:
        _end(self.procs)


class ControllerHost:
    """A node controller alone in its process, configured by the TOML in ``config``
    (``proc``: one already started by ``many``, waited for here)."""

    def __init__(self, config: Path, proc: subprocess.Popen | None = None) -> None:
        log = config.with_suffix(".log")
        if proc is None:
            self.proc, said = _spawn(CONTROLLER_HOST, str(config), log=log)
        else:
            self.proc, said = proc, _ready(proc, log)
        self.endpoint: str = said["endpoint"]

    @classmethod
    def many(cls, configs: list[Path]) -> list["ControllerHost"]:
        """A controller for each config, all started at once and then waited for."""
        procs = [_popen(CONTROLLER_HOST, str(c), log=c.with_suffix(".log")) for c in configs]
        try:
            return [cls(c, proc) for c, proc in zip(configs, procs)]
        except BaseException:  # policy: controllers half started are ended, the error goes on
            _end(procs)
            raise

    @staticmethod
    def close_all(hosts: list["ControllerHost"]) -> None:
        """End several at once (each is told first, then each is waited for)."""
        _end([h.proc for h in hosts])

    def cpu_s(self) -> float:
        return cpu_s(self.proc.pid)

    def close(self) -> None:
        _end([self.proc])

    def __enter__(self) -> "ControllerHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _RouterHost:
    """A ROUTER host in a process of its own (the echo, the floor): timed round trips to it,
    its CPU clock, and the end of it."""

    endpoint: str
    proc: subprocess.Popen

    def _timed(self, frames: list[bytes], count: int, warm: int) -> list[float]:
        """Seconds of each of ``count`` round trips of ``frames``, after ``warm`` untimed
        ones; ``zmq.Again`` when an answer takes ``ECHO_TIMEOUT_MS`` (the host is broken)."""
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, ECHO_TIMEOUT_MS)
        sock.connect(self.endpoint)
        times = []
        try:
            for i in range(warm + count):
                t0 = time.perf_counter()
                sock.send_multipart(frames)
                sock.recv_multipart()
                if i >= warm:
                    times.append(time.perf_counter() - t0)
        finally:
            sock.close()
        return times

    def cpu_s(self) -> float:
        return cpu_s(self.proc.pid)

    def close(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1_000)
        sock.connect(self.endpoint)
        sock.send(b"stop")
        sock.close()
        _end([self.proc])


class FloorHost(_RouterHost):
    """``FLOOR_HOST`` in its own process: a journal at ``journal`` (made there) and an agent
    at ``agent`` (an ``EchoHost``); ``cycles`` times each request's round trip."""

    #: records a one-engine cycle with nothing to drain or hook journals
    RECORDS = 12

    def __init__(self, endpoint: str, agent: str, journal: Path, log: Path) -> None:
        self.endpoint = endpoint
        self.proc, _ = _spawn(FLOOR_HOST, endpoint, agent, str(journal), str(self.RECORDS),
                              log=log)

    def cycles(self, count: int, warm: int = 10) -> list[float]:
        """Seconds of each of ``count`` requests, request to answer, after ``warm`` untimed
        ones."""
        return self._timed([b"\x01", bytes(64)], count, warm)


class EchoHost(_RouterHost):
    """A bare ROUTER in its own process that sends each message back as it came."""

    def __init__(self, endpoint: str, log: Path) -> None:
        self.endpoint = endpoint
        self.proc, _ = _spawn(ECHO_HOST, endpoint, log=log)

    def round_trips(self, count: int, body_bytes: int = 64, warm: int = 100) -> list[float]:
        """Seconds of each of ``count`` round trips of a two-frame message (a type byte and a
        ``body_bytes`` body, as a protocol frame), after ``warm`` untimed ones."""
        return self._timed([b"\x01", bytes(body_bytes)], count, warm)
