"""systemd notifications (``ckpt_controller.sdnotify``) over a datagram socket the test binds,
as systemd would: the real ``ckptctl serve`` and ``ckptctl agent vllm`` (beside the vLLM
stand-in, ``tests/vllm/standin_server.py``) say READY=1 only once their endpoint answers,
ping the watchdog while they run, stop pinging while stopped (SIGSTOP) or while their control
thread hangs, and say STOPPING=1 at SIGTERM (``engine serve`` too, in the slow suite). Without
``$NOTIFY_SOCKET`` nothing is sent, and a socket that is gone is logged once, never fatal."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_controller.rpcserver import RpcServer
from ckpt_controller.sdnotify import (
    MAX_PING_PERIOD_S,
    Notifier,
    socket_address,
    watchdog_period,
)
from support import ROOT
from support.cli import CKPTCTL
from support.timing import deadline_in, scaled, wait_until
from support.vllm import STANDIN_SERVER

#: WATCHDOG_USEC for the tests: a ping every 0.5 s
WATCHDOG_USEC = 1_000_000


class NotifySocket:
    """The systemd side: an AF_UNIX datagram socket bound at ``path`` (or an abstract name)
    that keeps every message it receives, in order."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.messages: list[dict[str, str]] = []

    def read(self, timeout_s: float) -> list[dict[str, str]]:
        """Messages that arrive within ``timeout_s`` (all that are waiting, at least)."""
        got = []
        end = time.monotonic() + timeout_s
        while True:
            self.sock.settimeout(max(0.0, end - time.monotonic()) or 0.001)
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, BlockingIOError):  # policy: nothing more within the time
                break
            msg = dict(line.split("=", 1) for line in data.decode().splitlines())
            got.append(msg)
            self.messages.append(msg)
        return got

    def wait_for(self, key: str, timeout_s: float = 60.0) -> dict[str, str]:
        end = deadline_in(timeout_s)
        while time.monotonic() < end:
            for msg in self.read(min(0.2, end - time.monotonic())):
                if key in msg:
                    return msg
        raise AssertionError(f"no {key} within {timeout_s} s; got {self.messages}")

    def pings(self, seconds: float) -> int:
        return sum("WATCHDOG" in m for m in self.read(seconds))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(ipc_dir):
    sock = NotifySocket(str(ipc_dir / "notify.sock"))
    yield sock
    sock.close()


def _env(notify_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_PID",)}
    env.update(NOTIFY_SOCKET=str(notify_path), WATCHDOG_USEC=str(WATCHDOG_USEC), **extra)
    return env


# ---------------------------------------------------------------- the module alone


def test_addresses_and_watchdog_period_from_the_environment():
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@abstract") == b"\0abstract"
    assert socket_address("vsock:2:1234") is None and socket_address("@") is None
    assert watchdog_period({"WATCHDOG_USEC": "30000000"}, 7) == 15.0
    assert watchdog_period({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, 7) == 15.0
    assert watchdog_period({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, 7) is None
    for bad in ("", "0", "-5", "1e6", "soon"):
        assert watchdog_period({"WATCHDOG_USEC": bad}, 7) is None


def test_odd_watchdog_values_neither_crash_nor_kill_the_pings(notify, ipc_dir):
    """Digits str.isdigit() takes but int() does not ("²"), or not ASCII ones: no watchdog,
    no ValueError at start. A value beyond any wait the platform allows: pings at most
    ``MAX_PING_PERIOD_S`` apart, the thread alive (it died of an OverflowError)."""
    for odd in ("²", "\u0661\u0662\u0663", " 100", "+100"):
        assert watchdog_period({"WATCHDOG_USEC": odd}, 7) is None, odd
        assert Notifier({"NOTIFY_SOCKET": str(ipc_dir / "notify.sock"),
                         "WATCHDOG_USEC": odd}).watchdog_s is None
    huge = str(10**23)
    assert watchdog_period({"WATCHDOG_USEC": huge}, 7) == MAX_PING_PERIOD_S
    n = Notifier({"NOTIFY_SOCKET": str(ipc_dir / "notify.sock"), "WATCHDOG_USEC": huge})
    n.start_watchdog(time.monotonic)
    try:
        wait_until(lambda: notify.pings(0.2), 5, "a first ping")
        thread = n._thread
        thread.join(0.5)  # it ended at once, from its first wait, before the fix
        assert thread.is_alive()
    finally:
        n.close()


def test_unset_is_a_no_op_and_the_variables_leave_the_environment(ipc_dir):
    environ = {"PATH": "/bin"}
    n = Notifier.from_env(environ)
    assert not n.enabled and n.send(ready=1) is False
    n.ready("serving", last_round=time.monotonic)
    assert n._thread is None  # no watchdog without a socket
    environ = {"NOTIFY_SOCKET": str(ipc_dir / "n.sock"), "WATCHDOG_USEC": "1000000",
               "WATCHDOG_PID": str(os.getpid()), "PATH": "/bin"}
    n = Notifier.from_env(environ)
    assert n.enabled and n.watchdog_s == 0.5
    assert environ == {"PATH": "/bin"}  # children (hooks) do not inherit them


def test_abstract_socket_and_the_message_format():
    name = f"ckpt-notify-test-{os.getpid()}"
    sd = NotifySocket(b"\0" + name.encode())
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name}, pid=4242)
        n.ready("serving\ntwo lines")
        msg = sd.wait_for("READY", 5)
        assert msg == {"READY": "1", "STATUS": "serving two lines", "MAINPID": "4242"}
        n.stopping()
        assert sd.wait_for("STOPPING", 5) == {"STOPPING": "1", "STATUS": "stopping"}
    finally:
        sd.close()


def test_a_socket_that_is_gone_is_logged_once_and_never_fatal(ipc_dir, caplog):
    n = Notifier({"NOTIFY_SOCKET": str(ipc_dir / "nobody.sock")})
    with caplog.at_level(logging.WARNING, logger="ckpt_controller.sdnotify"):
        assert n.send(ready=1) is False
        assert n.send(watchdog=1) is False
        n.stopping()
    warned = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
    assert len(warned) == 1 and "nobody.sock" in warned[0].getMessage()


def test_pings_follow_the_last_round_and_watchdog_pid_of_another_process(notify, ipc_dir):
    path = str(ipc_dir / "notify.sock")
    other = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000",
                      "WATCHDOG_PID": str(os.getpid() + 1)})
    other.ready("serving", last_round=time.monotonic)
    assert other._thread is None
    assert [m.get("READY") for m in notify.read(0.5)] == ["1"]  # READY still goes
    other.close()

    # a round "now" for the next hour: a beat taken at this line could be older than the
    # period by the time a loaded machine runs the watchdog thread's first check
    beat = [time.monotonic() + 3600]
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})  # a ping every 0.1 s
    n.start_watchdog(lambda: beat[0])
    try:
        wait_until(lambda: notify.pings(0.2), 5, "a first ping")
        beat[0] = 0.0  # the loop stopped: older than a period
        notify.read(0.15)  # a ping already on its way
        assert notify.pings(0.6) == 0
        beat[0] = time.monotonic() + 3600  # alive again
        wait_until(lambda: notify.pings(0.2), 5, "pings again")
    finally:
        n.close()


class _Server(RpcServer):
    """The bare socket loop the controller and the agents share (no requests served)."""


def test_an_idle_loop_rounds_as_often_as_its_watchdog_needs(notify, ipc_dir):
    """A server idles up to its heartbeat interval (here 5 s); told the watchdog's period, it
    begins a round at least every half of it, so an idle, healthy loop keeps the pings going."""
    server = _Server(f"ipc://{ipc_dir}/idle.sock", name="test", heartbeat_interval_s=5.0)
    server.on_thread_death = lambda name, exc: None
    server.start()
    n = Notifier({"NOTIFY_SOCKET": str(ipc_dir / "notify.sock"), "WATCHDOG_USEC": "400000"})
    try:
        n.ready("serving", last_round=lambda: server.last_round,
                rounds_within=server.rounds_within)
        assert notify.wait_for("READY", 5)["READY"] == "1"
        wait_until(lambda: notify.pings(0.3), 5, "pings from a live loop")
        # one each 0.2 s: never a period without a round (the window stretched with the
        # host's load, the count not: a loop that idled seconds would still give fewer)
        assert notify.pings(scaled(1.6, below=4.5)) >= 5
    finally:
        n.close()
        server.close()


def test_a_hung_control_thread_stops_the_pings(notify, ipc_dir):
    server = _Server(f"ipc://{ipc_dir}/rpc.sock", name="test", heartbeat_interval_s=0.1)
    server.on_thread_death = lambda name, exc: None
    server.start()
    n = Notifier({"NOTIFY_SOCKET": str(ipc_dir / "notify.sock"), "WATCHDOG_USEC": "400000"})
    try:
        n.ready("serving", last_round=lambda: server.last_round)
        assert notify.wait_for("READY", 5)["READY"] == "1"
        wait_until(lambda: notify.pings(0.3), 5, "pings from a live loop")
        server.stall(2.0)  # the control thread stops taking rounds
        notify.read(0.45)  # one ping may have been checked just before
        assert notify.pings(1.0) == 0
        wait_until(lambda: notify.pings(0.3), 5, "pings after the stall")
    finally:
        n.close()
        server.close()


# ---------------------------------------------------------------- real processes


def _stop_cont_and_term(proc: subprocess.Popen, notify: NotifySocket) -> None:
    """Pings while it runs, none while it is stopped, pings after SIGCONT, STOPPING=1 and
    exit 0 at SIGTERM."""
    wait_until(lambda: notify.pings(0.6) >= 1, 10, "watchdog pings")
    assert notify.pings(scaled(1.6, below=4.5)) >= 2  # every 0.5 s
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        notify.read(0.2)  # a ping sent just before
        assert notify.pings(1.5) == 0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    wait_until(lambda: notify.pings(0.6), 10, "pings after SIGCONT")
    proc.terminate()
    assert notify.wait_for("STOPPING", 20)["STOPPING"] == "1"
    assert proc.wait(timeout=scaled(30)) == 0


def _ready_then_answer(proc: subprocess.Popen, notify: NotifySocket, answer) -> dict:
    """READY=1 is the first message, naming the process as MAINPID, and its endpoint answers
    as soon as it came."""
    msg = notify.wait_for("READY", 90)
    assert notify.messages[0] is msg  # nothing (no ping) before READY
    assert msg["MAINPID"] == str(proc.pid) and msg["STATUS"]
    answer()
    return msg


def test_ckptctl_serve_notifies_systemd(notify, ipc_dir):
    endpoint = f"ipc://{ipc_dir}/ctl.sock"
    config = ipc_dir / "c.toml"
    config.write_text(f'[controller]\nendpoint = "{endpoint}"\nstate_dir = "{ipc_dir}/state"\n')
    log = (ipc_dir / "serve.log").open("w")
    proc = subprocess.Popen([*CKPTCTL, "serve", "--config",
                             str(config), "--log-format", "json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            env=_env(ipc_dir / "notify.sock"), start_new_session=True)
    try:
        from ckpt_controller.controller.client import ControllerClient

        def answer() -> None:
            with ControllerClient(endpoint, timeout_s=5) as c:
                assert c.history(limit=1).operations == []

        msg = _ready_then_answer(proc, notify, answer)
        assert endpoint in msg["STATUS"]
        assert json.loads(proc.stdout.readline())["event"] == "ready"
        _stop_cont_and_term(proc, notify)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()
    records = [json.loads(line) for line in (ipc_dir / "serve.log").read_text().splitlines()]
    assert any("serving on" in r["msg"] for r in records)  # the JSON log format, end to end


def test_ckptctl_agent_vllm_notifies_systemd(notify, ipc_dir):
    standin_log = (ipc_dir / "standin.log").open("w")
    side_log = (ipc_dir / "side.log").open("w")
    standin = subprocess.Popen([sys.executable, str(STANDIN_SERVER)],
                               stdout=subprocess.PIPE, stderr=standin_log, text=True,
                               start_new_session=True)
    side = None
    try:
        url = json.loads(standin.stdout.readline())["url"]
        control = f"ipc://{ipc_dir}/side.sock"
        side = subprocess.Popen([*CKPTCTL, "agent", "vllm",
                                 "--url", url, "--control", control, "--name", "standin",
                                 "--no-verify-weights", "--log-level", "debug"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=side_log, text=True,
                                env=_env(ipc_dir / "notify.sock"), start_new_session=True)
        from ckpt_controller.agent.client import AgentClient

        def answer() -> None:
            with AgentClient(control, timeout_s=5) as agent:
                assert agent.status().state == "running"

        msg = _ready_then_answer(side, notify, answer)
        assert url in msg["STATUS"] and control in msg["STATUS"]
        _stop_cont_and_term(side, notify)
    finally:
        for proc in (side, standin):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc is not None:
                proc.stdout.close()
        standin_log.close()
        side_log.close()


def test_no_ready_while_vllm_does_not_answer(notify, ipc_dir):
    with socket.socket() as free:  # a port nobody serves
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = subprocess.run([*CKPTCTL, "agent", "vllm", "--url",
                          f"http://127.0.0.1:{port}", "--control", f"ipc://{ipc_dir}/s.sock"],
                         cwd=ROOT, capture_output=True, text=True, timeout=scaled(60),
                         env=_env(ipc_dir / "notify.sock"))
    assert out.returncode == 4, out.stderr
    assert not any("READY" in m for m in notify.read(0.2))


@pytest.mark.slow  # about 10 s here (torch and the model); the notify code is the same as above
def test_ckptctl_engine_serve_notifies_systemd(notify, ipc_dir, model_dir):
    control = f"ipc://{ipc_dir}/eng.ctl"
    log = (ipc_dir / "engine.log").open("w")
    proc = subprocess.Popen([*CKPTCTL, "engine", "serve",
                             "--name", "eng", "--api", f"ipc://{ipc_dir}/eng.api", "--control",
                             control, "--model-dir", str(model_dir), "--heartbeat", "0.2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=_env(ipc_dir / "notify.sock"), start_new_session=True)
    try:
        from ckpt_controller.agent.client import AgentClient

        def answer() -> None:
            with AgentClient(control, timeout_s=5) as agent:
                assert agent.status().state == "running"

        _ready_then_answer(proc, notify, answer)
        wait_until(lambda: notify.pings(0.6), 10, "watchdog pings")
        proc.terminate()
        assert notify.wait_for("STOPPING", 20)["STOPPING"] == "1"
        assert proc.wait(timeout=scaled(30)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()
