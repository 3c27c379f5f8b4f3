"""The vLLM sidecar (``ckptctl agent vllm``): ``run`` starts it and chooses the API;
``native`` maps each lifecycle step onto vLLM's ``/checkpoint`` API (vLLM 0.34+), ``sidecar``
onto its dev-mode API; ``http`` is the client, ``process`` what the sidecar reads
of vLLM's process (its PID, its fingerprint, its memory), ``state`` for what it keeps on
disk, ``launcher`` for vLLM and its sidecar started as one tree, ``follow`` for a client
that follows a migrated vLLM."""

from ckpt_controller.adapters.vllm.http import VllmHttp
from ckpt_controller.adapters.vllm.sidecar import VllmEngine

__all__ = ["VllmEngine", "VllmHttp"]
