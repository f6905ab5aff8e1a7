"""What both GLYD attention backends (CPU: torch codec; CUDA: the CUDA kernels) tell vLLM about their pages beyond
the facts of page_facts.py: the name, the layout, and the page size (`customize_spec`), which needs the model's
tables and the engine's settings. One mixin, placed first in each backend's bases, after the backend's facts.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from glyd_engine.vllm_plugin import settings, state
from glyd_engine.vllm_plugin.page_facts import PageFacts

NAME = "GLYD"


class GlydBackendBase(PageFacts):
    """What vLLM asks every GLYD backend beyond the facts: its name, layout and the page size."""

    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return NAME

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # a (block, KV head) page is contiguous: [blocks, H, B, C]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Pages of C bytes a token and KV head; C does not depend on the block size (asked with 1 too)."""
        tables = state.current_tables()
        if tables is None:
            tables = state.rank_tables(get_current_vllm_config().model_config.model)
        if spec.head_size != tables.head_size or spec.num_kv_heads != tables.num_kv_heads:
            raise ValueError(f"Glyd KV tables hold {tables.num_kv_heads} KV heads of size {tables.head_size} for this "
                             f"worker, the layer has {spec.num_kv_heads} of size {spec.head_size}")
        from vllm.config import get_current_vllm_config_or_none

        # vLLM sizes pages with no current config: the config this process decided for has the engine's settings
        c = tables.token_bytes(settings.code_bits(get_current_vllm_config_or_none() or settings.decided_config()))
        elem = torch.empty(0, dtype=spec.dtype).element_size()
        if c % elem:  # vLLM views the bytes as the spec's dtype and would pad each token's slot (kv_page.page_reserve)
            raise ValueError(f"Glyd KV pages of {c} bytes a token are not whole {spec.dtype} elements")
        return replace(spec, state_content_bytes=c)
