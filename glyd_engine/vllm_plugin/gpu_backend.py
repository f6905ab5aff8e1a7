"""GLYD on CUDA: vLLM's paged KV cache in the lossless page code, written and read by the CUDA kernels.

The pages are the CPU backend's (same spec, same bytes; `backend_base`). Write: `do_kv_cache_update` runs the CUDA
page writer. Read: `forward` runs decode attention on compressed pages for the batch's single decode tokens (the
builder has vLLM put them first) and, for prefill runs and chunks, decodes their tiles to bf16 for SDPA
(`glyd_kernels.kv_layer.KVLayer`). Decode batches replay in full CUDA graphs: the writer takes overflow runs on the
device, the builder reserves each step's room in the overflow arena before the replay (the host's bound,
kernels/kv_overflow.py), the kernels read the arena's address from device memory, and a batch that a graph may
replay sizes its context split for the longest context (each sequence splits its own tiles). Mixed batches run
attention eagerly between vLLM's piecewise graphs. `GLYD_KV_KERNELS=reference` selects this backend on the CPU build
with the torch reference of the kernels, which is how the tests run its wiring inside the real engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from glyd_engine.errors import RefusedError
from glyd_engine.format.kv_page import OverflowStore
from glyd_engine.vllm_plugin import refusals, settings, state
from glyd_engine.vllm_plugin.backend_base import GlydBackendBase
from glyd_engine.vllm_plugin.capabilities import impl_refusal
from glyd_engine.vllm_plugin.page_facts import CudaPageFacts


@dataclass
class GlydGPUMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [S + 1]
    split_len: int  # the context length the decode launch sizes its split for (a graph's: the model's longest)
    seq_lens: torch.Tensor  # int32 [S]
    seq_lens_cpu: list[int] | None  # host copies for the prefill path (None: read from the device there)
    query_start_cpu: list[int] | None
    block_table: torch.Tensor  # int32 [S, max_blocks]
    slot_mapping: torch.Tensor
    num_decodes: int  # leading sequences with one query token each (vLLM orders decodes first for us)
    # The sequences from `num_decodes` on through vLLM's FlashAttention on their decoded pages (None: torch SDPA)
    faithful: FaithfulBatch | None = None


@dataclass
class FaithfulBatch:
    """Sequences attended by vLLM's own FlashAttention over their pages decoded to bf16, exactly as `off` calls it.

    Their pages are decoded into a compact bf16 cache laid out as vLLM's (a block's tokens, each token's heads, K then
    V), numbered in table order (`tiles`: the pages' tiles to decode), and `metadata` is FlashAttention's own for
    these sequences with the compact block table: the same kernel, arguments and schedule as vLLM's cache, so the
    same bits for the same values."""

    metadata: Any  # vLLM's FlashAttentionMetadata
    first_token: int
    tiles: torch.Tensor  # int64 [U * tiles a page]
    blocks: int  # U


class GlydGPUMetadataBuilder(AttentionMetadataBuilder[GlydGPUMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """Full graphs for decode batches, except where host code must run each step: check mode (reads pages
        back), exact (decodes the batch's pages), the reference kernels (the CPU build's tests) and an arena limit
        (a write that finds no room must report its slots, for their requests to be refused: refusals.py)."""
        if settings.check_enabled(vllm_config) or settings.kernels(vllm_config) == "reference" or \
                settings.decide(vllm_config).mode == "exact" or \
                settings.arena_limit_entries(vllm_config) is not None:
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decodes first: they take the decode kernel
        cc = vllm_config.compilation_config
        # batches of up to this many tokens may run in a captured graph (full or piecewise): their writes get room
        # reserved before the step, since a replay runs no host code
        self._graph_tokens = (cc.max_cudagraph_capture_size or 0) if cc.cudagraph_mode.has_full_cudagraphs() \
            or cc.cudagraph_mode.has_piecewise_cudagraphs() else 0
        self._full_graphs = cc.cudagraph_mode.has_full_cudagraphs()
        self._max_len = vllm_config.model_config.max_model_len
        self._values_a_token = 2 * kv_cache_spec.num_kv_heads * kv_cache_spec.head_size
        self._exact = settings.decide(vllm_config).mode == "exact"
        self._fa = faithful_builder(kv_cache_spec, layer_names, vllm_config, device)
        if self._exact and self._fa is None:
            raise RefusedError("Glyd KV cache (kv=exact) runs vLLM's FlashAttention over decoded pages, which this "
                               "vLLM build or GPU lacks", "use lossless (every stored value is still exact)")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GlydGPUMetadata:
        from vllm.v1.attention.backends.utils import split_decodes_and_prefills

        state.apply_releases()  # host code of every step, graph replays too: before any freed block is reused
        m = common_attn_metadata
        num_decodes, _, decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        if decode_tokens != num_decodes or self._exact:  # exact: every sequence through FlashAttention
            num_decodes = 0
        n = m.seq_lens.shape[0]
        host = num_decodes < n  # the prefill path loops over sequences on the host
        qsl = getattr(m, "query_start_loc_cpu", None)
        # exact for prefill rows (vLLM 0.32-0.33; speculative decoding, where it is only a bound, is refused)
        sl = getattr(m, "seq_lens_cpu", None)
        if sl is None:
            sl = getattr(m, "seq_lens_cpu_upper_bound", None)
        tokens = m.slot_mapping.shape[0]
        replayable = tokens <= self._graph_tokens
        self._reserve(tokens if replayable else 0, m.num_actual_tokens)
        # a full graph of a decode batch keeps the split count it was captured with, for every later length
        split_len = self._max_len if replayable and self._full_graphs and num_decodes == n else m.max_seq_len
        lens = sl.tolist() if host and sl is not None else None
        starts = qsl.tolist() if host and qsl is not None else None
        faithful = None
        if host and self._fa is not None and lens is not None and starts is not None:
            faithful = self._faithful(m, num_decodes, lens, starts)
        return GlydGPUMetadata(m.num_actual_tokens, m.max_query_len, m.query_start_loc, split_len, m.seq_lens,
                               lens, starts, m.block_table_tensor, m.slot_mapping, num_decodes, faithful)

    def _faithful(self, m: CommonAttentionMetadata, first: int, lens: list[int], starts: list[int]) -> FaithfulBatch:
        """FlashAttention's metadata for sequences `first`.. (all of the batch but its decodes) over a compact copy of
        their pages: the same metadata vLLM builds for them, but for block numbers in table order."""
        import dataclasses

        bs = self.kv_cache_spec.block_size
        n = len(lens)
        counts = [-(-lens[s] // bs) for s in range(first, n)]
        width = max(counts)
        table = torch.zeros(n - first, width, dtype=torch.int32)
        rows, cols, u = [], [], 0
        for i, c in enumerate(counts):
            table[i, :c] = torch.arange(u, u + c, dtype=torch.int32)
            rows += [first + i] * c
            cols += range(c)
            u += c
        dev = m.block_table_tensor.device
        blocks = m.block_table_tensor[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)].to(torch.int64)
        tpp = bs // 16
        tiles = (blocks.view(-1, 1) * tpp + torch.arange(tpp, device=dev)).reshape(-1)
        t0 = starts[first]
        sub = m
        if first:
            qsl_cpu = m.query_start_loc_cpu[first : n + 1] - t0
            upper = getattr(m, "seq_lens_cpu_upper_bound", None)
            sub = dataclasses.replace(
                m, query_start_loc=m.query_start_loc[first : n + 1] - t0, query_start_loc_cpu=qsl_cpu,
                seq_lens=m.seq_lens[first:n], num_reqs=n - first, num_actual_tokens=m.num_actual_tokens - t0,
                max_query_len=int((qsl_cpu[1:] - qsl_cpu[:-1]).max()), slot_mapping=m.slot_mapping[t0:],
                **({"seq_lens_cpu_upper_bound": upper[first:n]} if upper is not None else {}))
        sub = dataclasses.replace(sub, block_table_tensor=table.to(dev, non_blocking=True))
        return FaithfulBatch(self._fa.build(0, sub), t0, tiles, u)

    def _reserve(self, tokens: int, actual: int) -> None:
        """Each layer's overflow room for this step's write (0: the write checks for itself), and a reserved write's
        values counted here, since a replayed write runs no host code. Layers not yet written have nothing to do."""
        for name in self.layer_names:
            st = state.LAYERS.get(name)
            if st is None:
                continue
            kv = st.extra["kernels"]
            kv.reserve(tokens)
            if kv.reserved:
                st.codec.stats.values += self._values_a_token * actual


def pointer_reserve(vllm_config: Any, token_bytes: int, device: torch.device) -> torch.Tensor | None:
    """A layer's run-pointer memory for the most blocks vLLM's KV budget can buy: that budget is at most the GPU's
    memory times gpu_memory_utilization (or kv_cache_memory_bytes where given), shared by the model's layers. None
    where either is unknown: the store then takes its table when the cache is bound, outside the budget (0.5 bytes a
    token and KV head beside a page's C)."""
    from glyd_kernels import kv_overflow

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if getattr(mc, "enable_sleep_mode", False):  # a level-2 sleep frees what the model's load took, unsaved
        state.log.info("Glyd KV cache: run pointers taken with the cache, outside vLLM's budget (sleep mode is on)")
        return None
    try:
        cc = vllm_config.cache_config
        budget = getattr(cc, "kv_cache_memory_bytes", None) or \
            math.ceil(torch.cuda.mem_get_info(device)[1] * cc.gpu_memory_utilization)
        try:
            layers = mc.get_num_layers_by_block_type(pc, "attention")
        except Exception:  # a model config without layer types
            layers = mc.get_num_layers(pc)
    except Exception as exc:  # a vLLM without these: the old place, outside the budget
        state.log.info("Glyd KV cache: run pointers taken with the cache (vLLM's KV budget unknown: %s)", exc)
        return None
    return kv_overflow.reserve_pointers(kv_overflow.pointer_entries_bound(int(budget), int(layers), token_bytes),
                                        device)


def faithful_builder(kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> Any:
    """vLLM's FlashAttention metadata builder for these layers, or None where FlashAttention cannot run (the CPU
    build, GPUs it does not support, the reference kernels): prefill then takes torch SDPA on decoded tiles."""
    if settings.kernels(vllm_config) != "cuda":
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import is_flash_attn_varlen_func_available
        from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

        if not is_flash_attn_varlen_func_available():
            return None
        return FlashAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)
    except Exception as exc:  # any failure to set FlashAttention up leaves the SDPA prefill path
        state.log.info("Glyd KV cache: prefill runs torch SDPA on decoded pages (FlashAttention unavailable: %s)", exc)
        return None


class GlydGPUAttentionBackend(CudaPageFacts, GlydBackendBase, AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "GLYD_GPU"

    @staticmethod
    def get_impl_cls() -> type[GlydGPUAttentionImpl]:
        return GlydGPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GlydGPUMetadataBuilder]:
        return GlydGPUMetadataBuilder


class GlydGPUAttentionImpl(AttentionImpl):
    """Decoder self-attention over Glyd pages with the CUDA kernels (no alibi, window, soft cap or sinks: the
    selector refuses those layers before this is built), 1-8 query heads a KV head."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **kwargs: Any) -> None:
        why = impl_refusal(GlydGPUAttentionBackend, num_heads, num_kv_heads, attn_type, alibi_slopes=alibi_slopes,
                           sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=kwargs.get("sinks"),
                           kv_sharing_target_layer_name=kv_sharing_target_layer_name)
        if why is not None:
            raise RefusedError(f"Glyd KV cache: the GPU attention does not support {why}", settings.OFF_HINT)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        cfg = get_current_vllm_config()
        refusals.join(cfg)
        self.check = settings.check_enabled(cfg)
        self.impl = "torch" if settings.kernels(cfg) == "reference" else "cuda"
        self.tables = state.rank_tables(cfg.model_config.model)  # this worker's layers and KV heads
        self.code_bits = settings.code_bits(cfg)
        self.arena_limit = settings.arena_limit_entries(cfg)
        self._fa_impl: Any = None
        self._arena: torch.Tensor | None = None
        self._pointers: torch.Tensor | None = None
        if self.impl == "cuda":
            from glyd_kernels import kv_overflow

            # taken now, while vLLM loads the model: its memory profile then counts the arena and the run pointers in
            # what the KV cache may not use, so cache and overflow together stay inside gpu_memory_utilization
            device = torch.device("cuda", torch.cuda.current_device())
            self._arena = kv_overflow.reserve_arena(self.num_kv_heads, head_size, device, self.arena_limit)
            self._pointers = pointer_reserve(cfg, self.tables.token_bytes(self.code_bits), device)
            state.note_arena_reserve(self._arena, self._pointers)
            try:
                from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

                self._fa_impl = FlashAttentionImpl(num_heads, head_size, scale, self.num_kv_heads, None, None, "auto")
            except Exception:  # the builder then plans no FlashAttention batch either (faithful_builder)
                self._fa_impl = None

    def _state(self, layer: Any, kv_cache: torch.Tensor) -> state.LayerState:
        old = st = state.LAYERS.get(layer.layer_name)
        if st is not None and st.data_ptr == kv_cache.data_ptr():
            return st
        from vllm.model_executor.models.utils import extract_layer_index

        from glyd_kernels.kv_layer import KVLayer

        nb, _, block_size, _ = kv_cache.shape
        index = extract_layer_index(layer.layer_name)
        codec = self.tables.codec(index, block_size, self.code_bits)
        pages = state.page_view(kv_cache, codec.layout.page_bytes)
        # the arena reserved at start, or the one of this layer's previous cache (vLLM's profiling binds one first)
        arena = old.overflow.arena if old is not None and self._arena is None else self._arena
        state.log_arena_reserve()
        self._arena = None
        pointers = self._pointers  # every cache bound takes its pointer table from the start's reserve
        if pointers is not None and \
                pointers.numel() < OverflowStore.pointer_entries(nb * codec.layout.tiles, pages.shape[1]):
            state.log.warning("Glyd KV cache: vLLM gave %s %d blocks, more than its KV budget was bounded to buy; "
                              "their run pointers are taken outside the budget", layer.layer_name, nb)
            pointers = self._pointers = None  # the reserve goes back to the allocator
        kv = KVLayer(codec.layout, codec.tops, pages, impl=self.impl, arena=arena if self.impl == "cuda" else None,
                     pointers=pointers)
        if self.arena_limit is not None:  # the first arena is at most the limit (rounded to whole runs, >= one run)
            kv.overflow.limit = max(self.arena_limit, kv.overflow.arena.numel())
        codec = kv.codec or codec  # the reference path's codec is the one that writes (and counts)
        shadow = None
        if self.check:
            shadow = torch.zeros(nb, self.num_kv_heads, 2, block_size, self.head_size, dtype=torch.bfloat16,
                                 device=kv_cache.device)
        st = state.LayerState(codec, pages, kv.overflow, kv_cache.data_ptr(), shadow, {"kernels": kv})
        state.LAYERS[layer.layer_name] = st
        return st

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        st = self._state(layer, kv_cache)
        n = slot_mapping.shape[0]
        key, value = key[:n], value[:n]
        kv = st.extra["kernels"]
        counted = kv.reserved  # a reserved write's values were counted by the builder
        state.after_write(st, slot_mapping, kv.write(key, value, slot_mapping))
        if kv.codec is None and not counted:  # the CUDA writer counts nothing on the host
            st.codec.stats.values += 2 * key.numel()
        if st.shadow is not None:
            state.write_shadow(st, key, value, slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: GlydGPUMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None,
                ) -> torch.Tensor:
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("Glyd KV cache: fused output quantization is not supported")
        st = self._state(layer, kv_cache)
        kv = st.extra["kernels"]
        md = attn_metadata
        n = md.num_actual_tokens
        num_reqs = md.seq_lens.shape[0]
        out = output[:n].view(n, self.num_heads, self.head_size)
        q = query[:n].view(n, self.num_heads, self.head_size)
        fb = md.faithful
        if fb is not None and self._fa_impl is not None:
            nd = md.num_decodes
            if nd:
                kv.attend(q[:nd], out[:nd], md.block_table[:nd], md.seq_lens[:nd], md.query_start_loc[: nd + 1],
                          md.split_len, self.scale, nd)
            self._faithful(layer, kv, fb, query, key, value, output, n)
        else:
            kv.attend(q, out, md.block_table[:num_reqs], md.seq_lens, md.query_start_loc, md.split_len, self.scale,
                      md.num_decodes, md.seq_lens_cpu, md.query_start_cpu)
        if 0 < md.num_decodes < num_reqs:
            state.STATS.split_batches += 1
        if st.shadow is not None and not state.COMPARE["paused"]:
            self._check(st, kv, md)
        return output

    def _faithful(self, layer: Any, kv: Any, fb: FaithfulBatch, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, output: torch.Tensor, n: int) -> None:
        """vLLM's FlashAttention over the batch's pages decoded into a compact bf16 cache in vLLM's own layout."""
        lay = kv.layout
        h, d = self.num_kv_heads, self.head_size
        k, v = kv.read(fb.tiles)  # [U * tiles, H, 16, D]
        cache = torch.empty(fb.blocks, lay.block_size, h, 2 * d, dtype=torch.bfloat16, device=k.device)
        view = cache.view(fb.blocks, lay.tiles, 16, h, 2 * d)
        view[..., :d] = k.view(fb.blocks, lay.tiles, h, 16, d).transpose(2, 3)
        view[..., d:] = v.view(fb.blocks, lay.tiles, h, 16, d).transpose(2, 3)
        t0 = fb.first_token
        hq = self.num_heads
        # vLLM hands FlashAttention a layer's cache as [blocks, KV heads, tokens, 2 x head] over this memory order
        self._fa_impl.forward(layer, query.view(-1, hq, d)[t0:n], key.view(-1, h, d)[t0:n],
                              value.view(-1, h, d)[t0:n], cache.transpose(1, 2), fb.metadata,
                              output.view(-1, hq, d)[t0:n])

    @staticmethod
    def _check(st: state.LayerState, kv: Any, md: GlydGPUMetadata) -> None:
        """Check mode: the batch's pages through the tile reader (the decoder attention's fast path and escape
        lists share), every row below a page's fill compared with the bf16 shadow."""
        lay = st.codec.layout
        use = state.pages_in_use(md.block_table[: md.seq_lens.shape[0]], md.seq_lens, lay.block_size)
        tiles = (use.blocks.view(-1, 1) * lay.tiles + torch.arange(lay.tiles, device=use.blocks.device)).reshape(-1)
        k, v = kv.read(tiles)  # [U * tiles, H, 16, D]
        h, d = k.shape[1], k.shape[3]
        page = lambda x: x.view(-1, lay.tiles, h, 16, d).transpose(1, 2).reshape(-1, h, lay.block_size, d)  # noqa: E731
        state.STATS.pages_decoded += 2 * use.blocks.numel() * h
        state.compare_read(st, use.blocks, use.rows(lay.block_size), page(k), page(v))
