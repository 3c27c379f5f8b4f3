"""ckpt-controller: drives LLM inference engines through a checkpoint/restore lifecycle.

Layers, lowest first (a layer imports only the ones above it in this list):

    vocab       every state, trigger, mode, reason, level and status (imports nothing)
    errors      the error tree
    lifecycle   the one transition table
    protocol    wire messages (msgspec) and framing (pyzmq-free codec)
    memory      torch tensors under tags: release, re-wake, verify (imports torch)
    agent       engine side: admission gate, drain, control endpoint (pyzmq)
    cli         ``ckptctl``

Importing the package imports nothing else: ``ckptctl --help`` and a client stay light, and
the names below load on first use. Neighbours: ``vocab`` (``CheckpointState``),
``controller.client`` (``ControllerClient``, docs/client.md), ``cli``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["CheckpointState", "ControllerClient", "__version__"]


def __getattr__(name: str):
    # PEP 562: ``ckpt_controller.CheckpointState`` loads the vocabulary only when someone
    # asks for it
    if name == "CheckpointState":
        from ckpt_controller.vocab import CheckpointState

        return CheckpointState
    if name == "ControllerClient":  # the transport (pyzmq) loads only for a client
        from ckpt_controller.controller.client import ControllerClient

        return ControllerClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
