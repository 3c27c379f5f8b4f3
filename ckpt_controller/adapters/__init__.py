"""Adapters: agents for engines we do not own, driven through the engine's own API.

Each adapter supplies the engine side of an ``Agent`` (``EngineHooks``, a ``MemoryManager``
and, when the engine's requests do not pass through our admission gate, an
``ExternalDrain``); the agent itself, its lifecycle and its protocol are the same as for an
embedded engine. ``vllm``: a sidecar for a vLLM server, over its HTTP dev-mode API.
"""
