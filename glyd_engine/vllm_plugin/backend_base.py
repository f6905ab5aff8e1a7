"""What both GLYD attention backends (CPU: torch codec; CUDA: the CUDA kernels) tell vLLM about their pages.

The page size (`customize_spec`), block sizes, layout and what they support are facts of the page code, not of
the device: one mixin, placed first in each backend's bases; a backend overrides where it differs (head sizes,
query heads a KV head). The facts are declared the way vLLM's attention backends declare theirs
(`supports_head_size`, `get_supported_kernel_block_sizes`, `supports_sliding_window`...), plus the engine-wide
ones vLLM has no word for (parallelism, speculative decoding, offloading). Every refusal is derived from them
(capabilities.py): the engine's before it starts, each attention layer's at the backend selector.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType, MultipleOf
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from glyd_engine.format.kv_page import HEAD_SIZES
from glyd_engine.vllm_plugin import settings, state

NAME = "GLYD"


class GlydBackendBase:
    forward_includes_kv_cache_update: bool = False
    # The page code holds bf16 values: activations and the cache are bf16.
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "bfloat16"]
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    # Query heads a KV head the attention takes (None: any).
    query_heads_per_kv_head: ClassVar[range | None] = None

    @staticmethod
    def get_name() -> str:
        return NAME

    # -- what vLLM asks every attention backend -------------------------------------------------------------
    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)  # a lane holds D/2 values a tile in 3-word units

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in cls.get_supported_head_sizes()

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype is None or str(kv_cache_dtype) in cls.supported_kv_cache_dtypes

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # Pages must stay whole manager blocks (escapes are pooled per page); 16 keeps sections aligned.
        return [MultipleOf(16)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        sizes = cls.get_supported_kernel_block_sizes()
        return block_size is None or any(block_size % (s.base if isinstance(s, MultipleOf) else s) == 0 for s in sizes)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # a (block, KV head) page is contiguous: [blocks, H, B, C]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False  # a page holds every token of its block; nothing evicts tokens that left the window

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # connectors copy raw pages and cannot see the overflow arena

    @classmethod
    def supports_pcp(cls) -> bool:
        return False

    @classmethod
    def supports_dcp(cls) -> bool:
        return False

    # -- engine-wide facts vLLM's backends do not declare ---------------------------------------------------
    @classmethod
    def supports_tensor_parallel(cls) -> bool:
        return False

    @classmethod
    def supports_pipeline_parallel(cls) -> bool:
        return False

    @classmethod
    def supports_micro_batching(cls) -> bool:
        return False  # the GPU page writer's overflow room is reserved once a step, for one batch

    @classmethod
    def supports_speculative_decoding(cls) -> bool:
        return False

    @classmethod
    def supports_kv_offloading(cls) -> bool:
        return False  # offload copies raw pages and cannot see the overflow arena

    @classmethod
    def supports_chunked_local_attention(cls) -> bool:
        return False

    @classmethod
    def supports_recurrent_state(cls) -> bool:
        return False  # hybrid and attention-free models keep mamba/linear-attention state beside (or instead of) KV

    @classmethod
    def supports_alibi(cls) -> bool:
        return False

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
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
