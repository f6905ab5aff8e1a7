"""Tiny random bf16 models written as real model directories, for fast tests of file-level code."""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(path: Path, dtype: str = "bfloat16", seed: int = 0, **overrides: object) -> Path:
    """A 2-layer Llama (GQA, head size 16) saved with safetensors and a tokenizer-free config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=False)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(getattr(torch, dtype))
    model.save_pretrained(str(path), safe_serialization=True)
    return path
