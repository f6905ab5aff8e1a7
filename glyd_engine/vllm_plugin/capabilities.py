"""The refusals, derived from what a GLYD backend declares it supports (page_facts.py, which each backend class
takes its facts from): an engine's (`engine_refusals`, where vLLM makes its config, before any process starts) and one
attention layer's (`layer_refusal`, at the backend selector). Each rule reads one declared fact and says what to
change; no rule here knows a backend's answer.
"""

from __future__ import annotations

from typing import Any

from glyd_engine.vllm_plugin.page_facts import PageFacts


def _size(obj: Any, attr: str) -> int:
    return int(getattr(obj, attr, 1) or 1)


def _flag(obj: Any, name: str) -> bool:
    try:
        return bool(getattr(obj, name, False))
    except Exception:  # some model-config properties need registry lookups that may fail for odd models
        return False


def _has_sliding_window(hf: Any) -> bool:
    window = getattr(hf, "sliding_window", None)
    layer_types = list(getattr(hf, "layer_types", None) or [])
    return bool(window and getattr(hf, "use_sliding_window", True) is not False) or any(
        "sliding" in str(t) for t in layer_types)


def engine_refusals(backend: type[PageFacts], vllm_config: Any) -> list[str]:
    """Why `backend` cannot hold this engine's KV (empty: it can), each with what to change."""
    b = backend
    why: list[str] = []
    par = getattr(vllm_config, "parallel_config", None)
    if par is not None:
        for attr, name, ok in (("tensor_parallel_size", "tensor", b.supports_tensor_parallel()),
                               ("pipeline_parallel_size", "pipeline", b.supports_pipeline_parallel()),
                               ("prefill_context_parallel_size", "prefill context", b.supports_pcp()),
                               ("decode_context_parallel_size", "decode context", b.supports_dcp())):
            if not ok and _size(par, attr) > 1:
                why.append(f"{name} parallel size {getattr(par, attr)} > 1 (run on one device)")
        micro = getattr(par, "enable_dbo", False) or _size(par, "ubatch_size") > 1
        if micro and not b.supports_micro_batching():
            why.append("micro-batching is on (drop --enable-dbo / --ubatch-size)")
    if getattr(vllm_config, "speculative_config", None) is not None and not b.supports_speculative_decoding():
        why.append("speculative decoding is on (drop --speculative-config)")
    if getattr(vllm_config, "kv_transfer_config", None) is not None and not b.supports_kv_connector():
        why.append("a KV transfer/connector is configured (connectors copy raw pages and cannot see overflow)")
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None:
        dtype = str(getattr(cache, "cache_dtype", "auto"))
        if not b.supports_kv_cache_dtype(dtype):
            why.append(f"kv_cache_dtype is {dtype} (the page code holds bf16 values; use auto)")
        if getattr(cache, "kv_offloading_size", None) and not b.supports_kv_offloading():
            why.append("KV offloading is on (offload copies raw pages and cannot see overflow)")
        block = getattr(cache, "block_size", None)
        if isinstance(block, int) and not b.supports_block_size(block):
            why.append(f"block size {block} (the pages take {_block_sizes(b)}; set --block-size)")
    model = getattr(vllm_config, "model_config", None)
    if model is not None:
        why += _model_refusals(b, model)
    return why


def _block_sizes(b: type[PageFacts]) -> str:
    return ", ".join(f"multiples of {s.base}" if hasattr(s, "base") else str(s)
                     for s in b.get_supported_kernel_block_sizes())


def _model_refusals(b: type[PageFacts], model: Any) -> list[str]:
    why: list[str] = []
    dtype = getattr(model, "dtype", None)
    if dtype is not None and not b.supports_dtype(dtype):
        why.append(f"the model runs in {dtype} (the page code is for bf16; use --dtype bfloat16)")
    if _flag(model, "use_mla") and not b.is_mla():
        why.append("the model uses MLA attention")
    if (_flag(model, "is_hybrid") or _flag(model, "is_attention_free")) and not b.supports_recurrent_state():
        why.append("the model is hybrid or attention-free (mamba/linear-attention state)")
    hf = getattr(model, "hf_text_config", None)
    if _has_sliding_window(hf) and not b.supports_sliding_window():
        why.append("the model has sliding-window attention layers")
    if getattr(hf, "num_kv_shared_layers", None) and not b.supports_kv_sharing():
        why.append("the model's layers share KV (num_kv_shared_layers)")
    if getattr(hf, "attention_chunk_size", None) and not b.supports_chunked_local_attention():
        why.append("the model has chunked local attention layers")
    try:
        head_size = int(model.get_head_size())
    except Exception:  # attention-free models have none (refused above); odd configs are left to the layers
        head_size = None
    if head_size is not None and not b.supports_head_size(head_size):
        why.append(f"head size {head_size} (the page code holds {_head_sizes(b)})")
    return why


def _head_sizes(b: type[PageFacts]) -> str:
    return " and ".join(map(str, b.get_supported_head_sizes()))


def layer_refusal(backend: type[PageFacts], sel: Any) -> str | None:
    """Why one attention layer (vLLM's AttentionSelectorConfig) cannot use `backend`; None if it can."""
    b = backend
    if (getattr(sel, "use_mla", False) and not b.is_mla()) or (getattr(sel, "use_sparse", False)
                                                               and not b.is_sparse()):
        return "MLA/sparse attention layers"
    if getattr(sel, "has_sink", False) and not b.supports_sink():
        return "attention sinks"
    if (getattr(sel, "has_sliding_window", False) and not b.supports_sliding_window()) or (
            getattr(sel, "use_rswa", False) and not b.supports_rswa()):
        return "sliding-window attention layers"
    if (getattr(sel, "use_non_causal", False) and not b.supports_non_causal()) or (
            getattr(sel, "use_mm_prefix", False) and not b.supports_mm_prefix()):
        return "non-causal attention"
    if getattr(sel, "use_kv_connector", False) and not b.supports_kv_connector():
        return "a KV connector"
    if (getattr(sel, "use_pcp", False) and not b.supports_pcp()) or (getattr(sel, "use_dcp", False)
                                                                     and not b.supports_dcp()):
        return "context parallelism"
    if not b.supports_dtype(sel.dtype):
        return f"{sel.dtype} activations (the page code holds bf16)"
    if not b.supports_kv_cache_dtype(sel.kv_cache_dtype):
        return f"kv_cache_dtype {sel.kv_cache_dtype}"
    if not b.supports_head_size(sel.head_size):
        return f"head size {sel.head_size} (the page code holds {_head_sizes(b)})"
    if not b.supports_block_size(getattr(sel, "block_size", None)):
        return f"block size {sel.block_size} (the pages take {_block_sizes(b)})"
    return None


def impl_refusal(backend: type[PageFacts], num_heads: int, num_kv_heads: int | None, attn_type: str,
                 **features: Any) -> str | None:
    """Why an attention layer's impl arguments (alibi_slopes, sliding_window, logits_soft_cap, sinks,
    kv_sharing_target_layer_name) are beyond `backend`: the last check, where the layer is built; None if it can run
    them."""
    b = backend
    supported = {"alibi_slopes": b.supports_alibi(), "sliding_window": b.supports_sliding_window(),
                 "logits_soft_cap": b.supports_logits_soft_cap(), "sinks": b.supports_sink(),
                 "kv_sharing_target_layer_name": b.supports_kv_sharing()}
    names = {"kv_sharing_target_layer_name": "KV shared with another layer"}
    beyond = [names.get(name, name.replace("_", " ")) for name, value in features.items()
              if value and not supported.get(name, False)]
    if not b.supports_attn_type(attn_type):
        beyond.append(f"{attn_type} attention")
    if beyond:
        return ", ".join(beyond)
    ratio = num_heads // (num_kv_heads or num_heads)
    heads = b.query_heads_per_kv_head
    if heads is not None and ratio not in heads:
        return f"{ratio} query heads a KV head (it takes {heads.start}-{heads.stop - 1})"
    return None
