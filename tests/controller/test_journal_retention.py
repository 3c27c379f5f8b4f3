"""``[journal]`` retention on a running controller: ``ckptctl journal compact`` forgets the
ended operations past ``keep_operations`` with their records at once, the controller does the
same when it starts, and what it still reads (the engine's newest operation) stays."""

from __future__ import annotations

import json

from ckpt_controller.agent import Agent
from support.config import engines_toml
from support.timing import scaled, wait_until


def _ops(ctl) -> list[str]:
    out = ctl.ckptctl("history", "--limit", "1000", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return [o["op_id"] for o in json.loads(out.stdout)["operations"]]


def test_journal_compact_forgets_what_keep_operations_keeps_no_longer(ipc_dir,
                                                                      spawn_controller):
    agent = Agent("jr", control=f"ipc://{ipc_dir}/jr.ctl", heartbeat_interval_s=0.2).start()
    try:
        config = engines_toml(agent) + "[journal]\nkeep_operations = 2\n"
        ctl = spawn_controller(config)
        for i in range(5):
            assert ctl.ckptctl("cycle", "jr", "--op-id", f"c{i}").returncode == 0
        assert _ops(ctl) == ["c4", "c3", "c2", "c1", "c0"]  # compacted at start only
        out = ctl.ckptctl("journal", "compact", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        doc = json.loads(out.stdout)
        assert doc["kind"] == "journal-compact" and doc["operations"] == 3
        assert doc["records"] > 3 and doc["keep_operations"] == 2
        assert _ops(ctl) == ["c4", "c3"]
        human = ctl.ckptctl("journal", "compact")
        assert "forgot 0 operations and 0 records" in human.stdout
        for i in range(5, 8):
            assert ctl.ckptctl("cycle", "jr", "--op-id", f"c{i}").returncode == 0
        ctl.stop()
        again = spawn_controller(config)  # the same state dir: compacted as it starts
        wait_until(lambda: _ops(again) == ["c7", "c6"], scaled(30), "the start's compaction")
        status = json.loads(again.ckptctl("status", "--json").stdout)
        assert status["engines"][0]["last_op"]["op_id"] == "c7"
    finally:
        agent.close()
