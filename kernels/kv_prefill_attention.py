"""Prefill and mixed-batch attention over Glyd's compressed KV pages, in Triton.

Query token i of a sequence with L tokens in all and q new ones sits at position L - q + i and sees keys
0..L - q + i. The keys before the step (the cached prefix: earlier chunks, a prefix-cache hit) are read from the
pages, decoded in registers by the decode kernel's decoder (`_decode_rows`); the step's own keys are read as
bf16 from the step's key/value tensors when the caller passes them (the values the page writer has just stored,
bit for bit, so the result is the same, but a fresh prefill decodes nothing). Without them every key comes from
the pages. A batch may mix prefill runs, chunks of a longer prefill and single decode tokens, in vLLM's varlen
layout (`query_start_loc`).

One program per (sequence, KV head, block of BLOCK_Q query tokens): its rows are the block's tokens times the
G query heads of the KV head (padded to 16 for the tensor-core dot), so a decoded page serves G·BLOCK_Q rows.
It walks the pages up to the block's last position, with the online softmax of the decode kernel
(`_softmax_step`); no context split, so the result does not depend on any launch setting but BLOCK_Q.
`reference_prefill_attention` is the fp32 torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glyd_engine.format.kv_page import KVPageLayout, OverflowStore
from kernels.kv_decode_attention import (
    _INTERPRET,
    _check_query,
    _decode_rows,
    _head_bases,
    _offsets,
    _overflow_args,
    _overflow_offsets,
    _softmax_step,
)


@triton.jit
def _prefill_kernel(q_ptr, out_ptr, cache_w_ptr, base_ptr, ovf_ptr, arena_w_ptr, arena_words, block_table_ptr,
                    seq_lens_ptr, q_start_ptr, key_ptr, val_ptr, scale_log2, stride_q0, stride_q1, stride_o0,
                    stride_o1, stride_k0, stride_k1, bt_stride, page_words, num_kv_heads,
                    G: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                    K_SM: tl.constexpr, V_SM: tl.constexpr, K_CODE: tl.constexpr, V_CODE: tl.constexpr,
                    K_ESC: tl.constexpr, V_ESC: tl.constexpr, K_RES: tl.constexpr, V_RES: tl.constexpr,
                    CHECK_OVF: tl.constexpr, DOT_F32: tl.constexpr, USE_ASM: tl.constexpr, PAGES: tl.constexpr,
                    FRESH: tl.constexpr, BLOCK_F: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    q0 = tl.program_id(2) * BLOCK_Q
    q_lo = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_lo
    if q0 < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        before = seq_len - q_len  # tokens cached before this step's queries
        r = tl.arange(0, ROWS)
        qi = q0 + r // G
        r_ok = (r < BLOCK_Q * G) & (qi < q_len)
        hq = h * G + r % G
        tok = (q_lo + qi).to(tl.int64)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + tok[:, None] * stride_q0 + hq[:, None] * stride_q1 + d[None, :], mask=r_ok[:, None],
                    other=0.0).to(tl.bfloat16)
        pos = before + qi  # each row's position: it sees keys 0..pos
        k_base, v_base = _head_bases(base_ptr, h, num_kv_heads, D)
        m_i = tl.full([ROWS], -1.0e30, tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        T: tl.constexpr = PAGES * B
        ROWS_B: tl.constexpr = B if PAGES > 1 else 0
        row = tl.arange(0, T)
        bt_row = block_table_ptr + seq.to(tl.int64) * bt_stride
        # keys from the pages: the cached prefix (FRESH), or every key the block sees
        paged = before if FRESH else tl.minimum(before + q0 + BLOCK_Q, seq_len)
        n_pages = tl.cdiv(paged, B)
        for p in range(0, n_pages, PAGES):
            if PAGES == 1:
                blk = tl.load(bt_row + p).to(tl.int64)
                kpos = p * B + row
                valid = kpos < seq_len
            else:  # PAGES pages a tile: a page pointer a row
                pidx = p + row // B
                blk = tl.load(bt_row + pidx, mask=pidx < n_pages, other=0).to(tl.int64)
                kpos = pidx * B + row % B
                valid = (pidx < n_pages) & (kpos < seq_len)
            if FRESH:
                valid = valid & (kpos < before)
            page_w = cache_w_ptr + (blk * num_kv_heads + h) * page_words
            k_ovf, v_ovf = _overflow_offsets(ovf_ptr, blk, h, valid, num_kv_heads, CHECK_OVF)
            kt = _decode_rows(page_w, valid, k_ovf, k_base, arena_w_ptr, arena_words, T, K_SM // 4, K_CODE // 4, D,
                              ROWS_B, K_ESC, K_RES, CHECK_OVF, USE_ASM)
            vt = _decode_rows(page_w, valid, v_ovf, v_base, arena_w_ptr, arena_words, T, V_SM // 4, V_CODE // 4, D,
                              ROWS_B, V_ESC, V_RES, CHECK_OVF, USE_ASM)
            mask = valid[None, :] & (kpos[None, :] <= pos[:, None])
            m_i, l_i, acc = _softmax_step(q, kt, vt, mask, valid, m_i, l_i, acc, scale_log2, DOT_F32)
        if FRESH:  # the step's own keys the block sees, as bf16 from the step's tensors
            f = tl.arange(0, BLOCK_F)
            n_fresh = tl.minimum(q0 + BLOCK_Q, q_len)
            for f0 in range(0, n_fresh, BLOCK_F):
                j = f0 + f
                valid = j < n_fresh
                src = (q_lo + j).to(tl.int64)[:, None] * stride_k0 + h * stride_k1 + d[None, :]
                kt = tl.load(key_ptr + src, mask=valid[:, None], other=0.0)
                vt = tl.load(val_ptr + src, mask=valid[:, None], other=0.0)
                mask = valid[None, :] & ((before + j)[None, :] <= pos[:, None])
                m_i, l_i, acc = _softmax_step(q, kt, vt, mask, valid, m_i, l_i, acc, scale_log2, DOT_F32)
        o = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_o0 + hq[:, None] * stride_o1 + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


def kv_prefill_attention(query: torch.Tensor, cache: torch.Tensor, layout: KVPageLayout, bases: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         max_query_len: int, scale: float, overflow: OverflowStore | None = None,
                         out: torch.Tensor | None = None, block_q: int | None = None, num_warps: int = 8,
                         pages: int = 1, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                         block_f: int = 32) -> torch.Tensor:
    """Causal attention of a varlen batch over its pages.

    query [total_q, Hq, D] bf16; query_start_loc int32 [S + 1] (sequence s's queries are rows
    query_start_loc[s]..[s + 1]); seq_lens int32 [S]: tokens in the pages per sequence, this step's
    included; `max_query_len` (host int) sizes the grid. cache, bases, block_table, overflow as for
    `kv_decode_attention`. key, value [total_q, H, D] bf16: the step's own K/V, row for row with the queries
    (already written to the pages); given, the kernel reads them instead of decoding their pages. block_q: query
    tokens a program (default: 256 rows of query heads, at least 1); pages: pages a tile; block_f: fresh keys a
    tile. The defaults are the H200's best of bench/gpu.py's sweep (docs/gpu.md). Returns out [total_q, Hq, D] in
    query's dtype.
    """
    H, G = _check_query(query, cache, layout)
    total, Hq, D = query.shape
    fresh = key is not None or value is not None
    if fresh:
        if key is None or value is None or key.shape != (total, H, D) or value.shape != key.shape:
            raise ValueError(f"key and value must both be [{total}, {H}, {D}] (the step's own, a row a query), "
                             f"not {None if key is None else tuple(key.shape)} / "
                             f"{None if value is None else tuple(value.shape)}")
        if key.dtype != torch.bfloat16 or value.dtype != torch.bfloat16:
            raise ValueError(f"key and value must be bf16 (the pages hold bf16), not {key.dtype} / {value.dtype}")
        if key.stride(2) != 1 or value.stride() != key.stride():
            key, value = key.contiguous(), value.contiguous()
    else:
        key = value = query  # unused (FRESH off)
    S = seq_lens.numel()
    if query_start_loc.numel() != S + 1:
        raise ValueError(f"query_start_loc needs {S + 1} entries for {S} sequences, not {query_start_loc.numel()}")
    if out is None:
        out = torch.empty_like(query)
    if total == 0 or S == 0:
        return out
    block_q = block_q or max(1, 256 // G)
    rows = max(16, triton.next_power_of_2(block_q * G))
    ovf_ptr, arena_w, check_ovf = _overflow_args(overflow, cache)
    _prefill_kernel[(S, H, triton.cdiv(max(1, max_query_len), block_q))](
        query, out, cache.view(-1).view(torch.int32), bases, ovf_ptr, arena_w, arena_w.numel(), block_table,
        seq_lens, query_start_loc, key, value, scale * 1.4426950408889634, query.stride(0), query.stride(1),
        out.stride(0), out.stride(1), key.stride(0), key.stride(1), block_table.stride(0), layout.page_bytes // 4, H,
        G=G, BLOCK_Q=block_q, ROWS=rows, D=D, B=layout.block_size, CHECK_OVF=check_ovf, DOT_F32=_INTERPRET,
        USE_ASM=not _INTERPRET, PAGES=pages, FRESH=fresh, BLOCK_F=block_f, num_warps=num_warps,
        **_offsets(layout))
    return out


def reference_prefill_attention(query: torch.Tensor, query_start_loc: torch.Tensor, keys: list[torch.Tensor],
                                values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """fp32 causal reference: keys/values per sequence [L, H, D], the step's queries at its last positions."""
    outs = []
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        q = query[int(query_start_loc[s]):int(query_start_loc[s + 1])].float()  # [q, Hq, D]
        g = q.shape[1] // k.shape[1]
        kk = k.float().repeat_interleave(g, dim=1)
        vv = v.float().repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q, kk) * scale
        pos = k.shape[0] - q.shape[0] + torch.arange(q.shape[0], device=k.device)
        later = torch.arange(k.shape[0], device=k.device)[None, None, :] > pos[None, :, None]
        scores = scores.masked_fill(later, float("-inf"))
        outs.append(torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), vv))
    return torch.cat(outs)


__all__ = ["kv_prefill_attention", "reference_prefill_attention"]
