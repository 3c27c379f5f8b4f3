"""The reference engine's language model: a small decoder-only transformer in torch.

Token and position embeddings, pre-norm blocks (RMSNorm, multi-head causal attention, a GELU
MLP), a final norm and an LM head; greedy decoding. Random weights from a fixed seed, kept in
a safetensors file whose ``__metadata__`` holds the ``ModelConfig``. Attention reads and writes
a block-pool KV cache (``kv.BlockPool``): ``prefill`` fills a sequence's blocks in one pass,
``decode`` advances a whole batch by one token. The golden prompt that checks an engine after
re-wake runs twice, each time on the prompt and its greedy continuation taken at start (teacher
forcing: one pass checks every token): ``forced_tokens`` computes without a cache (the
weights), ``paged_forced`` goes through blocks of the pool, prefill then decode (the path
requests take). ``reference_tokens`` (greedy, a pass per token) makes the continuation.

Tiny and small models compute in float64 so that a request recomputed after a ``keep`` drain
(one prefill over prompt + generated tokens) picks exactly the tokens an uninterrupted decode
picks: float32 rounding differs between the two paths and could flip a near-tie.
Neighbours: ``kv`` (the pool), ``scheduler`` (who calls prefill/decode), ``server``;
``memory`` below (the weights file is written with ``save_file`` and read with
``SafetensorsFile``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ckpt_controller.errors import ConfigError
from ckpt_controller.memory import SafetensorsFile, save_file

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    dtype: str = "float64"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def parameter_count(self) -> int:
        d, v = self.d_model, self.vocab_size
        per_layer = 2 * d + 3 * d * d + d * d + 2 * d * self.d_ff
        return v * d + self.max_seq_len * d + self.n_layers * per_layer + d + v * d

    def weight_bytes(self) -> int:
        return self.parameter_count() * self.torch_dtype.itemsize

    def check(self) -> "ModelConfig":
        if self.dtype not in DTYPES:
            raise ConfigError("unknown dtype", dtype=self.dtype, allowed=list(DTYPES))
        if min(self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.d_ff,
               self.max_seq_len) < 1 or self.d_model % self.n_heads:
            raise ConfigError("model sizes must be positive and d_model divisible by n_heads",
                              config=asdict(self))
        return self


PRESETS = {
    "tiny": ModelConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, d_ff=512,
                        max_seq_len=1024),
    "small": ModelConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, d_ff=2048,
                         max_seq_len=2048),
}

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)(MiB|GiB)$")


def config_for(model: str, dtype: str | None = None) -> ModelConfig:
    """``tiny``, ``small`` or a weight size such as ``512MiB`` / ``4GiB`` (float32 unless
    ``dtype`` says otherwise: large models are for benchmarks, not token comparisons)."""
    if model in PRESETS:
        cfg = PRESETS[model]
        return ModelConfig(**{**asdict(cfg), "dtype": dtype or cfg.dtype}).check()
    m = _SIZE.match(model)
    if not m:
        raise ConfigError("model must be tiny, small, a size like 2GiB, or a .safetensors path",
                          model=model)
    target = float(m.group(1)) * (1 << (20 if m.group(2) == "MiB" else 30))
    dt = dtype or "float32"
    d, vocab, seq = 1024, 16384, 2048
    base = ModelConfig(vocab, d, 1, 16, 4 * d, seq, dt)
    per_layer = (base.parameter_count() - ModelConfig(vocab, d, 0, 16, 4 * d, seq, dt)
                 .parameter_count()) * DTYPES[dt].itemsize
    fixed = base.weight_bytes() - per_layer
    layers = round((target - fixed) / per_layer)
    if layers < 1:
        smallest = ModelConfig(vocab, d, 1, 16, 4 * d, seq, dt).weight_bytes()
        raise ConfigError(f"the smallest sized model is about {smallest >> 20} MiB of {dt} "
                          f"weights; use tiny or small below that", model=model)
    return ModelConfig(vocab, d, layers, 16, 4 * d, seq, dt).check()


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, dt = cfg.d_model, cfg.torch_dtype
        self.norm1 = torch.nn.Parameter(torch.ones(d, dtype=dt), requires_grad=False)
        self.wqkv = torch.nn.Parameter(torch.empty(3 * d, d, dtype=dt), requires_grad=False)
        self.wo = torch.nn.Parameter(torch.empty(d, d, dtype=dt), requires_grad=False)
        self.norm2 = torch.nn.Parameter(torch.ones(d, dtype=dt), requires_grad=False)
        self.w1 = torch.nn.Parameter(torch.empty(cfg.d_ff, d, dtype=dt), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.empty(d, cfg.d_ff, dtype=dt), requires_grad=False)


class TinyLM(torch.nn.Module):
    """The model; its parameters are what the agent registers as ``weights``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg.check()
        d, dt = cfg.d_model, cfg.torch_dtype
        self.tok_emb = torch.nn.Parameter(torch.empty(cfg.vocab_size, d, dtype=dt),
                                          requires_grad=False)
        self.pos_emb = torch.nn.Parameter(torch.empty(cfg.max_seq_len, d, dtype=dt),
                                          requires_grad=False)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = torch.nn.Parameter(torch.ones(d, dtype=dt), requires_grad=False)
        self.lm_head = torch.nn.Parameter(torch.empty(cfg.vocab_size, d, dtype=dt),
                                          requires_grad=False)

    def randomize(self, seed: int) -> None:
        """Fixed-seed weights; scaled so greedy decoding gives varied tokens."""
        g = torch.Generator().manual_seed(seed)
        for name, prm in self.named_parameters():
            if "norm" in name:
                continue
            fan_in = prm.shape[-1]
            std = 1.0 if name.endswith("emb") else (3.0 if name == "lm_head" else 1.0) / math.sqrt(fan_in)
            prm.copy_(torch.randn(prm.shape, generator=g, dtype=torch.float32).to(prm.dtype) * std)

    # ---------------------------------------------------------------- pieces

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.cfg.n_heads, self.cfg.head_dim)

    def _mlp(self, blk: Block, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self._rms(x, blk.norm2) @ blk.w1.T) @ blk.w2.T

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms(x, self.norm) @ self.lm_head.T

    # ---------------------------------------------------------------- with the KV pool

    @torch.inference_mode()
    def prefill(self, tokens: list[int], kv: torch.Tensor, blocks: list[int]) -> int:
        """Run ``tokens`` through the model, write their K/V into ``blocks`` of ``kv``
        (layers, 2, n_blocks, block_size, heads, head_dim); return the next (greedy) token."""
        n = len(tokens)
        bs = kv.shape[3]
        x = self.tok_emb[torch.tensor(tokens)] + self.pos_emb[:n]
        for i, blk in enumerate(self.blocks):
            q, k, v = (self._rms(x, blk.norm1) @ blk.wqkv.T).split(self.cfg.d_model, dim=-1)
            q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
            for j, b in enumerate(blocks):
                lo, hi = j * bs, min(n, (j + 1) * bs)
                if lo >= n:
                    break
                kv[i, 0, b, : hi - lo] = k[lo:hi]
                kv[i, 1, b, : hi - lo] = v[lo:hi]
            att = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = x + att.transpose(0, 1).reshape(n, -1) @ blk.wo.T
            x = x + self._mlp(blk, x)
        return int(self._logits(x[-1]).argmax())

    @torch.inference_mode()
    def decode(self, batch: list[tuple[int, int, list[int]]], kv: torch.Tensor) -> list[int]:
        """One step for a batch of sequences: each ``(last_token, position, blocks)`` writes
        its K/V at ``position`` and attends over positions ``0..position``. Linear layers run
        on the whole batch at once; returns each sequence's next token."""
        bs = kv.shape[3]
        toks = torch.tensor([t for t, _, _ in batch])
        pos = torch.tensor([p for _, p, _ in batch])
        x = self.tok_emb[toks] + self.pos_emb[pos]
        for i, blk in enumerate(self.blocks):
            q, k, v = (self._rms(x, blk.norm1) @ blk.wqkv.T).split(self.cfg.d_model, dim=-1)
            q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
            outs = []
            for r, (_, p, blocks) in enumerate(batch):
                b, o = blocks[p // bs], p % bs
                kv[i, 0, b, o] = k[r]
                kv[i, 1, b, o] = v[r]
                used = blocks[: p // bs + 1]
                keys = kv[i, 0, used].reshape(-1, *k.shape[1:])[: p + 1]
                vals = kv[i, 1, used].reshape(-1, *v.shape[1:])[: p + 1]
                att = F.scaled_dot_product_attention(
                    q[r].unsqueeze(1), keys.transpose(0, 1), vals.transpose(0, 1))
                outs.append(att.reshape(-1))
            x = x + torch.stack(outs) @ blk.wo.T
            x = x + self._mlp(blk, x)
        return self._logits(x).argmax(-1).tolist()

    @torch.inference_mode()
    def paged_tokens(self, prompt: list[int], n: int, kv: torch.Tensor,
                     blocks: list[int]) -> list[int]:
        """``n`` greedy tokens through the paged KV cache, as the scheduler makes them: one
        prefill, then one decode per token. ``blocks`` must hold ``len(prompt) + n - 1``
        positions; what they held is overwritten."""
        out = [self.prefill(prompt, kv, blocks)]
        for pos in range(len(prompt), len(prompt) + n - 1):
            out.append(self.decode([(out[-1], pos, blocks)], kv)[0])
        return out

    # ---------------------------------------------------------------- without a cache

    @torch.inference_mode()
    def reference_tokens(self, prompt: list[int], n: int) -> list[int]:
        """Greedy tokens computed from scratch each step (no KV cache): the golden path."""
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self._logits(self._cache_free(seq)[-1]).argmax()))
        return seq[len(prompt):]

    @torch.inference_mode()
    def forced_tokens(self, tokens: list[int], n: int) -> list[int]:
        """The greedy next token after each of the last ``n`` prefixes of ``tokens``, from one
        cache-free pass over all of them (teacher forcing). For a prompt followed by its own
        first ``n - 1`` greedy tokens these are the ``n`` tokens ``reference_tokens`` picks one
        pass at a time, computed at the cost of one pass; a change in the weights shows at the
        same position."""
        return self._logits(self._cache_free(tokens)[-n:]).argmax(-1).tolist()

    @torch.inference_mode()
    def paged_forced(self, tokens: list[int], kv: torch.Tensor, blocks: list[int]) -> list[int]:
        """Through the paged KV cache at the cost of two passes: a prefill of all of ``tokens``
        but the last (its K/V written into ``blocks``) gives its next token; one decode of the
        last token, at its position, attends over every position read back from the blocks
        and gives the one after it. ``blocks`` must hold ``len(tokens)`` positions."""
        first = self.prefill(tokens[:-1], kv, blocks)
        return [first, self.decode([(tokens[-1], len(tokens) - 1, blocks)], kv)[0]]

    def _cache_free(self, seq: list[int]) -> torch.Tensor:
        """The last layer's output at every position of ``seq``, computed from scratch."""
        x = self.tok_emb[torch.tensor(seq)] + self.pos_emb[: len(seq)]
        for blk in self.blocks:
            q, k, v = (self._rms(x, blk.norm1) @ blk.wqkv.T).split(self.cfg.d_model, -1)
            q, k, v = (self._split_heads(t).transpose(0, 1) for t in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + att.transpose(0, 1).reshape(len(seq), -1) @ blk.wo.T
            x = x + self._mlp(blk, x)
        return x


# -------------------------------------------------------------------- weights on disk


def save_model(model: TinyLM, path: Path, seed: int) -> None:
    meta = {"ckpt_config": json.dumps(asdict(model.cfg)), "ckpt_seed": str(seed)}
    save_file(dict(model.named_parameters()), path, metadata=meta)


def load_model(path: Path) -> TinyLM:
    """Build a model from a safetensors file written by ``save_model``."""
    try:
        with SafetensorsFile(path) as f:
            cfg = ModelConfig(**json.loads(f.metadata["ckpt_config"])).check()
            model = TinyLM(cfg)
            for name, prm in model.named_parameters():
                f.read_into(name, prm.data)
    except (KeyError, TypeError, ValueError) as exc:  # policy: a foreign file is a config error
        raise ConfigError("not a reference-engine weights file", path=str(path),
                          error=repr(exc)) from None
    return model


def materialize(model: str, seed: int, model_dir: Path, dtype: str | None = None) -> Path:
    """The weights file for ``model`` (a preset, a size, or a path), created once per seed."""
    if model.endswith(".safetensors") or "/" in model:
        path = Path(model)
        if not path.is_file():
            raise ConfigError("model file not found", model=model)
        return path
    cfg = config_for(model, dtype)
    path = model_dir / f"{model}-{cfg.dtype}-seed{seed}.safetensors"
    if not path.exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        lm = TinyLM(cfg)
        lm.randomize(seed)
        save_model(lm, path, seed)
    return path
