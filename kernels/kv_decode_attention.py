"""Decode attention over Glyd's compressed KV pages (docs/format.md section 2), in Triton.

One program per (sequence, KV head, context split). It holds the G = q_heads / kv_heads query rows of its
KV head (padded to 16 rows for the tensor-core dot), the layer's exponent tables for that head packed as
two int32 words per channel (codes 0-3 and 4-6, one byte each: `pack_tables`), and walks its share of the
sequence's pages PAGES at a time. The decode runs on [tokens, D/32, 32] tiles (channel 32k + i at [.., k, i]),
so each code word broadcasts to its 32 channels without a layout change; only the finished bf16 tile is
reshaped to [tokens, D] for the dot:

  sign/mantissa rows      loads of k_sm / v_sm, VEC bytes wide (VEC also sets the channels a thread holds)
  code planes             one int32 word per 32 channels and plane
  exponent                prmt(lo, hi, code): byte `code` of the channel's 8-byte table (byte 7 = 0)
  escapes (code 7)        rank = prefix count of code-7 flags over the page in (token, channel) order:
                          a scan over the page's per-word escape popcounts plus popc of the lower
                          bits of the value's own word (plane0 & plane1 & plane2); byte `rank` of
                          the page's escape area, or arena byte offset + rank - reserve when
                          rank >= reserve. On the GPU this is one predicated inline-asm byte load a value
                          that picks the address itself (no branch; a tl.load gather there would also
                          force a one-channel-a-lane layout on the whole tile).
  bf16                    (sm & 0x80) << 8 | exp << 7 | (sm & 0x7f)

then an online softmax in fp32 (exp2), P·V with bf16 operands and fp32 accumulation. `prefetch` > 0
prefetches the pages `prefetch` tiles ahead into L2; `maxnreg` caps registers (occupancy). Long contexts are
split over programs; each split writes (o / l, m, l) and `_merge_kernel` combines the splits in a fixed
order, so the same inputs give the same bits on every run. Decoded pages never reach device memory.

`decode_pages` runs the same decoder (`_decode_half`) and writes the bf16 values, to check it bit for bit
against the torch reference `KVPageCodec.read`. `reference_attention` is the fp32 torch reference.
Under TRITON_INTERPRET=1 the inline-asm paths (prmt, popc, the escape load, prefetch) fall back to plain
Triton ops and `maxnreg` is dropped.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from glyd_engine.format.kv_page import KVPageLayout, OverflowStore

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SPLIT_MIN_PAGES = 8  # a split covers at least this many pages
TARGET_PROGRAMS = 528  # ~4 programs per H200 multiprocessor (132)


def pack_tables(decode_table: torch.Tensor) -> torch.Tensor:
    """uint8[..., D, 7] (code -> exponent) -> int32[..., D, 2]: codes 0-3 and codes 4-6 (+0), one byte each."""
    t = decode_table.to(torch.int64)
    pad = torch.zeros(*t.shape[:-1], 1, dtype=torch.int64, device=t.device)
    t = torch.cat([t, pad], dim=-1).view(*t.shape[:-1], 2, 4)
    words = (t << (8 * torch.arange(4, device=t.device))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).contiguous()


@triton.jit
def _popc(x, USE_ASM: tl.constexpr):
    if USE_ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return ((x * 0x01010101) >> 24) & 0xFF


@triton.jit
def _lookup(lo, hi, c, USE_ASM: tl.constexpr):
    """Exponent of 3-bit code c from the channel's table words (lo: codes 0-3, hi: codes 4-6 and a 0 byte)."""
    if USE_ASM:  # prmt picks byte c of hi:lo; selector nibbles 7 give hi's byte 3 (0) for the upper bytes
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, c | 0x7770],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (tl.where(c >= 4, hi, lo) >> ((c & 3) << 3)) & 0xFF


@triton.jit
def _load_byte_if(ptrs, mask, other, USE_ASM: tl.constexpr):
    """where(mask, *ptrs (uint8), other) as int32. The inline-asm form keeps the gather from anchoring the tile's
    layout (a tl.load of scattered bytes makes Triton lay the whole decode out one channel a lane)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u16 b; setp.ne.s32 p, $2, 0; mov.u32 $0, $3; "
            "@p ld.global.nc.u8 b, [$1]; @p cvt.u32.u16 $0, b; }",
            "=r,l,r,r", [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32), other], dtype=tl.int32,
            is_pure=True, pack=1)
    else:
        return tl.where(mask, tl.load(ptrs, mask=mask, other=0).to(tl.int32), other)


@triton.jit
def _load_word(ptrs, USE_ASM: tl.constexpr):
    """*ptrs (int32) through inline asm: like `_load_byte_if`, it leaves the layout to the tile's other operands."""
    if USE_ASM:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptrs.to(tl.int64, bitcast=True)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def _prefetch_l2(ptrs, mask):
    """prefetch.global.L2 of each masked-in address (GPU only: the result is a dummy)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l,r",
        [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _decode_half(cache_ptr, cache_w_ptr, arena_ptr, ovf_row_ptr, page_off, row, valid, lo, hi, kv_col,
                 SM_OFF: tl.constexpr, CODE_OFF: tl.constexpr, ESC_OFF: tl.constexpr, RES: tl.constexpr,
                 B: tl.constexpr, D: tl.constexpr, PAGES: tl.constexpr, CHECK_OVF: tl.constexpr,
                 USE_ASM: tl.constexpr, VEC: tl.constexpr = 16, OVF_BRANCH: tl.constexpr = False):
    """Decode K or V of PAGES pages: [T = PAGES*B, D] bf16.

    page_off (bytes), row (in page), valid and ovf_row_ptr (the page's `ptr[block, head]` pair) are [T];
    lo/hi are the packed table words [1, W, 32]. Everything runs on [T, W, 32] tiles (channel 32k + i
    at [.., k, i]) so that the code words broadcast to their 32 channels without a layout change; only
    the finished bf16 tile is reshaped to [T, D].
    """
    T: tl.constexpr = PAGES * B
    W: tl.constexpr = D // 32
    CB: tl.constexpr = 3 * D // 8
    i3 = tl.arange(0, 32)[None, None, :]
    # (i3 // VEC) * VEC + i3 % VEC == i3, written so that the compiler sees runs of VEC contiguous channels
    # only: that caps the sm load's vector width, and so the channels (and table words) a thread holds.
    ch = tl.arange(0, W)[None, :, None] * 32 + (i3 // VEC) * VEC + i3 % VEC  # [1, W, 32]
    po = page_off[:, None, None]
    sm = tl.load(cache_ptr + po + SM_OFF + row[:, None, None] * D + ch).to(tl.int32)
    # Code planes as int32 words: word k of plane p holds bit p of channels 32k..32k+31 (little endian).
    wbase = (page_off + CODE_OFF + row * CB) // 4
    k = tl.arange(0, W)[None, :]
    w0 = tl.load(cache_w_ptr + wbase[:, None] + k)  # [T, W]
    w1 = tl.load(cache_w_ptr + wbase[:, None] + W + k)
    w2 = tl.load(cache_w_ptr + wbase[:, None] + 2 * W + k)
    c = ((w0[:, :, None] >> i3) & 1) | (((w1[:, :, None] >> i3) & 1) << 1) | (((w2[:, :, None] >> i3) & 1) << 2)
    e = _lookup(tl.broadcast_to(lo, (T, W, 32)), tl.broadcast_to(hi, (T, W, 32)), c, USE_ASM)
    # Rank of each escape within its page, (token, channel) order: escapes of the earlier words of the
    # page (a scan over PAGES x B*W word counts) plus those below the channel in its own word (popcount).
    ew = w0 & w1 & w2  # [T, W]: bit i set = channel 32k+i escapes
    cnt = _popc(ew, USE_ASM)
    flat = tl.reshape(cnt, (PAGES, B * W))
    wpre = tl.reshape(tl.cumsum(flat, axis=1) - flat, (T, W))
    rank = wpre[:, :, None] + _popc(ew[:, :, None] & ((1 << i3) - 1), USE_ASM)
    is_esc = (c == 7) & valid[:, None, None]
    if USE_ASM and CHECK_OVF and not OVF_BRANCH:
        # One predicated byte load a value, from the page (rank < RES) or from the page's overflow run: the
        # address is picked inside the asm, so no branch keeps the tile alive (that cost ~60 registers).
        optr = tl.load(ovf_row_ptr + kv_col, mask=valid, other=-1)  # [T]
        obase = arena_ptr + ((optr >> 4).to(tl.int64) * 16 - RES)
        flag = is_esc & ((rank < RES) | (optr >= 0)[:, None, None])
        e = tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .u16 b; .reg .u64 a, o; setp.ne.s32 p, $4, 0; setp.lt.s32 q, $3, $5; "
            "selp.b64 a, $1, $2, q; cvt.s64.s32 o, $3; add.s64 a, a, o; mov.u32 $0, $6; "
            "@p ld.global.nc.u8 b, [a]; @p cvt.u32.u16 $0, b; }",
            "=r,l,l,r,r,r,r",
            [tl.broadcast_to((cache_ptr + page_off + ESC_OFF).to(tl.int64, bitcast=True)[:, None, None], (T, W, 32)),
             tl.broadcast_to(obase.to(tl.int64, bitcast=True)[:, None, None], (T, W, 32)), rank,
             flag.to(tl.int32), tl.full((T, W, 32), RES, tl.int32), e],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        in_page = is_esc & (rank < RES)
        e = _load_byte_if(cache_ptr + po + ESC_OFF + rank, in_page, e, USE_ASM)
        if CHECK_OVF:  # the arena only under a tile-uniform branch: ~2% of pages have an overflow run
            optr = tl.load(ovf_row_ptr + kv_col, mask=valid, other=-1)  # [T]
            if tl.max(optr, axis=0) >= 0:
                obase = (optr >> 4).to(tl.int64) * 16
                past = is_esc & (rank >= RES) & (optr >= 0)[:, None, None]
                e = _load_byte_if(arena_ptr + obase[:, None, None] + (rank - RES), past, e, USE_ASM)
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return tl.reshape(bits.to(tl.int16).to(tl.bfloat16, bitcast=True), (T, D))


@triton.jit
def _head_tables(tbl_ptr, h, num_kv_heads, D: tl.constexpr, USE_ASM: tl.constexpr):
    """KV head h's packed tables for K and V (lo, hi words a channel), as [1, D/32, 32] tiles kept in registers."""
    ch = tl.arange(0, D // 32)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    tk = tbl_ptr + (h * D + ch) * 2
    tv = tbl_ptr + ((num_kv_heads + h) * D + ch) * 2
    return _load_word(tk, USE_ASM), _load_word(tk + 1, USE_ASM), _load_word(tv, USE_ASM), _load_word(tv + 1, USE_ASM)


@triton.jit
def _softmax_step(q, kt, vt, mask, kvalid, m_i, l_i, acc, scale_log2, DOT_F32: tl.constexpr):
    """One tile of keys into the online softmax: scores q·kt masked (mask [rows, T]), P·V with bf16 operands and
    fp32 accumulation; rows of V past the fill (kvalid [T]) are zeroed, since garbage bits may be NaN."""
    if DOT_F32:  # the CPU interpreter multiplies bf16 dot operands as raw bits: widen them there
        s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32))) * scale_log2
    else:
        s = tl.dot(q, tl.trans(kt)) * scale_log2
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    vt = tl.where(kvalid[:, None], vt, 0.0)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16).to(tl.float32), vt.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), vt)
    return m_new, l_i, acc


@triton.jit
def _program_setup(q_ptr, seq_lens_ptr, stride_q0, stride_q1, pages_per_split, G: tl.constexpr,
                   BLOCK_G: tl.constexpr, D: tl.constexpr, B: tl.constexpr):
    """A decode program's (sequence, KV head, split), its page range and its G query rows (padded to BLOCK_G)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    p_start = split * pages_per_split
    p_end = tl.minimum(tl.cdiv(seq_len, B), p_start + pages_per_split)
    d = tl.arange(0, D)
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q0 + (h * G + g)[:, None] * stride_q1 + d[None, :],
                mask=gmask[:, None], other=0.0).to(tl.bfloat16)
    return seq, h, split, seq_len, p_start, p_end, q


@triton.jit
def _store_result(out_ptr, part_o_ptr, part_ml_ptr, acc, m_i, l_i, seq, h, split, stride_o0, stride_o1, num_kv_heads,
                  G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The program's rows: the output itself, or with a context split its (o / l, m, l) for `_merge_kernel`."""
    d = tl.arange(0, D)
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    hq = h * G + g
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq.to(tl.int64) * stride_o0 + hq[:, None] * stride_o1 + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        row_id = (seq.to(tl.int64) * (num_kv_heads * G) + hq) * NUM_SPLITS + split
        tl.store(part_o_ptr + row_id[:, None] * D + d[None, :], o, mask=gmask[:, None])
        tl.store(part_ml_ptr + row_id * 2, m_i, mask=gmask)
        tl.store(part_ml_ptr + row_id * 2 + 1, l_i, mask=gmask)


@triton.jit
def _attn_kernel(q_ptr, out_ptr, part_o_ptr, part_ml_ptr, cache_ptr, cache_w_ptr, tbl_ptr, ovf_ptr, arena_ptr,
                 block_table_ptr, seq_lens_ptr, scale_log2, stride_q0, stride_q1, stride_o0, stride_o1,
                 bt_stride, page_bytes, num_kv_heads, pages_per_split,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, B: tl.constexpr, PAGES: tl.constexpr,
                 K_SM: tl.constexpr, V_SM: tl.constexpr, K_CODE: tl.constexpr, V_CODE: tl.constexpr,
                 K_ESC: tl.constexpr, V_ESC: tl.constexpr, K_RES: tl.constexpr, V_RES: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, CHECK_OVF: tl.constexpr, DOT_F32: tl.constexpr,
                 USE_ASM: tl.constexpr, VEC: tl.constexpr, PREFETCH: tl.constexpr, OVF_BRANCH: tl.constexpr):
    T: tl.constexpr = PAGES * B
    seq, h, split, seq_len, p_start, p_end, q = _program_setup(q_ptr, seq_lens_ptr, stride_q0, stride_q1,
                                                               pages_per_split, G, BLOCK_G, D, B)
    k_lo, k_hi, v_lo, v_hi = _head_tables(tbl_ptr, h, num_kv_heads, D, USE_ASM)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    t = tl.arange(0, T)
    pg = t // B
    row = t % B
    ovf_head = ovf_ptr + h * 2
    for p0 in range(p_start, p_end, PAGES):
        pidx = p0 + pg
        pvalid = pidx < p_end
        blk = tl.load(block_table_ptr + seq.to(tl.int64) * bt_stride + pidx, mask=pvalid, other=0)
        blk64 = blk.to(tl.int64)
        page_off = (blk64 * num_kv_heads + h) * page_bytes
        valid = pvalid & (pidx * B + row < seq_len)
        ob = blk64 * num_kv_heads * 2
        if PREFETCH > 0:  # the whole page of the tile PREFETCH tiles ahead, into L2 (4 lines a token row)
            nidx = p0 + PREFETCH * PAGES + pg
            nvalid = nidx < p_end
            nblk = tl.load(block_table_ptr + seq.to(tl.int64) * bt_stride + nidx, mask=nvalid, other=0)
            rb = page_bytes // B
            noff = row[:, None] * rb + tl.arange(0, 4)[None, :] * 128
            npage = cache_ptr + (nblk.to(tl.int64) * num_kv_heads + h) * page_bytes
            _prefetch_l2(npage[:, None] + noff, nvalid[:, None] & (noff < page_bytes))
        kt = _decode_half(cache_ptr, cache_w_ptr, arena_ptr, ovf_head + ob, page_off, row, valid, k_lo, k_hi,
                          0, K_SM, K_CODE, K_ESC, K_RES, B, D, PAGES, CHECK_OVF, USE_ASM, VEC, OVF_BRANCH)
        vt = _decode_half(cache_ptr, cache_w_ptr, arena_ptr, ovf_head + ob, page_off, row, valid, v_lo, v_hi,
                          1, V_SM, V_CODE, V_ESC, V_RES, B, D, PAGES, CHECK_OVF, USE_ASM, VEC, OVF_BRANCH)
        m_i, l_i, acc = _softmax_step(q, kt, vt, valid[None, :], valid, m_i, l_i, acc, scale_log2, DOT_F32)
    _store_result(out_ptr, part_o_ptr, part_ml_ptr, acc, m_i, l_i, seq, h, split, stride_o0, stride_o1, num_kv_heads,
                  G, BLOCK_G, D, NUM_SPLITS)


@triton.jit
def _merge_kernel(out_ptr, part_o_ptr, part_ml_ptr, stride_o0, stride_o1, num_q_heads,
                  D: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    seq = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    smask = s < NUM_SPLITS
    d = tl.arange(0, D)
    base = (seq.to(tl.int64) * num_q_heads + hq) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + s) * 2, mask=smask, other=-1.0e30)
    l_ = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=smask, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.exp2(m - mx) * l_
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
    o = tl.load(part_o_ptr + (base + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    res = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o0 + hq * stride_o1 + d, res.to(out_ptr.dtype.element_ty))


def _offsets(layout: KVPageLayout) -> dict[str, int]:
    return {"K_SM": layout.sm_offset(0), "V_SM": layout.sm_offset(1), "K_CODE": layout.code_offset(0),
            "V_CODE": layout.code_offset(1), "K_ESC": layout.esc_offset(0), "V_ESC": layout.esc_offset(1),
            "K_RES": layout.reserve(0), "V_RES": layout.reserve(1)}


def _check(cache: torch.Tensor, layout: KVPageLayout) -> None:
    D, B = layout.head_size, layout.block_size
    if D % 32 or D & (D - 1):
        raise ValueError(f"the Triton KV kernels need a power-of-two head size >= 32, not {D}")
    if B % 16 or B & (B - 1):
        raise ValueError(f"the Triton KV kernels need a power-of-two block size >= 16, not {B}")
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != layout.page_bytes:
        raise ValueError(f"cache must be uint8 [num_blocks, H, {layout.page_bytes}], got {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous")


def _check_query(query: torch.Tensor, cache: torch.Tensor, layout: KVPageLayout) -> tuple[int, int]:
    """The cache and query as the attention kernels need them; returns (KV heads, query heads a KV head)."""
    _check(cache, layout)
    _, Hq, D = query.shape
    H = cache.shape[1]
    if Hq % H or layout.head_size != D:
        raise ValueError("query heads must be a multiple of KV heads and the head size must match the layout")
    if query.dtype != torch.bfloat16 or query.stride(2) != 1:
        raise ValueError(f"query must be bf16 with contiguous head dims (the pages hold bf16), not {query.dtype}")
    return H, Hq // H


def _overflow_args(overflow: OverflowStore | None, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    if overflow is None:
        dummy = torch.full((1,), -1, dtype=torch.int32, device=cache.device)
        return dummy, torch.zeros(16, dtype=torch.uint8, device=cache.device), False
    arena = overflow.arena if overflow.arena.numel() else torch.zeros(16, dtype=torch.uint8, device=cache.device)
    return overflow.ptr.contiguous(), arena, True


def num_splits_for(batch: int, num_kv_heads: int, max_seq_len: int, block_size: int, pages: int) -> int:
    """Context splits: enough programs to fill the GPU, each split at least SPLIT_MIN_PAGES pages."""
    max_pages = triton.cdiv(max(1, max_seq_len), block_size)
    want = triton.cdiv(TARGET_PROGRAMS, max(1, batch * num_kv_heads))
    cap = max(1, max_pages // max(SPLIT_MIN_PAGES, pages))
    return int(max(1, min(want, cap, 128)))


def split_plan(batch: int, num_kv_heads: int, max_seq_len: int, block_size: int, pages: int,
               num_splits: int | None) -> tuple[int, int]:
    """(context splits, pages a split, a multiple of `pages`) of a decode launch; num_splits None picks them."""
    if num_splits is None:
        num_splits = num_splits_for(batch, num_kv_heads, max_seq_len, block_size, pages)
    max_pages = triton.cdiv(max(1, max_seq_len), block_size)
    return num_splits, triton.cdiv(triton.cdiv(max_pages, num_splits), pages) * pages


def kv_decode_attention(query: torch.Tensor, cache: torch.Tensor, layout: KVPageLayout, tables: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                        overflow: OverflowStore | None = None, out: torch.Tensor | None = None,
                        num_splits: int | None = None, pages: int = 1, num_warps: int = 4, num_stages: int = 1,
                        vec: int = 4, prefetch: int = 1, maxnreg: int | None = 168,
                        scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                        ovf_branch: bool = False) -> torch.Tensor:
    """Decode attention, one query token per sequence.

    query [S, Hq, D] (bf16); cache uint8 [num_blocks, H, page_bytes] (vLLM's layer tensor viewed so);
    tables int32 [2, H, D, 2] from `pack_tables(decode_table_of_the_layer)`; block_table int32 [S, max_blocks];
    seq_lens int32 [S]; `max_seq_len` (host int) sizes the split. overflow: the layer's store, with `ptr` and
    `arena` on the cache's device (None: no page overflowed). Returns out [S, Hq, D] in query's dtype.
    Tuning (defaults: the best of bench/gpu.py's sweep on the H200 at 32 x 8k, 2026-11-30): pages a tile,
    num_warps, num_stages, vec (bytes a thread loads along channels: 4 or 16), prefetch (tiles ahead, 0 = off),
    maxnreg (register cap, None = ptxas's choice), ovf_branch (escape bytes from the page by one predicated load
    a value, the overflow arena only under a tile-uniform branch, instead of one load that picks page or arena
    per value: fewer instructions on the common path, more registers; slower on the H200, run 18 of docs/gpu.md).
    """
    H, G = _check_query(query, cache, layout)
    S, Hq, D = query.shape
    if out is None:
        out = torch.empty_like(query)
    num_splits, pages_per_split = split_plan(S, H, max_seq_len, layout.block_size, pages, num_splits)
    ovf_ptr, arena, check_ovf = _overflow_args(overflow, cache)
    if scratch is not None:
        part_o, part_ml = scratch
    elif num_splits > 1:
        part_o = torch.empty(S * Hq * num_splits * D, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(S * Hq * num_splits * 2, dtype=torch.float32, device=query.device)
    else:
        part_o = part_ml = out
    cache_w = cache.view(-1).view(torch.int32)
    _attn_kernel[(S, H, num_splits)](
        query, out, part_o, part_ml, cache, cache_w, tables, ovf_ptr, arena, block_table, seq_lens,
        scale * 1.4426950408889634, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), layout.page_bytes, H, pages_per_split,
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, B=layout.block_size, PAGES=pages,
        NUM_SPLITS=num_splits, CHECK_OVF=check_ovf, DOT_F32=_INTERPRET, USE_ASM=not _INTERPRET, VEC=vec,
        PREFETCH=0 if _INTERPRET else prefetch, OVF_BRANCH=ovf_branch, num_warps=num_warps, num_stages=num_stages,
        **({"maxnreg": maxnreg} if maxnreg and not _INTERPRET else {}), **_offsets(layout))
    if num_splits > 1:
        _merge_kernel[(S, Hq)](out, part_o, part_ml, out.stride(0), out.stride(1), Hq, D=D,
                               NUM_SPLITS=num_splits, S_PAD=max(2, triton.next_power_of_2(num_splits)))
    return out


@triton.jit
def _decode_pages_kernel(cache_ptr, cache_w_ptr, tbl_ptr, ovf_ptr, arena_ptr, blocks_ptr, out_k_ptr, out_v_ptr,
                         page_bytes, num_kv_heads,
                         D: tl.constexpr, B: tl.constexpr, K_SM: tl.constexpr, V_SM: tl.constexpr,
                         K_CODE: tl.constexpr, V_CODE: tl.constexpr, K_ESC: tl.constexpr, V_ESC: tl.constexpr,
                         K_RES: tl.constexpr, V_RES: tl.constexpr, CHECK_OVF: tl.constexpr,
                         USE_ASM: tl.constexpr, OVF_BRANCH: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    row = tl.arange(0, B)
    blk = tl.load(blocks_ptr + n).to(tl.int64)
    page_off = (blk * num_kv_heads + h) * page_bytes + row * 0
    valid = row < B
    ob = ovf_ptr + (blk * num_kv_heads + h) * 2 + row * 0
    ch = tl.arange(0, D // 32)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]  # [1, W, 32]
    tk = tbl_ptr + (h * D + ch) * 2
    tv = tbl_ptr + ((num_kv_heads + h) * D + ch) * 2
    kt = _decode_half(cache_ptr, cache_w_ptr, arena_ptr, ob, page_off, row, valid, tl.load(tk), tl.load(tk + 1),
                      0, K_SM, K_CODE, K_ESC, K_RES, B, D, 1, CHECK_OVF, USE_ASM, OVF_BRANCH=OVF_BRANCH)
    vt = _decode_half(cache_ptr, cache_w_ptr, arena_ptr, ob, page_off, row, valid, tl.load(tv), tl.load(tv + 1),
                      1, V_SM, V_CODE, V_ESC, V_RES, B, D, 1, CHECK_OVF, USE_ASM, OVF_BRANCH=OVF_BRANCH)
    o = ((n * num_kv_heads + h) * B + row[:, None]) * D + d[None, :]
    tl.store(out_k_ptr + o, kt)
    tl.store(out_v_ptr + o, vt)


def decode_pages(cache: torch.Tensor, layout: KVPageLayout, tables: torch.Tensor, blocks: torch.Tensor,
                 overflow: OverflowStore | None = None, ovf_branch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Debug/check path: decode whole pages to (K, V) [N, H, B, D] bf16 with the attention kernel's decoder.

    Same contract as `KVPageCodec.read` (rows past a page's fill are garbage and may differ from it).
    """
    _check(cache, layout)
    H = cache.shape[1]
    B, D = layout.block_size, layout.head_size
    n = blocks.numel()
    out_k = torch.empty(n, H, B, D, dtype=torch.bfloat16, device=cache.device)
    out_v = torch.empty_like(out_k)
    if n == 0:
        return out_k, out_v
    ovf_ptr, arena, check_ovf = _overflow_args(overflow, cache)
    _decode_pages_kernel[(n, H)](cache, cache.view(-1).view(torch.int32), tables, ovf_ptr, arena,
                                 blocks.to(torch.int32), out_k, out_v, layout.page_bytes, H, D=D, B=B,
                                 CHECK_OVF=check_ovf, USE_ASM=not _INTERPRET, OVF_BRANCH=ovf_branch,
                                 **_offsets(layout))
    return out_k, out_v


def reference_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        scale: float) -> torch.Tensor:
    """fp32 torch reference: query [S, Hq, D]; keys/values per sequence [L, H, D]. Returns fp32 [S, Hq, D]."""
    outs = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        q = query[i].float()  # [Hq, D]
        g = q.shape[0] // k.shape[1]
        kk = k.float().repeat_interleave(g, dim=1)  # [L, Hq, D]
        vv = v.float().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q, kk) * scale
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, vv))
    return torch.stack(outs)


__all__ = ["decode_pages", "kv_decode_attention", "num_splits_for", "pack_tables", "reference_attention", "split_plan"]
