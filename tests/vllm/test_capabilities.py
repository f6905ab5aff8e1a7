"""Capabilities declared once (issue 31, item 3): each backend declares what it supports, and the engine's and each
layer's refusals follow those facts: a backend that declared a feature would not be refused it, and every fact
the refusals read is answered by both backends. No engine runs here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.selector import AttentionSelectorConfig

from glyd_engine.vllm_plugin import capabilities, hooks, page_facts, settings
from glyd_engine.vllm_plugin.backend import GlydAttentionBackend
from glyd_engine.vllm_plugin.gpu_backend import GlydGPUAttentionBackend
from tests.vllm.test_plugin_units import _config

BACKENDS = [GlydAttentionBackend, GlydGPUAttentionBackend]


def test_each_backend_takes_its_facts_from_page_facts() -> None:
    """The refusals before any backend module is imported (page_facts) and vLLM's questions to the backend class get
    the same answers: every fact the backends answer is inherited from their facts class, not declared again."""
    for backend, facts in ((GlydAttentionBackend, page_facts.TorchPageFacts),
                           (GlydGPUAttentionBackend, page_facts.CudaPageFacts)):
        assert backend.__mro__[1] is facts
        for name in vars(page_facts.PageFacts):
            if name.startswith(("supports_", "get_supported_", "is_")) or name == "query_heads_per_kv_head":
                declared_by = next(c for c in backend.__mro__ if name in vars(c))
                assert declared_by in facts.__mro__, (backend.__name__, name, declared_by)
    assert page_facts.facts_for("torch") is page_facts.TorchPageFacts
    assert page_facts.facts_for("cuda") is page_facts.CudaPageFacts
LAYER = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None)


def _declaring(backend: type, fact: str, answer: Any) -> type:
    """`backend` with one fact answered otherwise."""
    value = answer if fact in ("supported_dtypes", "supported_kv_cache_dtypes", "query_heads_per_kv_head") \
        else classmethod(lambda cls, *a: answer)
    return type(f"{backend.__name__}_{fact}", (backend,), {fact: value})


# (the fact, what the engine has that needs it, the refusal's words)
ENGINE = [
    ("supports_tensor_parallel", lambda c: setattr(c.parallel_config, "tensor_parallel_size", 2), "tensor parallel"),
    ("supports_pipeline_parallel", lambda c: setattr(c.parallel_config, "pipeline_parallel_size", 2), "pipeline"),
    ("supports_pcp", lambda c: setattr(c.parallel_config, "prefill_context_parallel_size", 2), "prefill context"),
    ("supports_dcp", lambda c: setattr(c.parallel_config, "decode_context_parallel_size", 2), "decode context"),
    ("supports_micro_batching", lambda c: setattr(c.parallel_config, "enable_dbo", True), "micro-batching"),
    ("supports_speculative_decoding", lambda c: setattr(c, "speculative_config", object()), "speculative"),
    ("supports_kv_connector", lambda c: setattr(c, "kv_transfer_config", object()), "KV transfer"),
    ("supports_kv_offloading", lambda c: setattr(c.cache_config, "kv_offloading_size", 4.0), "offloading"),
    ("supports_kv_cache_dtype", lambda c: setattr(c.cache_config, "cache_dtype", "fp8"), "kv_cache_dtype is fp8"),
    ("supports_block_size", lambda c: setattr(c.cache_config, "block_size", 8), "block size 8"),
    ("supports_dtype", lambda c: setattr(c.model_config, "dtype", torch.float16), "torch.float16"),
    ("is_mla", lambda c: setattr(c.model_config, "use_mla", True), "MLA"),
    ("supports_recurrent_state", lambda c: setattr(c.model_config, "is_hybrid", True), "hybrid"),
    ("supports_sliding_window", lambda c: setattr(c.model_config.hf_text_config, "sliding_window", 4096),
     "sliding-window"),
    ("supports_chunked_local_attention", lambda c: setattr(c.model_config.hf_text_config, "attention_chunk_size", 8),
     "chunked local"),
    ("supports_kv_sharing", lambda c: setattr(c.model_config.hf_text_config, "num_kv_shared_layers", 10),
     "share KV"),
    ("supports_head_size", lambda c: setattr(c.model_config, "get_head_size", lambda: 96), "head size 96"),
]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
@pytest.mark.parametrize(("fact", "change", "words"), ENGINE, ids=[e[0] for e in ENGINE])
def test_engine_refusals_follow_the_declared_facts(backend: type, fact: str, change: Any, words: str) -> None:
    cfg = _config("lossless")
    assert capabilities.engine_refusals(backend, cfg) == []
    change(cfg)
    assert any(words in why for why in capabilities.engine_refusals(_declaring(backend, fact, False), cfg))
    assert not any(words in why for why in capabilities.engine_refusals(_declaring(backend, fact, True), cfg))


# (the fact, the layer that needs it, the refusal's words)
LAYERS = [
    ("is_mla", {"use_mla": True}, "MLA"),
    ("supports_sink", {"has_sink": True}, "sinks"),
    ("supports_sliding_window", {"has_sliding_window": True}, "sliding-window"),
    ("supports_non_causal", {"use_non_causal": True}, "non-causal"),
    ("supports_kv_connector", {"use_kv_connector": True}, "KV connector"),
    ("supports_dcp", {"use_dcp": True}, "context parallelism"),
    ("supports_dtype", {"dtype": torch.float16}, "float16"),
    ("supports_kv_cache_dtype", {"kv_cache_dtype": "fp8"}, "fp8"),
    ("supports_head_size", {"head_size": 96}, "head size 96"),
    ("supports_block_size", {"block_size": 8}, "block size 8"),
]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
@pytest.mark.parametrize(("fact", "layer", "words"), LAYERS, ids=[e[0] for e in LAYERS])
def test_layer_refusals_follow_the_declared_facts(backend: type, fact: str, layer: dict, words: str) -> None:
    sel = LAYER._replace(**layer)
    assert capabilities.layer_refusal(backend, LAYER) is None
    assert words in (capabilities.layer_refusal(backend, sel) or "")
    assert capabilities.layer_refusal(_declaring(backend, fact, True), sel) is None


def test_the_sliding_window_rule_is_one_fact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Declared once (page_facts.PageFacts, which both backends take their facts from), read by the engine's check
    (settings.resolve), the selector (hooks.layer_refusal) and the GPU impl: declared true there, all three pass."""
    cfg = _config("lossless")
    cfg.model_config.hf_text_config = SimpleNamespace(sliding_window=4096)
    with pytest.raises(ValueError, match="sliding-window"):
        settings.resolve(cfg)
    assert "sliding" in (hooks.layer_refusal(LAYER._replace(has_sliding_window=True), GlydAttentionBackend) or "")
    monkeypatch.setattr(page_facts.PageFacts, "supports_sliding_window", classmethod(lambda cls: True))
    assert settings.resolve(cfg).mode == "lossless"
    assert hooks.layer_refusal(LAYER._replace(has_sliding_window=True), GlydAttentionBackend) is None
    assert capabilities.impl_refusal(GlydGPUAttentionBackend, 8, 2, AttentionType.DECODER, sliding_window=64) is None


def test_the_backends_declare_what_differs() -> None:
    """The CPU backend runs vLLM's own kernel on decoded pages (alibi, soft cap, any query heads a KV head); the
    GPU kernels do not; both hold head sizes 64 and 128 in pages of whole 16-token tiles."""
    gpu, cpu = GlydGPUAttentionBackend, GlydAttentionBackend
    assert capabilities.impl_refusal(cpu, 32, 2, AttentionType.DECODER, alibi_slopes=[1.0], logits_soft_cap=30.0) \
        is None
    assert capabilities.impl_refusal(gpu, 8, 2, AttentionType.DECODER, alibi_slopes=[1.0]) == "alibi slopes"
    assert capabilities.impl_refusal(gpu, 32, 2, AttentionType.DECODER) == "16 query heads a KV head (it takes 1-8)"
    assert capabilities.impl_refusal(gpu, 8, 2, AttentionType.ENCODER) == f"{AttentionType.ENCODER} attention"
    for b in BACKENDS:  # a layer reading another's pages would decode them with its own tables and no overflow
        assert capabilities.impl_refusal(b, 8, 2, AttentionType.DECODER, kv_sharing_target_layer_name="layers.3") == \
            "KV shared with another layer"
    for b in BACKENDS:
        assert b.supports_head_size(64) and b.supports_head_size(128) and not b.supports_head_size(80)
        assert b.supports_block_size(128) and not b.supports_block_size(8)
        assert b.supports_dtype(torch.bfloat16) and not b.supports_dtype(torch.float16)


@pytest.mark.parametrize(("change", "words"), [e[1:] for e in ENGINE[:2]], ids=["tensor", "pipeline"])
def test_the_cpu_backend_runs_tensor_and_pipeline_parallel_and_the_cuda_one_refuses_them(change: Any,
                                                                                        words: str) -> None:
    """The CPU backend holds a rank's KV heads and a stage's layers (run in tests/vllm/test_engine_parallel.py); the
    CUDA backend has not run on several GPUs, so it still refuses both."""
    cfg = _config("lossless")
    change(cfg)
    assert capabilities.engine_refusals(GlydAttentionBackend, cfg) == []
    assert any(words in why for why in capabilities.engine_refusals(GlydGPUAttentionBackend, cfg))
