"""GLYD: vLLM's paged KV cache held in the lossless page code (CPU build).

Sizing: `customize_spec` sets the page's content to C = layout.token_bytes bytes a token and KV head
(181 for the demo model's head size 64 against bf16's 256), so vLLM's allocator, scheduler and prefix cache see smaller
pages and hold ~1.4x the tokens in the same memory. Write: `do_kv_cache_update` encodes the step's K/V
into the pages (replacing reshape_and_cache). Read: `forward` decodes the pages the batch's block tables
name into a bf16 scratch cache laid out as vLLM's own, then runs vLLM's own CPU attention kernel on it:
the values are bit for bit those written, and the kernel and its inputs are vLLM's, so outputs equal
vLLM's with its own cache (`exact` and `lossless` share this path on the CPU; see docs/vllm.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from glyd_engine.errors import RefusedError
from glyd_engine.format.kv_page import write_by_block
from glyd_engine.vllm_plugin import refusals, settings, state
from glyd_engine.vllm_plugin.backend_base import GlydBackendBase
from glyd_engine.vllm_plugin.page_facts import TorchPageFacts


class GlydAttentionBackend(TorchPageFacts, GlydBackendBase, CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[GlydAttentionImpl]:
        return GlydAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GlydCPUMetadataBuilder]:
        return GlydCPUMetadataBuilder


class GlydCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's own, once a step before any layer writes: the overflow of the blocks of refused requests goes back
    first (state.apply_releases), as the GPU builder does."""

    def build(self, *args: Any, **kwargs: Any) -> CPUAttentionMetadata:
        state.apply_releases()
        return super().build(*args, **kwargs)


class GlydAttentionImpl(CPUAttentionBackendImpl):
    """CPU attention whose cache is Glyd pages: write encodes, forward decodes and runs vLLM's kernel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_sharing_target_layer_name is not None and not GlydAttentionBackend.supports_kv_sharing():
            raise RefusedError(f"Glyd KV cache: a layer reads {self.kv_sharing_target_layer_name}'s KV (KV sharing), "
                               "which the pages do not support", settings.OFF_HINT)
        cfg = get_current_vllm_config()  # the selector chose this backend from settings.decide(cfg)
        refusals.join(cfg)
        self.check = settings.check_enabled(cfg)
        self.tables = state.rank_tables(cfg.model_config.model)  # this worker's layers and KV heads
        self.code_bits = settings.code_bits(cfg)
        self.arena_limit = settings.arena_limit_entries(cfg)

    # -- state ----------------------------------------------------------------------------------
    def _state(self, layer: Any, kv_cache: torch.Tensor) -> state.LayerState:
        name = layer.layer_name
        st = state.LAYERS.get(name)
        if st is not None and st.data_ptr == kv_cache.data_ptr():
            return st
        from vllm.model_executor.models.utils import extract_layer_index

        nb, _, block_size, _ = kv_cache.shape
        codec = self.tables.codec(extract_layer_index(name), block_size, self.code_bits)
        pages = state.page_view(kv_cache, codec.layout.page_bytes)
        shadow = None
        if self.check:
            shadow = torch.zeros(nb, self.num_kv_heads, 2, block_size, self.head_size, dtype=torch.bfloat16)
        overflow = codec.new_overflow(nb)
        overflow.limit = self.arena_limit
        st = state.LayerState(codec, pages, overflow, kv_cache.data_ptr(), shadow)
        state.LAYERS[name] = st
        return st

    # -- write ----------------------------------------------------------------------------------
    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.attn_type != AttentionType.DECODER:
            return
        st = self._state(layer, kv_cache)
        n = slot_mapping.shape[0]
        key, value = key[:n], value[:n]
        lost = write_by_block(lambda k, v, s: st.codec.write(st.pages, st.overflow, k, v, s), key, value,
                              slot_mapping, st.codec.layout.block_size, lambda: st.codec.escapes(key, value))
        state.after_write(st, slot_mapping, lost)
        if st.shadow is not None:
            state.write_shadow(st, key, value, slot_mapping)

    # -- read -----------------------------------------------------------------------------------
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CPUAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None,
                ) -> torch.Tensor:
        if attn_metadata is None:  # profiling run
            return output
        st = self._state(layer, kv_cache)
        scratch, table = self._decode(layer, st, attn_metadata)
        md = dataclasses.replace(attn_metadata, block_table=table)
        return super().forward(layer, query, key, value, scratch, md, output, output_scale, output_block_scale)

    def _decode(self, layer: Any, st: state.LayerState, md: CPUAttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's pages decoded into a bf16 cache in vLLM's layout, and the block table renumbered."""
        lay = st.codec.layout
        b, d, h = lay.block_size, lay.head_size, self.num_kv_heads
        num_reqs = md.seq_lens.shape[0]
        use = state.pages_in_use(md.block_table[:num_reqs], md.seq_lens, b)
        uniq, used, inverse = use.blocks, use.used, use.inverse
        k, v = st.codec.read(st.pages, st.overflow, uniq)  # [U, H, B, D]
        state.STATS.pages_decoded += 2 * uniq.numel() * h
        valid = use.rows(b)
        if st.shadow is not None and not state.COMPARE["paused"]:
            state.compare_read(st, uniq, valid, k, v)
        # Rows past a page's fill are garbage (possibly NaN patterns): zero them as vLLM's fresh pages are.
        zero = torch.zeros((), dtype=k.dtype)
        k, v = torch.where(valid, k, zero), torch.where(valid, v, zero)
        u = uniq.numel()
        scratch = torch.empty(u, h, b, 2 * d, dtype=k.dtype)
        key_cache, value_cache = scratch.view(u, h, 2 * b, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            k.permute(0, 2, 1, 3).reshape(u * b, h, d), v.permute(0, 2, 1, 3).reshape(u * b, h, d),
            key_cache, value_cache, torch.arange(u * b, dtype=torch.int64), layer.isa,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)
        new_table = torch.zeros_like(md.block_table)
        new_table[:num_reqs][used] = inverse.to(new_table.dtype)
        return scratch, new_table
