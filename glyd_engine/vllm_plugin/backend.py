"""GLYD: vLLM's paged KV cache held in the lossless page code (CPU build).

Sizing: `customize_spec` sets the page's content to C = layout.token_bytes bytes a token and KV head
(182 for head size 64 against bf16's 256), so vLLM's allocator, scheduler and prefix cache see smaller
pages and hold ~1.4x the tokens in the same memory. Write: `do_kv_cache_update` encodes the step's K/V
into the pages (replacing reshape_and_cache). Read: `forward` decodes the pages the batch's block tables
name into a bf16 scratch cache laid out as vLLM's own, then runs vLLM's own CPU attention kernel on it:
the values are bit for bit those written, and the kernel and its inputs are vLLM's, so outputs equal
vLLM's with its own cache (`exact` and `lossless` share this path on the CPU; see docs/vllm.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any, ClassVar

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType, MultipleOf
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from glyd_engine.vllm_plugin import settings, state
from glyd_engine.vllm_plugin.fast_read import read_pages

NAME = "GLYD"


class GlydAttentionBackend(CPUAttentionBackend):
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
    def get_supported_head_sizes(cls) -> list[int]:
        return [h for h in CPUAttentionBackend.get_supported_head_sizes() if h % 8 == 0]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

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
        c = tables.layout(1).token_bytes
        elem = torch.empty(0, dtype=spec.dtype).element_size()
        c += (-c) % elem  # vLLM views the bytes as the spec's dtype
        return replace(spec, state_content_bytes=c)

    @staticmethod
    def get_impl_cls() -> type[GlydAttentionImpl]:
        return GlydAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder


class GlydAttentionImpl(CPUAttentionBackendImpl):
    """CPU attention whose cache is Glyd pages: write encodes, forward decodes and runs vLLM's kernel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = get_current_vllm_config()
        self.decision = settings.decide(cfg)
        self.check = settings.check_enabled(cfg)
        self.tables = state.load_tables(cfg.model_config.model)

    # -- state ----------------------------------------------------------------------------------
    def _state(self, layer: Any, kv_cache: torch.Tensor) -> state.LayerState:
        name = layer.layer_name
        st = state.LAYERS.get(name)
        if st is not None and st.data_ptr == kv_cache.data_ptr():
            return st
        from vllm.model_executor.models.utils import extract_layer_index

        nb, _, block_size, _ = kv_cache.shape
        codec = self.tables.codec(extract_layer_index(name), block_size)
        pages = state.page_view(kv_cache, codec.layout.page_bytes)
        shadow = None
        if self.check:
            shadow = torch.zeros(nb, self.num_kv_heads, 2, block_size, self.head_size, dtype=torch.bfloat16)
        st = state.LayerState(codec, pages, codec.new_overflow(nb), kv_cache.data_ptr(), shadow)
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
        st.codec.write(st.pages, st.overflow, key, value, slot_mapping)
        if st.shadow is not None:
            slots = slot_mapping.to(torch.int64)
            keep = slots >= 0
            b = st.codec.layout.block_size
            blk, off = slots[keep] // b, slots[keep] % b
            st.shadow[blk, :, 0, off] = key[keep]
            st.shadow[blk, :, 1, off] = value[keep]

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
        table = md.block_table[:num_reqs]
        seq = md.seq_lens.to(torch.int64)
        cols = torch.arange(table.shape[1], dtype=torch.int64)
        fill_all = (seq.view(-1, 1) - cols.view(1, -1) * b).clamp(0, b)
        used = fill_all > 0
        ids = table[used].to(torch.int64)
        uniq, inverse = torch.unique(ids, return_inverse=True)
        fill = torch.zeros(uniq.numel(), dtype=torch.int64)
        fill.scatter_reduce_(0, inverse, fill_all[used], reduce="amax", include_self=False)
        k, v = read_pages(st.codec, st.pages, st.overflow, uniq)  # [U, H, B, D], = codec.read bit for bit
        state.STATS.pages_decoded += 2 * uniq.numel() * h
        valid = (torch.arange(b).view(1, b) < fill.view(-1, 1)).view(-1, 1, b, 1)
        if st.shadow is not None and not state.COMPARE["paused"]:
            self._compare(st, uniq, valid, k, v)
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

    @staticmethod
    def _compare(st: state.LayerState, uniq: torch.Tensor, valid: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Check mode: every value read (rows below each page's fill) against the value written, as bits."""
        want = st.shadow[uniq]  # [U, H, 2, B, D]
        got = torch.stack([k, v], dim=2)
        mask = valid.unsqueeze(2).expand_as(got)
        diff = got.view(torch.int16) != want.view(torch.int16)
        state.STATS.values_checked += int(mask.sum())
        state.STATS.values_differing += int((diff & mask).sum())
