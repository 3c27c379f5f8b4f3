"""Engine side: the agent an engine embeds (``Agent``), its admission gate, the hooks it
calls into the engine, and a client for its control endpoint."""

from ckpt_controller.agent.client import AgentClient
from ckpt_controller.agent.engine import EngineHooks, MemoryManager, NoMemory
from ckpt_controller.agent.gate import AdmissionGate
from ckpt_controller.agent.server import Agent

__all__ = ["Agent", "AgentClient", "AdmissionGate", "EngineHooks", "MemoryManager", "NoMemory"]
