"""A real vLLM server migrated between two nodes (network namespaces, ``tests/test_migration``'s
``Pair``) with ``ckptctl fleet migrate`` under a few concurrent completions.

vLLM and its sidecar run under one PID-namespace init (``ckptctl agent vllm-launch``), so one
CRIU image holds both and the sidecar's endpoints move with vLLM. The clients
(``FollowingVllm``) cannot keep their open HTTP connections (CRIU cannot restore them at
another address) and send their requests again at the address the registry then names (their
watch of the engine's record says so as the target takes it over); the answers equal those of
the engine before it moved. Marked ``vllm`` and ``fleet``; needs what
``test_migration`` needs, the vLLM venv (``make vllm``) and a writable
``kernel.io_uring_disabled``. A launcher test with the stand-in server (no vLLM) runs by
default where root and ``unshare`` are."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from test_migration import Pair, net_of

from support import ROOT
from support.cli import CKPTCTL, ckptctl
from support.config import engines_toml
from support.criu import migration_missing
from support.processes import pids_naming
from support.timing import scaled, wait_until
from support.vllm import (AMX_PERMISSION, NO_VLLM, STANDIN_SERVER, VLLM_CPU, VLLM_CPU_ENV, VLLM_PY,
                          make_tiny_llama)

URING = Path("/proc/sys/kernel/io_uring_disabled")
HTTP_PORT, CONTROL_PORT = 7721, 7722
PROMPTS = ["the engine moved to", "a second node answers", "checkpoints carry", "four"]
TOKENS = 3000


class VllmPair(Pair):
    """``Pair`` whose n1 names a vLLM engine ``v0`` (kind vllm, level 1, drain keep)."""

    def __init__(self, d: Path, model_dir: Path, transport: str) -> None:
        # vLLM generating on both CPUs of a small machine starves etcd and the nodes' lease
        # keepers for seconds at a time (etcd silent for 6 s was seen, and a 10 s lease ran
        # out on a live node): leases of 30 s, and etcd, which a fleet runs on machines of
        # its own, ahead of vLLM for the CPUs
        super().__init__(d, model_dir, transport, level=1, ttl=30)
        for proc in self.etcd.procs:
            if proc is not None:
                for tid in os.listdir(f"/proc/{proc.pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), -10)

    def engine_table(self) -> str:
        return "\n" + engines_toml(("v0", f"tcp://127.0.0.1:{CONTROL_PORT}"), kind="vllm")

    def start_vllm(self, node: str = "n1", http: int = HTTP_PORT, control: int = CONTROL_PORT):
        """vLLM and its sidecar under ``vllm-launch``, in ``node``'s network namespace and a
        PID namespace of their own, listening on wildcard addresses (ports ``http``,
        ``control``); io_uring off while vLLM starts (CRIU cannot dump it)."""
        from ckpt_controller.procutil import ReadyProcess

        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   HF_HUB_OFFLINE="1", **VLLM_CPU_ENV)
        if AMX_PERMISSION.exists():
            env["LD_PRELOAD"] = str(AMX_PERMISSION)
        old = URING.read_text().strip()
        URING.write_text("2")
        try:
            eng = ReadyProcess(
                [*self.made.enter(self.ns[node]), "unshare", "--pid", "--fork", "setsid",
                 *CKPTCTL, "agent", "vllm-launch", "--url",
                 f"http://0.0.0.0:{http}", "--control", f"tcp://0.0.0.0:{control}",
                 "--name", "v0", "--heartbeat", "1.0", "--log-dir", str(self.d / "v0-logs"),
                 "--", *VLLM_CPU, str(VLLM_PY), "-m",
                 "vllm.entrypoints.launchers.api_server.entry", "--model", str(self.model_dir),
                 "--enforce-eager", "--dtype", "float32", "--host", "0.0.0.0",
                 "--port", str(http)],
                self.d / "v0.log", "vLLM launcher v0", cwd=ROOT, env=env, timeout_s=420)
        finally:
            URING.write_text(old)
        self.started.append(eng)
        return eng

    def live_tree(self) -> list[psutil.Process]:
        """The vLLM engines' launchers that run (not stopped, not zombies)."""
        out = []
        for pid in pids_naming("agent vllm-launch"):
            try:
                proc = psutil.Process(pid)
                if str(self.model_dir) in " ".join(proc.cmdline()) \
                        and proc.cmdline()[0] not in ("unshare", "nsenter") \
                        and "vllm-launch" in proc.cmdline() \
                        and proc.status() not in ("zombie", "stopped", "dead"):
                    out.append(proc)
            except psutil.NoSuchProcess:  # policy: ended meanwhile: not live
                continue
        return out


def _why_not_vllm() -> str | None:
    if (why := migration_missing()) is not None:
        return why
    if not VLLM_PY.exists():
        return NO_VLLM
    if not os.access(URING, os.W_OK):
        return f"cannot turn io_uring off while vLLM starts ({URING} is not writable)"
    return None


_vllm_reason = _why_not_vllm()


def connections_to(addr: tuple[str, int]) -> list:
    """This process's established TCP connections to ``addr``."""
    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.raddr and tuple(c.raddr) == addr]


@pytest.fixture
def tiny_llama(tmp_path):
    return make_tiny_llama(tmp_path / "tinyllama")


class Sender(threading.Thread):
    """One client that follows the engine, sending one completion."""

    def __init__(self, url: str, prompt: str, tokens: int = TOKENS, start: bool = True) -> None:
        """``start=False``: the client is made (its registry read done) and ``start`` sends;
        so that several send at once however long their reads took."""
        super().__init__(daemon=True)
        from ckpt_controller.adapters.vllm.follow import FollowingVllm
        from ckpt_controller.fleet.registry import Resolver

        self.client = FollowingVllm("v0", Resolver(url), follow_for_s=240)
        self.prompt, self.tokens = prompt, tokens
        self.text: str | None = None
        self.error: BaseException | None = None
        if start:
            self.start()

    def run(self) -> None:
        try:
            self.text = self.client.complete(self.prompt, self.tokens, ignore_eos=True).text
        except BaseException as err:  # policy: kept for the test to show
            self.error = err
        finally:
            self.client.close()


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.fleet
@pytest.mark.skipif(_vllm_reason is not None, reason=_vllm_reason or "")
def test_vllm_moves_to_another_node_and_its_clients_follow(tmp_path, tiny_llama):
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.registry import engine_endpoint

    pair = VllmPair(tmp_path, tiny_llama, "shared")
    try:
        eng = pair.start_vllm()
        rec = wait_until(lambda: pair.running_on("n1", "v0"), timeout_s=60, every_s=0.2,
                         what="v0 RUNNING on n1 in the registry")
        assert rec["pid"] == eng.info["pid"]  # the launcher's host PID: the whole tree
        print(f"\nregistry before: {rec['endpoints']}")
        with pair.etcd.client() as c:
            n1_url = engine_endpoint(c, Keys("/ckpt"), "v0", "http")
        assert n1_url == f"http://{pair.addr['n1']}:{HTTP_PORT}"
        n1_addr = (pair.addr["n1"], HTTP_PORT)
        # the answers of an engine that never moved, the four sent together as below
        first = [Sender(pair.url, p, start=False) for p in PROMPTS]
        for s in first:
            s.start()
        for s in first:
            s.join(scaled(300))
        assert all(s.error is None for s in first), [s.error for s in first]
        want = {s.prompt: s.text for s in first}

        # the migration held at n1's pre-prepare hook while the four completions start: they
        # are under way when the drain begins, however fast this machine generates
        pair.pause("n1", "pre-prepare")
        held = pair.d / "marks" / "n1-pre-prepare.at"

        def migrate() -> subprocess.Popen:
            return subprocess.Popen([*CKPTCTL, "--etcd",
                                     pair.url, "fleet", "migrate", "v0", "--to", "n2",
                                     "--drain", "keep", "--op-id", "mvv", "--json"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=ROOT)

        mig = migrate()
        for _ in range(5):
            try:
                wait_until(lambda: held.exists() or mig.poll() is not None, timeout_s=120,
                           every_s=0.05, what="n1 at its pre-prepare hooks, or the command ended")
            except AssertionError as exc:  # policy: the command's own words say why
                mig.kill()
                out, err = mig.communicate(timeout=scaled(30))
                raise AssertionError(f"{exc}; fleet migrate so far:\n{out}\n{err}") from None
            if held.exists():
                break
            # the command ended before the migration reached n1: a starved etcd refuses the
            # submit (exit 4, the operation perhaps recorded), or n1's last look did not
            # reach the sidecar (exit 4); the same --op-id goes on once the registry says
            # RUNNING again
            out, err = mig.communicate(timeout=scaled(30))
            print(f"fleet migrate ended early: exit {mig.returncode}\n{out}\n{err}")
            assert mig.returncode == 4, out + err
            wait_until(lambda: pair.running_on("n1", "v0"), timeout_s=60, every_s=0.2,
                       what="v0 RUNNING on n1 in the registry again")
            mig = migrate()
        assert held.exists(), "the migration never reached n1's pre-prepare hooks"
        senders = [Sender(pair.url, p, start=False) for p in PROMPTS]
        for s in senders:  # the four together: under way at once, as the first four were
            s.start()
        # the drain begins once the four are sent: their connections to n1 are open (asking
        # vLLM's /metrics instead took seconds while it generated, and the four had ended by
        # the time it answered)
        wait_until(lambda: len(connections_to(n1_addr)) >= len(senders)
                   or not all(s.is_alive() for s in senders), timeout_s=60, every_s=0.01,
                   what="the four completions' connections to n1")
        assert all(s.is_alive() for s in senders), [(s.text, s.error) for s in senders]
        pair.go("n1", "pre-prepare")
        out, err = mig.communicate(timeout=scaled(400))
        rc = mig.returncode
        for _ in range(5):
            # etcd on this machine may starve while vLLM generates on both CPUs: the command
            # then ends (exit 4) saying the migration goes on, and the same --op-id follows it
            if rc != 4 or "stays recorded" not in err:
                break
            again = ckptctl("--etcd", pair.url, "fleet", "migrate", "v0", "--to", "n2", "--op-id",
                            "mvv", "--json", timeout=400)
            rc, out, err = again.returncode, again.stdout, again.stderr
        print(f"migrate: rc {rc}\n{out}\n{err}")
        assert rc == 0, out + err
        doc = json.loads(out)
        assert doc["migration"]["outcome"] == "moved", doc
        for s in senders:
            s.join(scaled(300))
        n2_url = f"http://{pair.addr['n2']}:{HTTP_PORT}"
        for s in senders:
            print(f"client {s.prompt!r}: broken {s.client.broken}; moves {s.client.moves}")
        assert all(s.error is None for s in senders), [s.error for s in senders]
        # a client whose request was on its way at the dump went to n2: moved by its watch of
        # the registry as n2 took the engine over (its request sent again there at once), or
        # after its connection closed (``broken``) if the watch was later; one whose
        # completion ended before the drain never needed to
        moved = [s for s in senders if s.client.moves]
        assert moved and all(s.client.moves == [n2_url] for s in moved)
        assert all(s.client.moves for s in senders if s.client.broken)
        assert {s.prompt: s.text for s in senders} == want
        # a client that starts now finds the engine at n2 and gets the same answer
        late = Sender(pair.url, PROMPTS[0], TOKENS)
        late.join(scaled(300))
        assert late.error is None and late.text == want[PROMPTS[0]]
        assert late.client.http.url == n2_url and not late.client.broken

        rec = wait_until(lambda: pair.running_on("n2", "v0"), timeout_s=30, every_s=0.2,
                         what="v0 RUNNING on n2 in the registry")
        print(f"registry after: {rec['endpoints']}")
        with pair.etcd.client() as c:
            assert engine_endpoint(c, Keys("/ckpt"), "v0", "http") == n2_url
        # exactly one launcher runs, in n2's network namespace; the status names its host PID
        live = wait_until(lambda: len(got := pair.live_tree()) == 1 and got, timeout_s=30,
                          what="exactly one vLLM launcher running")
        assert net_of(live[0].pid) == os.stat(f"/run/netns/{pair.ns['n2']}").st_ino
        assert live[0].pid != eng.info["pid"]
        assert rec["pid"] == live[0].pid
        kids = live[0].children()
        assert len(kids) == 2 and all(net_of(k.pid) == net_of(live[0].pid) for k in kids)
        st = json.loads(pair.controllers["n2"].ckptctl("status", "--json").stdout)
        (row,) = st["engines"]
        assert row["status"]["restored_from_image"] and row["status"]["pid"] == live[0].pid
    finally:
        for line in (tmp_path / "v0-logs" / "launcher.log",):
            if line.exists():
                print(line.read_text()[-2000:])
        pair.close()


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.fleet
@pytest.mark.skipif(_vllm_reason is not None, reason=_vllm_reason or "")
def test_a_vllm_move_abandoned_after_its_restore_leaves_the_source_serving(tmp_path,
                                                                            tiny_llama):
    """The target's controller killed once its copy is restored (held at post-restore): the
    move is abandoned (``stayed``) and the source resumed while the copy still lives beside
    it, on one host. The copy has a /dev/shm of its own: its restore and re-wake leave the
    stopped source's shared-memory queues (``psm_*``) as the source left them (they were
    the copy's too, and a source so resumed once died: its worker raised ``KeyError`` on a
    request id), and the source's vLLM serves on with the answers it gave before. The
    target's controller, back, ends the copy."""
    pair = VllmPair(tmp_path, tiny_llama, "shared")
    try:
        eng = pair.start_vllm()
        wait_until(lambda: pair.running_on("n1", "v0"), timeout_s=60, every_s=0.2,
                   what="v0 RUNNING on n1 in the registry")
        before = Sender(pair.url, PROMPTS[0], 200)
        before.join(scaled(300))
        assert before.error is None and before.text, before.error
        pair.pause("n2", "pre-restore")
        pair.pause("n2", "post-restore")
        args = ["--etcd", pair.url, "fleet", "migrate", "v0", "--to", "n2", "--drain", "keep",
                "--op-id", "mva", "--json"]
        mig = subprocess.Popen([*CKPTCTL, *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
        # the source dumped and stopped: its shared-memory files as it left them
        pair.paused("n2", "pre-restore", timeout_s=300)
        shm = (pair.shared / "v0" / "mva" / "criu-shm-files").read_text().split()
        assert shm and all(f.startswith("/dev/shm/psm_") for f in shm), shm
        left = {f: hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in shm}
        pair.go("n2", "pre-restore")
        # the copy restored and re-woken (vLLM's wake-up goes through those queues): the
        # source's files are as it left them, the copy wrote its own
        pair.paused("n2", "post-restore", timeout_s=300)
        assert {f: hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in shm} == left
        (copy,) = [p for p in pair.live_tree() if p.pid != eng.info["pid"]]
        assert net_of(copy.pid) == os.stat(f"/run/netns/{pair.ns['n2']}").st_ino
        pair.controllers["n2"].kill9()
        out, err = mig.communicate(timeout=scaled(400))
        rc = mig.returncode
        for _ in range(5):  # a starved etcd: the command ends (4), the migration goes on
            if rc != 4 or "stays recorded" not in err:
                break
            again = ckptctl(*args, timeout=400)
            rc, out, err = again.returncode, again.stdout, again.stderr
        print(f"migrate: rc {rc}\n{out}\n{err}")
        assert rc == 1 and json.loads(out)["migration"]["outcome"] == "stayed", out + err
        wait_until(lambda: pair.running_on("n1", "v0"), timeout_s=60, every_s=0.2,
                   what="v0 RUNNING on n1 in the registry again")
        assert copy.is_running() and copy.status() != "zombie"  # still beside the source
        for _ in range(3):
            again = Sender(pair.url, PROMPTS[0], 200)
            again.join(scaled(300))
            assert again.error is None and again.text == before.text, again.error
        assert eng.proc.poll() is None, (tmp_path / "v0-logs" / "vllm.log").read_text()[-3000:]
        # n2, back (as systemd would start it), ends the copy that is no longer its to run
        pair.go("n2", "post-restore")
        pair.started.remove(pair.controllers["n2"])
        pair.start_controller("n2", "shared")
        live = wait_until(lambda: len(got := pair.live_tree()) == 1 and got, timeout_s=60,
                          what="only the source's vLLM launcher running")
        assert live[0].pid == eng.info["pid"]
    finally:
        pair.close()


# ---------------------------------------------------------------- the launcher alone

@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_the_launcher_is_its_engines_init(tmp_path):
    """With the stand-in server (no vLLM): the sidecar reports the launcher's host PID; a
    SIGCONT to the launcher continues the whole stopped tree; SIGTERM ends all of it."""
    from ckpt_controller.agent import AgentClient
    from ckpt_controller.endpoints import free_port
    from ckpt_controller.procutil import ReadyProcess

    port, control = free_port(), free_port()
    eng = ReadyProcess(["unshare", "--pid", "--fork", "setsid", sys.executable, "-m",
                        "ckpt_controller", "agent", "vllm-launch", "--url",
                        f"http://0.0.0.0:{port}", "--control", f"tcp://127.0.0.1:{control}",
                        "--name", "st", "--log-dir", str(tmp_path / "logs"), "--",
                        sys.executable, str(STANDIN_SERVER),
                        "--host", "0.0.0.0", "--port", str(port)],
                       tmp_path / "st.log", "launcher st", cwd=ROOT)
    tree: list[psutil.Process] = []
    try:
        launcher = psutil.Process(eng.info["pid"])
        assert "vllm-launch" in launcher.cmdline()
        tree += [launcher, *launcher.children()]
        assert len(tree) == 3
        with AgentClient(eng.info["control"], timeout_s=10) as agent:
            st = agent.status()
        assert st.pid == launcher.pid and st.endpoints["http"] == f"http://0.0.0.0:{port}"
        for proc in tree:
            proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: all(p.status() == "stopped" for p in tree), what="all stopped")
        launcher.send_signal(signal.SIGCONT)
        wait_until(lambda: all(p.status() != "stopped" for p in tree), timeout_s=10,
                   what="the whole tree continued")
        launcher.send_signal(signal.SIGTERM)
        wait_until(lambda: not any(p.is_running() and p.status() != "zombie" for p in tree),
                   timeout_s=30, what="the tree ended")
        assert eng.proc.wait(scaled(10)) == 0
    finally:
        for proc in tree:  # a failure above must not leave a stopped tree behind
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    proc.send_signal(sig)
                except psutil.NoSuchProcess:
                    break
        eng.stop()


def test_a_stop_signal_while_the_launcher_starts_ends_what_it_started(tmp_path):
    """The launcher catches SIGTERM from its first moment: one that comes while it waits for
    vLLM to serve ends vLLM too, and the launcher says why; it does not die leaving its
    children behind. (Its handlers were set only once it served: a SIGCONT right after the
    ready line once continued the launcher alone.)"""
    from ckpt_controller.endpoints import free_port

    port, control = free_port(), free_port()  # nothing will ever serve on the port
    launcher = subprocess.Popen(
        [*CKPTCTL, "agent", "vllm-launch", "--url",
         f"http://127.0.0.1:{port}", "--control", f"tcp://127.0.0.1:{control}", "--name",
         "st", "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-c",
         "import time; time.sleep(600)"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    child: list[psutil.Process] = []
    try:
        proc = psutil.Process(launcher.pid)
        child += wait_until(lambda: proc.children(), what="vLLM started")
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=scaled(30))
        assert launcher.returncode > 0, (launcher.returncode, err)  # handled, not killed
        assert "SIGTERM before vLLM served" in err, err
        wait_until(lambda: not child[0].is_running() or child[0].status() == "zombie",
                   timeout_s=30, what="vLLM ended")
    finally:
        for proc in child:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
