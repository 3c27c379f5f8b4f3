"""The controller killed (SIGKILL) at random moments of a cycle, 50 times, under load: each
restart reconciles the engine back to RUNNING, the journal checks clean with no operation
left running, and in the end every request has ended and no output differs. Slow (about
three minutes): run with ``-m slow``."""

from __future__ import annotations

import collections
import random
import threading
import time

import pytest

from ckpt_controller.agent import AgentClient
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.controller.journal import Journal
from ckpt_controller.engine.load import replay, run_load
from ckpt_controller.errors import CkptError
from support.config import engines_toml
from support.hooks import write_hook
from support.timing import scaled

KILLS = 50


@pytest.mark.slow
def test_fifty_random_controller_kills_reconcile_every_time(spawn_reference, spawn_controller):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    eng = spawn_reference("crash")
    ctl = spawn_controller(engines_toml(eng, defaults='drain = "keep"\nlevel = 2'))
    # hooks inside each phase make a cycle last about a second, so kills land everywhere
    for point in ("post-drain", "post-release", "dump", "post-restore"):
        write_hook(ctl, point, "10-slow", "sleep 0.15")
    box: dict = {}
    load = threading.Thread(target=lambda: box.update(out=run_load(
        eng.api, rate=4, duration_s=KILLS * 3.0, seed=11, settle_s=120)))
    load.start()
    seen: collections.Counter[str] = collections.Counter()
    recovered = 0
    watcher = AgentClient(eng.control, timeout_s=5)
    try:
        for i in range(KILLS):
            op_id = f"crash-{i}"
            t = threading.Thread(target=_cycle, args=(ctl.endpoint, op_id), daemon=True)
            t.start()
            time.sleep(rng.uniform(0.0, 1.0))
            seen[watcher.status().state] += 1
            ctl.kill9()
            t.join(scaled(30))
            ctl.start()
            recovered += ctl.info["recovered"]
            state = watcher.status()
            assert state.state == "running" and state.current_op is None, (i, state)
            journal = Journal(ctl.dir / "state" / "journal.sqlite3")
            try:
                assert journal.check() == [], i
                assert journal.unfinished() == [], i
                result = journal.result(op_id)
                assert result is None or result.status in ("succeeded", "interrupted"), \
                    (i, result)
            finally:
                journal.close()
    finally:
        watcher.close()
        load.join(KILLS * 3.0 + 180)
    print(f"engine state at the kills: {dict(seen)}; {recovered} operations recovered")
    assert recovered >= KILLS // 2
    assert len(seen) >= 3  # the kills landed in several phases of the cycle
    report, requests = box["out"]
    assert report.lost == 0 and report.sent > 0
    completed = {rid: c.token_ids for rid, c in requests.items()
                 if c.finish_reason in ("stop", "length")}
    again = replay(eng.api, 11, list(completed))
    assert all(again[rid] == tokens for rid, tokens in completed.items())


def _cycle(endpoint: str, op_id: str) -> None:
    try:
        with ControllerClient(endpoint, timeout_s=5, retries=0) as c:
            c.subscribe()
            c.cycle(["crash"], op_id=op_id)
    except CkptError:  # the controller was killed under the call: expected
        pass
