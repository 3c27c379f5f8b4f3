"""Engine side: the agent an engine embeds (``Agent``), its admission gate, the hooks it
calls into the engine, and a client for its control endpoint.

The names load on first use (PEP 562), so ``from ckpt_controller.agent import AgentClient``
(the controller's and the CLI's way in) pulls in the transport only, never the engine side
(``Agent``, its operations and failpoints, torch). Neighbours: ``agent.client`` (the light
half), ``agent.server`` (the engine half), ``engine`` and ``adapters`` (which embed it).
"""

from __future__ import annotations

import importlib

__all__ = ["Agent", "AgentClient", "AdmissionGate", "EngineHooks", "MemoryManager", "NoMemory"]

#: name -> the module that defines it
_HOMES = {
    "Agent": "ckpt_controller.agent.server",
    "AgentClient": "ckpt_controller.agent.client",
    "AdmissionGate": "ckpt_controller.agent.gate",
    "EngineHooks": "ckpt_controller.agent.engine",
    "MemoryManager": "ckpt_controller.agent.engine",
    "NoMemory": "ckpt_controller.agent.engine",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
