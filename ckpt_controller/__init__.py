"""ckpt-controller: drives LLM inference engines through a checkpoint/restore lifecycle.

Layers, lowest first (a layer imports only the ones above it in this list):

    vocab       every state, trigger, mode, reason, level and status, once
    errors      the error tree
    lifecycle   the one transition table
    protocol    wire messages (msgspec) and framing (pyzmq-free codec)
    memory      torch tensors under tags: release, re-wake, verify (imports torch)
    agent       engine side: admission gate, drain, control endpoint (pyzmq)
    cli         ``ckptctl``
"""

__version__ = "0.1.0"

from ckpt_controller.vocab import CheckpointState

__all__ = ["CheckpointState", "__version__"]
