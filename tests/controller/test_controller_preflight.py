"""What the controller checks before an operation exists, and who goes first: an operator's
operation before the reconciler's probing, refusals that leave no journal operation, and a
group operation that looks at every engine before it takes any out of service, and how long
an engine slow to answer is waited for (``[deadlines] probe``). Real ``ckptctl serve``
processes and real engine processes, or agents in this process."""

from __future__ import annotations

import json
import threading
import time

from ckpt_controller.agent import AgentClient
from ckpt_controller.controller.journal import Journal
from ckpt_controller.controller.links import KNOWN_FRESH_S
from support.config import engines_toml
from support.processes import wait_state
from support.timing import scaled, wait_until


def _unsettled_and_dead(spawn_engine, ctl_of, name: str):
    """An engine killed in the middle of a prepare: the operation lost contact with it."""
    eng = spawn_engine(name, weights_mib=4, kv_mib=1, step_s=0.05)
    ctl = ctl_of(eng)
    eng.submit("long", 100_000)
    box = {}
    t = threading.Thread(target=lambda: box.update(out=ctl.ckptctl(
        "prepare", name, "--drain", "wait", "--json", "--op-id", "lost")))
    t.start()
    wait_state(eng.control, "preparing")
    eng.proc.kill()
    t.join(scaled(60))
    assert box["out"].returncode == 4, box["out"].stdout + box["out"].stderr
    return eng, ctl


def test_an_operators_restore_goes_before_the_reconcilers_probe(spawn_engine, spawn_controller):
    """The reconciler probes an unreachable unsettled engine all the time (every 0.05 s, each
    probe waiting for an answer that never comes); an operator's restore of it is still run
    (and fails as unreachable), never refused as busy."""
    eng, ctl = _unsettled_and_dead(spawn_engine, lambda e: spawn_controller(
        engines_toml(e), controller_keys="reconcile_interval_s = 0.05\n"), "un1")
    status = json.loads(ctl.ckptctl("status", "--json").stdout)
    assert status["engines"][0]["unsettled_by"] == "lost"
    out = ctl.ckptctl("restore", "un1", "--json")
    assert "BusyError" not in out.stdout, out.stdout
    assert out.returncode == 4, out.stdout + out.stderr
    assert json.loads(out.stdout)["error"]["kind"] == "UnreachableError"


def _agents(ipc_dir, names):
    from ckpt_controller.agent import Agent

    return [Agent(n, control=f"ipc://{ipc_dir}/{n}.ctl", heartbeat_interval_s=0.2).start()
            for n in names]


def _untouched(agents) -> None:
    """Each agent is RUNNING and never moved: no transition, generation 0."""
    for a in agents:
        with AgentClient(a.endpoint) as c:
            st = c.status()
        assert (st.state, st.generation, st.last_transition) == ("running", 0, None), st


def test_a_refused_request_leaves_no_operation_and_counts_as_refused(spawn_controller, ipc_dir):
    import re
    import urllib.request

    agents = _agents(ipc_dir, ["rf1"])
    try:
        ctl = spawn_controller(engines_toml(*agents), controller_keys="metrics_port = 0\n")
        for op in ("restore", "capture", "rollback"):
            out = ctl.ckptctl(op, "rf1", "--json", "--op-id", f"refused-{op}")
            assert out.returncode == 2, out.stdout + out.stderr
            err = json.loads(out.stdout)["error"]
            assert err["kind"] == "UsageError" and "rf1 is running" in err["message"], err
        hist = json.loads(ctl.ckptctl("history", "--json").stdout)
        assert hist["operations"] == [] and hist["records"] == []
        journal = Journal(ctl.state_dir / "journal.sqlite3")
        try:
            assert journal.operations() == [] and journal.check() == []
        finally:
            journal.close()
        url = f"http://127.0.0.1:{ctl.info['metrics_port']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert re.search(r'ckpt_operations_total\{kind="restore",outcome="refused"\} 1', text)
        # no failure counted (every kind and outcome is there, at 0 until one happens)
        assert re.search(r'ckpt_operations_total\{kind="restore",outcome="failed"\} 0', text)
        assert not re.search(r'outcome="failed"\} [1-9]', text)
        # the refused id was never an operation: it may be used now, and it runs
        out = ctl.ckptctl("prepare", "rf1", "--json", "--op-id", "refused-restore")
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        for a in agents:
            a.close()


def test_a_group_with_one_dead_engine_takes_none_out_of_service(spawn_controller, ipc_dir):
    """One engine of three does not answer: a group prepare and a rolling cycle are refused
    before any engine leaves RUNNING (the dead one listed last, after the healthy ones)."""
    agents = _agents(ipc_dir, ["gd1", "gd2"])
    try:
        ghost = f"ipc://{ipc_dir}/ghost.ctl"
        ctl = spawn_controller(engines_toml(*agents)
                               + engines_toml(("ghost", ghost)))
        for args in (("prepare", "--all"), ("cycle", "--all", "--max-unavailable", "1")):
            start = time.monotonic()
            out = ctl.ckptctl(*args, "--json")
            assert out.returncode == 4, out.stdout + out.stderr
            assert time.monotonic() - start < scaled(10)
            err = json.loads(out.stdout)["error"]
            assert err["kind"] == "UnreachableError" and "ghost" in err["message"], err
            _untouched(agents)
        # a healthy engine in the wrong state refuses the group too
        with AgentClient(agents[1].endpoint) as c:
            c.prepare(op_id="by-hand", level=0)

        def heard(engine: str, state: str) -> bool:
            doc = json.loads(ctl.ckptctl("status", engine, "--json").stdout)
            return doc["engines"][0]["status"]["state"] == state

        # the preflight goes by what the controller's link heard from gd2 in the last
        # second (one that changed within that second is found by the operation itself):
        # past that second, what the link heard before the prepare (a heartbeat saying
        # RUNNING, read after the prepare had answered) is too old to be used. Waiting only
        # for a fresh status to say PREPARED once let that heartbeat through (1 in ~6 runs)
        wait_until(lambda: heard("gd2", "prepared"), 20, "the controller told of the prepare")
        time.sleep(KNOWN_FRESH_S + 0.1)
        out = ctl.ckptctl("cycle", "gd1", "gd2", "--json")
        assert out.returncode == 2, out.stdout + out.stderr
        assert "gd2 is prepared" in json.loads(out.stdout)["error"]["message"]
        _untouched(agents[:1])
        assert json.loads(ctl.ckptctl("history", "--json").stdout)["operations"] == []
    finally:
        for a in agents:
            a.close()


class SlowToAnswer:
    """A stand-in engine's memory (``NoMemory`` otherwise) that makes each status answer take
    ``delay_s``: a busy engine on a loaded host, slow to say its status. It holds the agent's
    control thread, heartbeats included, as such a host would."""

    def __init__(self) -> None:
        from ckpt_controller.agent.engine import NoMemory

        self._none = NoMemory()
        self.delay_s = 0.0

    def registered_bytes(self) -> dict[str, int]:
        time.sleep(self.delay_s)
        return {}

    def __getattr__(self, name: str):
        return getattr(self._none, name)


def _prepare_slowly(ctl, memory: SlowToAnswer):
    """``ckptctl prepare`` (with its own retries) while every status answer takes 3 s."""
    memory.delay_s = 3.0
    try:
        return ctl.ckptctl("prepare", "sl1", "--json", "--level", "0")
    finally:
        memory.delay_s = 0.0


def test_the_preflight_probe_waits_as_long_as_the_config_says(spawn_controller, ipc_dir):
    """An engine slower than the 2 s default to answer its status is refused as unreachable,
    however often the CLI tries; with ``[deadlines] probe = 30`` the same engine is waited for
    and the prepare runs. ``missed_beats`` is high: the held heartbeats do not count it dead."""
    from ckpt_controller.agent import Agent

    memory = SlowToAnswer()
    agent = Agent("sl1", memory=memory, control=f"ipc://{ipc_dir}/sl1.ctl",
                  heartbeat_interval_s=0.2).start()
    try:
        keys = "missed_beats = 500\n"
        ctl = spawn_controller(engines_toml(agent), controller_keys=keys)
        out = _prepare_slowly(ctl, memory)
        assert out.returncode == 4, out.stdout + out.stderr
        err = json.loads(out.stdout)["error"]
        assert err["kind"] == "UnreachableError" and "sl1 did not answer" in err["message"]
        _untouched([agent])
        ctl.stop()
        ctl = spawn_controller(engines_toml(agent) + "[deadlines]\nprobe = 30\n",
                               controller_keys=keys)
        out = _prepare_slowly(ctl, memory)
        assert out.returncode == 0, out.stdout + out.stderr
        with AgentClient(agent.endpoint) as c:
            assert c.status().state == "prepared"
    finally:
        agent.close()


def test_a_restore_of_an_engine_known_absent_asks_no_status(tmp_path, monkeypatch):
    """A migration's adopt restores an engine whose process is not on this node (it comes
    from the image): its command says so (``absent``) and the preflight asks nothing. It once
    asked, and a refused connection took half a second to tell, inside the downtime."""
    from ckpt_controller import protocol as p
    from ckpt_controller.controller import preflight
    from ckpt_controller.controller.config import parse_config
    from ckpt_controller.errors import UnreachableError
    from support.config import controller_toml
    from support.hooks import write_hook

    write_hook(tmp_path / "hooks", "pre-restore", "10-revive", "exit 0")
    config = parse_config(controller_toml(
        tmp_path, ("a0", f"ipc://{tmp_path}/a0.ctl"), keys=f'hooks_dir = "{tmp_path}/hooks"\n'))
    asked: list[str] = []

    def probe(config, name, link=None):
        asked.append(name)
        raise UnreachableError("nobody there")
    monkeypatch.setattr(preflight, "probe", probe)

    def restore(absent: bool) -> p.OperationCommand:
        return p.OperationCommand(call_id=0, op_id="r1", kind="restore", engines=["a0"],
                                  absent=absent)

    assert preflight.ask(config, restore(True), ["a0"]) == {"a0": None}
    assert asked == []
    assert preflight.ask(config, restore(False), ["a0"]) == {"a0": None}  # asked: no answer
    assert asked == ["a0"]
