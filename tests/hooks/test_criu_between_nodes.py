"""Real CRIU between two nodes: a reference engine moves from network namespace A to B.

The CRIU side of a migration, without the fleet layer: two network namespaces joined by a
veth pair (``netns_util``, 169.254.77.1 and .2), the engine started in A in its own PID
namespace (``nsenter --net unshare --pid --fork setsid``) on wildcard TCP endpoints, prepared
at level 2, dumped with ``CKPT_CRIU_MODE=leave-stopped`` and restored in B with
``CKPT_CRIU_BESIDE=1``; every criu (dump, page server, restore) and every client runs through
``nsenter`` into its namespace (``ip netns exec`` would give it a mount namespace of its own,
which CRIU refuses). Two ways: pages through a page server in B (the small files shipped with
``criu_images.pack_small``/``unpack_small``), and one folder both sides see. A pages file cut
short in B is refused naming it, and the stopped source, sent SIGCONT, serves again. Prints
the sizes and times of both ways.

Needs root, iproute2, nsenter/unshare and CRIU (``make criu``); skips saying why otherwise,
and ``CKPT_REQUIRE_CRIU=1`` makes a CRIU skip a failure (as in ``test_criu``).
Neighbours: ``test_criu`` (one host), ``test_netns`` and ``test_fleet_netns`` (namespaces).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ckpt_controller.criu_images import PageServer, pack_small, pages_expected, unpack_small
from ckpt_controller.endpoints import free_port
from support import ROOT
from support.criu import CRIU, criu_missing
from support.netns_util import Namespaces, run_tag
from support.timing import scaled, wait_until

pytestmark = pytest.mark.skipif(criu_missing() is not None, reason=criu_missing() or "")

A_IP, B_IP = "169.254.77.1", "169.254.77.2"
PROMPT, TOKENS = [5, 6, 7], 40

#: a client of the engine, run inside a namespace: ``ACTION ENDPOINT [PROMPT TOKENS]``
_CLIENT = """
import json, sys
from ckpt_controller.agent import AgentClient
from ckpt_controller.engine.client import EngineClient
what, endpoint = sys.argv[1], sys.argv[2]
if what == "generate":
    with EngineClient(endpoint) as c:
        out = c.generate(json.loads(sys.argv[3]), int(sys.argv[4]), timeout_s=60).token_ids
else:
    with AgentClient(endpoint) as a:
        if what == "status":
            st = a.status()
            out = {"state": str(st.state), "restored": st.restored_from_image}
        else:
            out = str(getattr(a, what)(**({"level": 2} if what == "prepare" else {})).state)
print(json.dumps(out))
"""


def _needs() -> None:
    for tool in ("nsenter", "unshare", "setsid"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} here (util-linux)")


def _in(ns: str) -> list[str]:
    """Run a command in ``ns``'s network namespace, in the host's mount namespace."""
    return ["nsenter", f"--net=/run/netns/{ns}"]


def _ask(ns: str, what: str, endpoint: str, *args) -> object:
    out = subprocess.run([*_in(ns), sys.executable, "-c", _CLIENT, what, endpoint,
                          *map(str, args)], capture_output=True, text=True,
                         timeout=scaled(120), cwd=ROOT)
    assert out.returncode == 0, f"{what} {endpoint} from {ns}: {out.stderr[-2000:]}"
    return json.loads(out.stdout)


@pytest.fixture
def two_nodes():
    _needs()
    tag = run_tag()
    a, b = f"ckpt-ma{tag}", f"ckpt-mb{tag}"
    made = Namespaces.or_skip(a)
    try:
        made.add(b)
        made.join(a, f"vcma{tag}", A_IP, b, f"vcmb{tag}", B_IP)
        yield a, b
    finally:
        made.remove()


class NodeEngine:
    """``ckptctl engine serve`` in namespace ``ns``, PID 1 of a PID namespace of its own, on
    wildcard TCP endpoints; its stdout and stderr are files of its own (``unshare`` has
    another: CRIU refuses a log file whose size changed under the image)."""

    def __init__(self, ns: str, folder: Path, model_dir: Path, name: str) -> None:
        self.ports = free_port(), free_port()
        self.out, self.log = folder / f"{name}.out", folder / f"{name}.log"
        self._unshare_log = (folder / f"{name}.unshare.log").open("w")
        self.launcher = subprocess.Popen(
            [*_in(ns), "unshare", "--pid", "--fork", "setsid", "sh", "-c",
             'exec "$@" </dev/null >"$0.out" 2>"$0.log"', str(folder / name), sys.executable,
             "-m", "ckpt_controller", "engine", "serve", "--name", name,
             "--api", f"tcp://0.0.0.0:{self.ports[0]}",
             "--control", f"tcp://0.0.0.0:{self.ports[1]}", "--model-dir", str(model_dir),
             "--heartbeat", "0.2"],
            stdin=subprocess.DEVNULL, stdout=self._unshare_log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=ROOT)
        self.info = wait_until(self._ready, 120, f"engine {name} ready", 0.1)
        (kid,) = psutil.Process(self.launcher.pid).children()  # nsenter execs unshare
        self.pid = kid.pid

    def _ready(self) -> dict | None:
        assert self.launcher.poll() is None, self.log.read_text()[-2000:]
        for line in self.out.read_text().splitlines() if self.out.exists() else ():
            if line.startswith("{"):
                return json.loads(line)
        return None

    def api(self, ip: str) -> str:
        return f"tcp://{ip}:{self.ports[0]}"

    def control(self, ip: str) -> str:
        return f"tcp://{ip}:{self.ports[1]}"

    def stop(self) -> None:
        if self.launcher.poll() is None:
            os.kill(self.pid, signal.SIGKILL)  # a PID namespace's init: its namespace ends
            self.launcher.kill()
            self.launcher.wait(timeout=scaled(10))
        self._unshare_log.close()


def _image_folder(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def _hook(ns: str, hook: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run([*_in(ns), str(ROOT / "hooks" / hook)], capture_output=True,
                         text=True, timeout=scaled(180),
                         env=dict(os.environ, CKPT_CRIU=CRIU, **env))
    return out, time.monotonic() - start


def _dump(ns: str, pid: int, folder: Path, **env: str) -> float:
    out, took = _hook(ns, "criu-dump", dict(CKPT_ACTION="dump", CKPT_ENGINE_PID=str(pid),
                                            CKPT_IMAGE_DIR=str(folder),
                                            CKPT_CRIU_MODE="leave-stopped", **env))
    assert out.returncode == 0, out.stderr
    return took


def _restore(ns: str, pid: int, folder: Path) -> subprocess.CompletedProcess:
    out, took = _hook(ns, "criu-restore", dict(
        CKPT_ACTION="pre-restore", CKPT_ENGINE_PID=str(pid), CKPT_IMAGE_DIR=str(folder),
        CKPT_RESTORE_FROM=str(folder), CKPT_CRIU_BESIDE="1"))
    out.took = took
    return out


def _restored_pid(out: subprocess.CompletedProcess, folder: Path, eng: "NodeEngine") -> int:
    """The restored root's host PID, as criu-restore prints it and wrote it; a new one (the
    copy is its own PID namespace's init beside the stopped source) running the engine."""
    assert out.returncode == 0, out.stderr
    (printed,) = re.findall(r"restored the engine from .* \(pid (\d+)\)", out.stdout)
    pid = int(printed)
    assert (folder / "criu-restored-pid").read_text().strip() == printed
    assert pid != eng.pid and eng.control("0.0.0.0") in " ".join(psutil.Process(pid).cmdline())
    return pid


def _moved_and_serves(eng: NodeEngine, a: str, b: str, copy: int, want: list[int]) -> None:
    """The source stopped in A, the copy answering at B's address (asked from A, over the
    link), re-woken to RUNNING, giving the tokens it gave before the move."""
    assert psutil.Process(eng.pid).status() == psutil.STATUS_STOPPED
    status = _ask(a, "status", eng.control(B_IP))
    assert status["restored"] and status["state"] == "prepared", status
    assert _ask(a, "restore", eng.control(B_IP)) == "running"
    assert _ask(a, "generate", eng.api(B_IP), json.dumps(PROMPT), TOKENS) == want
    assert psutil.Process(copy).status() != psutil.STATUS_ZOMBIE


def _files_bytes(folder: Path, pages: bool) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()
               and bool(re.fullmatch(r"pages-\d+\.img", f.name)) == pages
               and not f.name.endswith(".log"))


def test_an_engine_moves_to_another_node_and_back_when_the_move_fails(two_nodes, ipc_dir,
                                                                     model_dir, capsys):
    a, b = two_nodes
    eng = NodeEngine(a, ipc_dir, model_dir, "mover")
    copies: list[int] = []
    measured = {}
    try:
        want = _ask(b, "generate", eng.api(A_IP), json.dumps(PROMPT), TOKENS)
        assert len(want) == TOKENS
        assert _ask(b, "prepare", eng.control(A_IP)) == "prepared"

        # 1. pages through B's page server; the small files shipped as one archive
        here, there = _image_folder(ipc_dir / "ps-a"), _image_folder(ipc_dir / "ps-b")
        with PageServer(CRIU, there, B_IP, wrap=_in(b)) as server:
            dump_s = _dump(a, eng.pid, here, CKPT_PAGE_SERVER=server.endpoint)
            assert server.wait(scaled(30)) == 0  # it ends after the one dump it served
        assert (here / "criu-pages-remote").read_text().strip() == server.endpoint
        assert not list(here.glob("pages-*.img")) and pages_expected(there)
        start = time.monotonic()
        shipped = pack_small(here)
        unpack_small(shipped, there)
        ship_s = time.monotonic() - start
        out = _restore(b, eng.pid, there)
        copies.append(_restored_pid(out, there, eng))
        _moved_and_serves(eng, a, b, copies[-1], want)
        measured["page server"] = (dump_s, ship_s, out.took, _files_bytes(there, True),
                                   _files_bytes(here, False), len(shipped))
        os.kill(copies[-1], signal.SIGKILL)  # the move is undone below: B's copy goes

        # 2. a pages file cut short in B is refused, naming it; the source resumes in A
        pages = max(there.glob("pages-*.img"), key=lambda f: f.stat().st_size)
        os.truncate(pages, pages.stat().st_size - 4096)
        (there / "restore.log").unlink()
        out = _restore(b, eng.pid, there)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"the image in {there} is damaged: ./{pages.name}" in out.stderr
        assert "page server" in out.stderr and not (there / "restore.log").exists()
        os.kill(eng.pid, signal.SIGCONT)
        wait_until(lambda: psutil.Process(eng.pid).status() != psutil.STATUS_STOPPED, 10,
                   "the source running again")
        assert _ask(b, "restore", eng.control(A_IP)) == "running"
        assert _ask(b, "generate", eng.api(A_IP), json.dumps(PROMPT), TOKENS) == want

        # 3. one folder both nodes see: dumped from A, restored in B from the same place
        assert _ask(b, "prepare", eng.control(A_IP)) == "prepared"
        shared = _image_folder(ipc_dir / "shared")
        dump_s = _dump(a, eng.pid, shared)
        assert not (shared / "criu-pages-remote").exists()
        out = _restore(b, eng.pid, shared)
        copies.append(_restored_pid(out, shared, eng))
        _moved_and_serves(eng, a, b, copies[-1], want)
        measured["shared folder"] = (dump_s, 0.0, out.took, _files_bytes(shared, True),
                                     _files_bytes(shared, False), len(pack_small(shared)))
    finally:
        for pid in copies:  # restored copies are no children of ours; B's removal ends them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # policy: already gone
                continue
        eng.stop()
    with capsys.disabled():
        print("\nCRIU between nodes (reference engine, tiny model, PREPARED at level 2):")
        for way, (dump_s, ship_s, restore_s, pages_b, small_b, packed) in measured.items():
            print(f"  {way}: image {(pages_b + small_b) / 2**20:.1f} MiB = pages "
                  f"{pages_b / 2**20:.1f} MiB + non-page {small_b / 2**10:.0f} KiB "
                  f"({packed / 2**10:.0f} KiB packed); dump {dump_s:.2f} s, ship "
                  f"{ship_s:.2f} s, restore {restore_s:.2f} s (hooks, through nsenter)")


def test_a_page_server_on_a_taken_port_says_so_and_a_chosen_port_is_tried_again(
        ipc_dir, monkeypatch):
    """A port asked for and taken: ``OperationError`` with criu's reason from its log. A port
    chosen (``port=0``) that turns out taken: another is chosen, and the server listens."""
    import socket

    from ckpt_controller import criu_images
    from ckpt_controller.errors import OperationError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OperationError) as info:
            PageServer(CRIU, _image_folder(ipc_dir / "one"), "127.0.0.1", port)
        assert f"did not start on 127.0.0.1:{port}" in info.value.message
        assert "Can't bind" in info.value.details["log_tail"]
        chosen = iter([port, free_port()])
        monkeypatch.setattr(criu_images, "_free_port", lambda address: next(chosen))
        with PageServer(CRIU, _image_folder(ipc_dir / "two"), "127.0.0.1") as server:
            assert server.port != port and server.proc.poll() is None
            with socket.create_connection(("127.0.0.1", server.port), timeout=5):
                pass  # it listens
            server.stop()
            assert server.proc.poll() is not None
