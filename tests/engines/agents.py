"""Agents with no engine behind them, in a process of their own: the engines of a node whose
controller runs in another process (the fleet's network-namespace test starts this inside a
namespace, so that only that namespace's node controller can reach them).

    python agents.py NAME=ENDPOINT [NAME=ENDPOINT ...]

Starts an ``Agent(NAME, control=ENDPOINT)`` for each, prints one JSON ready line on stdout
once every control endpoint is bound, and runs until SIGTERM or SIGINT, then closes them.
Neighbours: ``ckpt_controller.agent`` (``Agent``), ``tests/fleet/test_fleet_netns.py`` (its user).
"""

from __future__ import annotations

import json
import os
import sys

from ckpt_controller.agent import Agent
from ckpt_controller.procutil import StopSignals


def main(argv: list[str]) -> int:
    pairs = [arg.split("=", 1) for arg in argv]
    if not pairs or any(len(pair) != 2 for pair in pairs):
        print(__doc__, file=sys.stderr)
        return 2
    stop = StopSignals()
    agents: list[Agent] = []
    try:
        for name, endpoint in pairs:
            agents.append(Agent(name, control=endpoint, heartbeat_interval_s=0.2).start())
        print(json.dumps({"event": "ready", "pid": os.getpid(),
                          "agents": {a.name: a.endpoint for a in agents}}), flush=True)
        stop.wait()
    finally:
        for agent in agents:
            agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
