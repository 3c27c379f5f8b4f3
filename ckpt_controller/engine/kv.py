"""The KV cache as a pool of fixed-size blocks, as in vLLM's paged attention.

One tensor ``(layers, 2, n_blocks, block_size, heads, head_dim)`` holds every sequence's keys
and values; a sequence owns a list of block ids (its block table). The tensor is what the
engine registers as ``kv_cache`` with the registry its agent drives: released (discarded) while
PREPARED, zero-filled on re-wake, after which sequences recompute their blocks. Neighbours:
``model`` reads and writes blocks (and gives the pool its shape, ``ModelConfig``),
``scheduler`` allocates and frees them, ``server`` registers the tensor.
"""

from __future__ import annotations

import torch

from ckpt_controller.engine.model import ModelConfig
from ckpt_controller.errors import ConfigError


class BlockPool:
    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int = 16) -> None:
        if n_blocks * block_size < cfg.max_seq_len:
            raise ConfigError("the KV pool must hold at least one full-length sequence",
                              tokens=n_blocks * block_size, max_seq_len=cfg.max_seq_len)
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.kv = torch.zeros(cfg.n_layers, 2, n_blocks, block_size, cfg.n_heads, cfg.head_dim,
                              dtype=cfg.torch_dtype)
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` block ids, or ``None`` (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()
