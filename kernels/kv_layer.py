"""One attention layer's compressed KV pages driven by the Triton kernels: the GPU path of the vLLM backend.

`TritonKVLayer` owns what the kernels need next to vLLM's page tensor: the layer's decode table (windows) and
its packed tops on the pages' device, a `PageWriter` and a device overflow store. It knows nothing of vLLM: the
backend (`glyd_engine.vllm_plugin.triton_backend`) hands it the step's tensors, and the tests drive it with
hand-made batches (under TRITON_INTERPRET=1 on the CPU). Single decode tokens take the decode kernel (split
over long contexts), everything else (prefill runs, chunks) the varlen prefill kernel; a mixed batch whose
decodes come first (vLLM orders them so when a builder asks, and says how many) is split between the two.
Both read the pages the step has just written, but the prefill kernel takes the step's own keys from its bf16
K/V when the caller passes them (the same values: a fresh prefill then decodes no page).
"""

from __future__ import annotations

import torch

from glyd_engine.format.kv_page import TABLE_SIZE, KVPageLayout
from kernels.kv_decode_attention import decode_pages, kv_decode_attention, pack_bases
from kernels.kv_page_write import DeviceOverflowStore, PageWriter
from kernels.kv_prefill_attention import kv_prefill_attention


class TritonKVLayer:
    """Pages [num_blocks, H, page_bytes] uint8 (a view of vLLM's layer tensor) with the layer's decode table."""

    def __init__(self, layout: KVPageLayout, decode_table: torch.Tensor, pages: torch.Tensor) -> None:
        if decode_table.dim() != 4 or decode_table.shape[0] != 2 or decode_table.shape[-1] != TABLE_SIZE:
            raise ValueError(f"decode table must be uint8 [2, H, D, {TABLE_SIZE}], not {tuple(decode_table.shape)}")
        if pages.dim() != 3 or pages.shape[1] != decode_table.shape[1] or pages.shape[2] != layout.page_bytes:
            raise ValueError(f"pages must be uint8 [num_blocks, {decode_table.shape[1]}, {layout.page_bytes}], "
                             f"not {tuple(pages.shape)}")
        self.layout = layout
        self.pages = pages
        dec = decode_table.to(pages.device).contiguous()
        self.writer = PageWriter(layout, dec)
        self.bases = pack_bases(dec)
        self.overflow = DeviceOverflowStore(pages.shape[0], pages.shape[1], device=pages.device)

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Append the step's K/V [T, H, D] at `slots` (-1: padding). One host sync (the overflow count)."""
        self.writer.write(self.pages, self.overflow, key, value, slots)

    def attend(self, query: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int, scale: float,
               num_decodes: int | None = None, key: torch.Tensor | None = None,
               value: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the step's queries [T, Hq, D] over the pages (their K/V written first).

        num_decodes: how many leading sequences of the batch have exactly one query token each (host int), if
        known; their queries are then the first num_decodes rows. key, value [T, H, D]: the step's own K/V (as
        written); given, prefill runs read them instead of decoding their own pages.
        """
        num_seqs = seq_lens.shape[0]
        overflow = self._overflow()
        if max_query_len == 1 and query.shape[0] == num_seqs:
            num_decodes = num_seqs
        nd = num_decodes or 0
        if nd:
            kv_decode_attention(query[:nd], self.pages, self.layout, self.bases, block_table[:nd], seq_lens[:nd],
                                max_seq_len, scale, overflow=overflow, out=out[:nd])
        if nd < num_seqs:  # the rest, its query offsets rebased to its first token (a device op, no sync)
            start = query_start_loc[nd:] - query_start_loc[nd] if nd else query_start_loc
            kv_prefill_attention(query[nd:], self.pages, self.layout, self.bases, block_table[nd:], seq_lens[nd:],
                                 start, max_query_len, scale, overflow=overflow, out=out[nd:],
                                 key=None if key is None else key[nd:], value=None if value is None else value[nd:])
        return out

    def _overflow(self) -> DeviceOverflowStore | None:
        """The store once any page has overflowed (a host counter: no sync); None lets the kernels skip it."""
        return self.overflow if self.overflow.values_written else None

    def read(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [N, H, B, D] bf16 of these pages through the attention kernels' decoder (check mode)."""
        return decode_pages(self.pages, self.layout, self.bases, blocks, self._overflow())


__all__ = ["TritonKVLayer"]
