"""Triton kernels for Glyd's compressed KV pages (docs/format.md section 2) and resident weights (section 4).

- `kv_decode_attention`: paged decode attention that reads compressed pages and decodes them in
  registers, 4 values a 32-bit word (GQA, split over the context with a fixed-order merge), plus
  `decode_pages`, a debug kernel that writes decoded K/V so the decoder can be checked bit for bit against
  `KVPageCodec.read`.
- `kv_prefill_attention`: causal attention of prefill runs, prefill chunks and decode tokens in one varlen
  batch over the same pages (the step's K/V written first, as vLLM's unified attention expects).
- `kv_page_write`: appends K/V tokens (prefill runs, single decode tokens) into compressed pages,
  escapes included; escapes past a page's reserve take a torch path (counted) into a device overflow store.

- `resident_linear`: the Glyd matmul, weight tiles decoded on chip (imported from its module).
- `kv_layer.TritonKVLayer`: one layer's pages driven by these kernels (what the vLLM backend calls on CUDA).

The torch reference for the KV kernels is `glyd_engine.format.kv_page.KVPageCodec` (write/read). Each function
here runs under `TRITON_INTERPRET=1` on the CPU (tests/kernels) and natively on CUDA.
"""

from kernels.kv_decode_attention import decode_pages, kv_decode_attention, pack_bases
from kernels.kv_page_write import DeviceOverflowStore, PageWriter, write_pages
from kernels.kv_prefill_attention import kv_prefill_attention

__all__ = ["DeviceOverflowStore", "PageWriter", "decode_pages", "kv_decode_attention", "kv_prefill_attention",
           "pack_bases", "write_pages"]
