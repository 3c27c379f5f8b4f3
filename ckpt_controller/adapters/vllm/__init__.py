"""The vLLM sidecar (``ckptctl agent vllm``): see ``sidecar`` for how each lifecycle step
maps onto vLLM's HTTP API, ``http`` for the client, ``process`` for what the sidecar reads
of vLLM's process (its PID, its fingerprint, its memory), ``state`` for what it keeps on
disk, ``launcher`` for vLLM and its sidecar started as one tree, ``follow`` for a client
that follows a migrated vLLM."""

from ckpt_controller.adapters.vllm.http import VllmHttp
from ckpt_controller.adapters.vllm.sidecar import VllmEngine

__all__ = ["VllmEngine", "VllmHttp"]
