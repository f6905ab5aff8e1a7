"""One attention layer's compressed KV pages and the kernels that write and read them (the GPU backend's engine).

`KVLayer` owns what the kernels need beside vLLM's page tensor: the layer's window tops on the pages' device and
the overflow store. Decode tokens (one query a sequence; vLLM puts them first) take the CUDA decode attention, which
reads compressed pages straight into the tensor cores; prefill runs and chunks decode their sequences' tiles to bf16
and run SDPA with a causal mask aligned to the end of the context. `impl="torch"` runs the same interface on the
torch reference (any device), so the backend's wiring is tested on machines without a GPU. It knows nothing of
vLLM: the backend hands it the step's tensors, and tests drive it with hand-made batches.
"""

from __future__ import annotations

import torch

from glyd_engine.format.kv_page import TILE, KVPageCodec, KVPageLayout, OverflowStore, decode_tiles, write_by_block


class KVLayer:
    """Pages [num_blocks, H, page_bytes] uint8 (a view of vLLM's layer tensor), the layer's window tops [2, H, D], and
    optionally the overflow store's first arena (int16) and memory for its run pointers (int32; `OverflowStore`)."""

    def __init__(self, layout: KVPageLayout, tops: torch.Tensor, pages: torch.Tensor, impl: str = "cuda",
                 arena: torch.Tensor | None = None, pointers: torch.Tensor | None = None) -> None:
        if pages.dim() != 3 or pages.shape[2] != layout.page_bytes or tops.shape != (2, pages.shape[1],
                                                                                     layout.head_size):
            raise ValueError(f"pages must be uint8 [num_blocks, H, {layout.page_bytes}] and tops [2, H, "
                             f"{layout.head_size}], not {tuple(pages.shape)} and {tuple(tops.shape)}")
        if impl not in ("cuda", "torch"):
            raise ValueError(f"impl must be cuda or torch, not {impl!r}")
        self.layout, self.pages, self.impl = layout, pages, impl
        self.tops = tops.to(pages.device).contiguous()
        self.overflow = OverflowStore(pages.shape[0] * layout.tiles, pages.shape[1], device=pages.device,
                                      table=pointers)
        if arena is not None:  # the engine's, taken before vLLM profiled memory (kv_overflow.reserve_arena)
            self.overflow.adopt(arena)
        self.codec = KVPageCodec(layout, tops.cpu()) if impl == "torch" else None
        self.growth_rounds = 0  # writes run again for tiles that found no room in the overflow arena

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Append the step's K/V [T, H, D] at `slots` (-1: padding); a tile's tokens consecutive and in order.
        Returns the slots not stored for want of overflow room (empty almost always; `write_by_block`)."""
        if self.codec is not None:
            codec = self.codec
            return write_by_block(lambda k, v, s: codec.write(self.pages, self.overflow, k, v, s), key, value, slots,
                                  self.layout.block_size, lambda: codec.escapes(key, value))
        from glyd_kernels import kv_cuda

        def cuda_write(k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
            self.growth_rounds += kv_cuda.write(self.pages, self.layout, self.tops, self.overflow, k, v, s)

        return write_by_block(cuda_write, key, value, slots, self.layout.block_size)

    def reserve(self, tokens: int) -> None:
        """Room for the next write of `tokens` tokens taken before the step (0: none), so that the write runs no
        host code: the CUDA-graph path (kernels/kv_overflow.py). The reference needs none."""
        if self.codec is None:
            from glyd_kernels import kv_overflow

            kv_overflow.device_runs(self.overflow, self.layout.head_size).reserve(tokens)

    @property
    def reserved(self) -> int:
        """Tokens of the next write that `reserve` has room for (0: none)."""
        runs = self.overflow.device_runs
        return runs.reserved if runs is not None else 0

    def read(self, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [N, H, 16, D] bf16 of these tiles (block * tiles a page + tile) as attention reads them."""
        if self.codec is not None:
            view = self.pages.unflatten(2, (self.layout.tiles, self.layout.tile_bytes)).transpose(1, 2).reshape(
                -1, self.pages.shape[1], self.layout.tile_bytes)
            return decode_tiles(view[tiles.long().cpu()], tiles.long().cpu(), self.codec.tops, self.layout,
                                self.overflow)
        from glyd_kernels import kv_cuda

        return kv_cuda.read_tiles(self.pages, self.layout, self.tops, tiles, self.overflow)

    def attend(self, query: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, max_seq_len: int, scale: float, num_decodes: int,
               seq_lens_cpu: list[int] | None = None, query_start_cpu: list[int] | None = None) -> torch.Tensor:
        """Causal attention of the step's queries [T, Hq, D] over the pages (the step's K/V written first).

        The first `num_decodes` sequences have one query token each (rows 0..num_decodes-1); the rest are prefill
        runs or chunks, whose lengths the caller passes as host lists when it has them (else one sync here).
        `max_seq_len` sizes the decode's context split (the longest length a captured graph may replay).
        """
        nd = num_decodes
        if nd:
            self._decode(query[:nd], out[:nd], block_table[:nd], seq_lens[:nd], max_seq_len, scale)
        if nd < seq_lens.shape[0]:
            lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
            starts = query_start_cpu if query_start_cpu is not None else query_start_loc.tolist()
            for s in range(nd, len(lens)):
                self._prefill(query, out, block_table[s], lens[s], starts[s], starts[s + 1], scale)
        return out

    def _decode(self, query: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                max_seq_len: int, scale: float) -> None:
        if self.codec is None:
            from glyd_kernels import kv_cuda

            kv_cuda.decode_attention(query, self.pages, self.layout, self.tops, block_table, seq_lens, max_seq_len,
                                     scale, self.overflow, out=out)
            return
        for s, n in enumerate(seq_lens.tolist()):
            self._prefill(query[s : s + 1], out[s : s + 1], block_table[s], n, 0, 1, scale)

    def _prefill(self, query: torch.Tensor, out: torch.Tensor, table_row: torch.Tensor, seq_len: int, q0: int,
                 q1: int, scale: float) -> None:
        """One sequence: its tiles decoded to bf16, SDPA with the causal mask aligned to the context's end."""
        from torch.nn.attention.bias import causal_lower_right

        lay = self.layout
        n_tiles = -(-seq_len // TILE)
        blocks = table_row[: -(-n_tiles // lay.tiles)].long()
        tiles = (blocks.view(-1, 1) * lay.tiles + torch.arange(lay.tiles, device=blocks.device)).reshape(-1)[:n_tiles]
        k, v = self.read(tiles)  # [n, H, 16, D]
        h, d = k.shape[1], k.shape[3]
        k = k.to(query.device).transpose(0, 1).reshape(h, -1, d)[:, :seq_len]
        v = v.to(query.device).transpose(0, 1).reshape(h, -1, d)[:, :seq_len]
        q = query[q0:q1].transpose(0, 1)  # [Hq, n_q, D]
        g = q.shape[0] // h
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        mask = causal_lower_right(q1 - q0, seq_len)
        if q.device.type == "cpu":  # the CPU's SDPA takes no attention-bias object: build the mask
            mask = torch.ones(q1 - q0, seq_len, dtype=torch.bool).tril(seq_len - (q1 - q0))
            o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                                 scale=scale)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)


__all__ = ["KVLayer"]
