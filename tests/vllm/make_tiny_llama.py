"""Make a tiny Llama for the vLLM tests, offline: random weights and a byte-level BPE tokenizer
trained here (no hub is reachable). Run with the vLLM venv's python: make_tiny_llama.py DIR.

Sizes fit vLLM's CPU attention (head size 32): hidden 64, 2 layers, 2 heads, vocab 512.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "the engine drains its requests, releases its memory and waits for the snapshot.",
    "checkpoint and restore bring the engine back exactly as it was before.",
    "weights are verified bit for bit, the kv cache is rebuilt, scheduling resumes.",
] * 200


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
