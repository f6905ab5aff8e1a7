"""What each GLYD attention backend supports, declared once as facts of the page code (and, where a backend differs,
of its kernels), the way vLLM's attention backends declare theirs (`supports_head_size`,
`get_supported_kernel_block_sizes`, `supports_sliding_window`...), plus the engine-wide facts vLLM has no word for
(parallelism, speculative decoding, offloading).

Facts only: this module imports nothing of the plugin, so the settings can derive every refusal from it
(capabilities.py) before any backend module, which reads the settings, is imported. Each backend class takes its
facts from here (its first base), so the engine's refusals and vLLM's questions get one answer.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionType, MultipleOf

from glyd_engine.format.kv_page import HEAD_SIZES, head_size_supported


class PageFacts:
    """The page code's facts, as vLLM's attention backends declare theirs; a backend overrides where it differs."""

    # The page code holds bf16 values: activations and the cache are bf16.
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "bfloat16"]
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    # Query heads a KV head the attention takes (None: any).
    query_heads_per_kv_head: ClassVar[range | None] = None

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
        return False  # the CUDA backend has not run on several GPUs yet; the CPU backend declares it

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
    def supports_kv_sharing(cls) -> bool:
        return False  # a layer reading another layer's pages would decode them with its own tables and no overflow

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


class TorchPageFacts(PageFacts):
    """The CPU build's backend: the torch codec decodes pages for vLLM's own CPU attention kernel."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return [h for h in CPUAttentionBackend.get_supported_head_sizes() if head_size_supported(h)]

    @classmethod
    def supports_alibi(cls) -> bool:
        return True  # vLLM's own CPU kernel runs on the decoded pages

    @classmethod
    def supports_tensor_parallel(cls) -> bool:
        return True  # a rank's pages hold its KV heads, coded with their slice of the tables (state.rank_tables)

    @classmethod
    def supports_pipeline_parallel(cls) -> bool:
        return True  # a stage's pages and tables are its layers' only

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return True


class CudaPageFacts(PageFacts):
    """The CUDA build's backend: the CUDA kernels attend over the pages themselves."""

    query_heads_per_kv_head: ClassVar[range | None] = range(1, 9)  # a decode tile's query rows


def facts_for(kernels: str) -> type[PageFacts]:
    """The facts that apply where `kernels` (settings.kernels) run the pages."""
    return TorchPageFacts if kernels == "torch" else CudaPageFacts
