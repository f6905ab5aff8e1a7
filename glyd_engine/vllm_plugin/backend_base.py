"""What both GLYD attention backends (CPU: torch codec; CUDA: Triton kernels) tell vLLM about their pages.

The page size (`customize_spec`), block sizes, layout and the layer kinds they refuse are facts of the page
code, not of the device: one mixin, placed first in each backend's bases.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType, MultipleOf
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from glyd_engine.vllm_plugin import settings, state

NAME = "GLYD"


class GlydBackendBase:
    forward_includes_kv_cache_update: bool = False
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "bfloat16"]
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # Pages must stay whole manager blocks (escapes are pooled per page); 16 keeps sections aligned.
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # a (block, KV head) page is contiguous: [blocks, H, B, C]

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Pages of C bytes a token and KV head; C does not depend on the block size (asked with 1 too)."""
        tables = state.current_tables()
        if tables is None:
            tables = state.load_tables(get_current_vllm_config().model_config.model)
        if spec.head_size != tables.head_size or spec.num_kv_heads != tables.num_kv_heads:
            raise ValueError(f"Glyd KV tables are for {tables.num_kv_heads} KV heads of size {tables.head_size}, "
                             f"the layer has {spec.num_kv_heads} of size {spec.head_size}")
        from vllm.config import get_current_vllm_config_or_none

        # vLLM sizes pages with no current config: the config this process decided for has the engine's settings
        c = tables.token_bytes(settings.code_bits(get_current_vllm_config_or_none() or settings.decided_config()))
        elem = torch.empty(0, dtype=spec.dtype).element_size()
        if c % elem:  # vLLM views the bytes as the spec's dtype and would pad each token's slot (kv_page.page_reserve)
            raise ValueError(f"Glyd KV pages of {c} bytes a token are not whole {spec.dtype} elements")
        return replace(spec, state_content_bytes=c)
