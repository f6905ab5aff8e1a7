"""Run a model with transformers (on the CPU, or a GPU) and hand each layer's post-RoPE K and V to a callback.

The capture is an attention function registered with transformers' AttentionInterface: it sees K/V
exactly as the model attends over them (after RoPE, before GQA repetition), then runs SDPA. Position
offsets let a short run sit anywhere in the window, so a table build covers every position of a long
window without paying for long sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from glyd_engine.errors import CorruptFileError

KVCallback = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, key [H,T,D], value [H,T,D])

_NAME = "glyd_capture"
_active: list[KVCallback] = []


def _capture_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _active:
        layer = int(getattr(module, "layer_idx", 0))
        k, v = key.to(torch.bfloat16), value.to(torch.bfloat16)
        for b in range(k.shape[0]):
            _active[-1](layer, k[b], v[b])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def load_model(model_dir: Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> Any:
    """The model on `device`, attending through the capture function.

    K/V reach callbacks as bf16 whatever `dtype` is. On a CPU the table build runs in float32, several times
    faster than bf16 on CPUs without bf16 matrix units; its exponent statistics match bf16's but for
    values at rounding edges, and only the compression ratio, never exactness, depends on them.
    """
    from transformers import AttentionInterface, AutoModelForCausalLM

    from glyd_engine.format.checkpoint import decoded_tensors, is_glyd_checkpoint

    AttentionInterface.register(_NAME, _capture_attention)
    if is_glyd_checkpoint(model_dir):  # transformers cannot read the packed parts: decode them
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_dir))
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=_NAME)
        state = {name: t.to(dtype) for name, t in decoded_tensors(model_dir)}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise CorruptFileError(f"{model_dir}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.tie_weights()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=_NAME)
    model.eval()
    return model.to(device)


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@contextlib.contextmanager
def capturing(callback: KVCallback) -> Iterator[None]:
    _active.append(callback)
    try:
        yield
    finally:
        _active.pop()


@torch.inference_mode()
def run(model: Any, ids: torch.Tensor, position_offset: int = 0) -> None:
    """One forward pass over token ids [T] at positions offset..offset+T-1 (K/V go to the callback)."""
    device = next(model.parameters()).device
    positions = torch.arange(position_offset, position_offset + ids.numel(), device=device).unsqueeze(0)
    model(input_ids=ids.to(device).unsqueeze(0), position_ids=positions, use_cache=False)
