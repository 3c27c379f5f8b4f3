"""The vLLM sidecar (``ckptctl agent vllm``): see ``sidecar`` for how each lifecycle step
maps onto vLLM's HTTP API, and ``http`` for the client."""

from ckpt_controller.adapters.vllm.http import VllmHttp
from ckpt_controller.adapters.vllm.sidecar import VllmEngine

__all__ = ["VllmEngine", "VllmHttp"]
