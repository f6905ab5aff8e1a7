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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_tiny_engine_llama(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides: object) -> Path:
    """A 4-layer Llama the real vLLM engine serves at tensor and pipeline parallel size 2: 4 query and 2 KV heads of
    size 64 (heads and layers divide by 2; the demo model's 3 KV heads do not), the demo model's tokenizer (49,152
    tokens), tied embeddings as the demo's. Random bf16 weights: the engine tests compare bits, not answers."""
    import shutil

    cfg: dict[str, object] = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=2)
    cfg.update(overrides)
    make_tiny_llama(path, seed=seed, **cfg)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path
