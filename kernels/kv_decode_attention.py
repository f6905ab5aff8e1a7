"""Decode attention over Glyd's compressed KV pages (docs/format.md section 2), in Triton.

One program per (sequence, KV head, context split). It holds the G = q_heads / kv_heads query rows of its
KV head (padded to 16 rows for the tensor-core dot) and the tops of its channels' exponent windows (one byte
a channel, four to a word: `pack_bases`), and walks its share of the sequence's pages PAGES at a time. The
page format is made for this decoder: it works on 32-bit words of 4 values, [T tokens, D/32 groups, 8 words]
tiles (word j of group g holds channels 32g + 4j .. 32g + 4j + 3):

  codes          one rotate and one mask a plane give the 3-bit codes of the word's 4 channels as bytes (C4)
  exponents      E4 = TOP4 - C4, one 32-bit subtraction (tops >= 7: no byte borrows)
  escapes        code 7: a word's first rank is its (token, group)'s page prefix (a scan over the tile's
                 [rows, groups] popcounts of plane0 & plane1 & plane2) plus the popcount of its group's flags
                 below it; its escape bytes are four bytes of the page's escape area at that rank (two aligned
                 loads and a funnel shift), spread onto the flagged bytes by one byte permute (`prmt`). Ranks
                 past the page's reserve read the page's overflow run the same way (only when the layer has
                 one: CHECK_OVF), byte by byte merged.
  bf16           two byte permutes turn E4 and the sign/mantissa word into two bf16 pairs

then an online softmax in fp32 (exp2), P·V with bf16 operands and fp32 accumulation. `prefetch` puts the next
tile's pages into L2 while this one decodes. Long contexts are split over programs; each split writes
(o / l, m, l) and `_merge_kernel` combines the splits in a fixed order, so the same inputs give the same bits
on every run. Decoded pages never reach device memory.

`decode_pages` runs the same decoder (`_decode_rows`) and writes the bf16 values, to check it bit for bit
against the torch reference `KVPageCodec.read`. `reference_attention` is the fp32 torch reference.
Under TRITON_INTERPRET=1 the inline-asm paths (prmt, popc, shf, prefetch) fall back to plain Triton ops.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from glyd_engine.format.kv_page import KVPageLayout, OverflowStore, window_bases

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SPLIT_MIN_PAGES = 8  # a split covers at least this many pages
TARGET_PROGRAMS = 528  # ~4 programs per H200 multiprocessor (132)
_HI_BITS: tl.constexpr = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: each byte's top bit


def pack_bases(decode_table: torch.Tensor) -> torch.Tensor:
    """uint8 [2, H, D, 7] window decode tables -> int32 [2, H, D/4]: the tops, byte b of word w = channel 4w + b."""
    return window_bases(decode_table).contiguous().view(torch.int32)


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
def _prefetch_l2(ptrs, mask):
    """prefetch.global.L2 of each masked-in address (GPU only: the result is a dummy)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l,r",
        [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rotr(x, s, USE_ASM: tl.constexpr):
    """x rotated right by s (0..31) bits."""
    if USE_ASM:
        return tl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $1, $2;", "=r,r,r", [x, s], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        u = x.to(tl.uint32, bitcast=True)
        r = (u >> s.to(tl.uint32)) | (u << ((32 - s) % 32).to(tl.uint32))
        return r.to(tl.int32, bitcast=True)


@triton.jit
def _pairs(lo4, hi4, USE_ASM: tl.constexpr):
    """Low/high bf16 bytes of 4 channels (byte b = channel b) -> two words of bf16 pairs (channels 0,1 and 2,3)."""
    if USE_ASM:
        p01 = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5140;", "=r,r,r", [lo4, hi4], dtype=tl.int32,
                                        is_pure=True, pack=1)
        p23 = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7362;", "=r,r,r", [lo4, hi4], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        p01 = (lo4 & 0xFF) | ((hi4 & 0xFF) << 8) | ((lo4 & 0xFF00) << 8) | ((hi4 & 0xFF00) << 16)
        p23 = ((lo4 >> 16) & 0xFF) | (((hi4 >> 16) & 0xFF) << 8) | (((lo4 >> 24) & 0xFF) << 16) | (
            ((hi4 >> 24) & 0xFF) << 24)
    return p01, p23


@triton.jit
def _funnel(lo, hi, sh, USE_ASM: tl.constexpr):
    """(hi:lo) >> sh for sh in 0..31: four bytes from any byte offset of two aligned words."""
    if USE_ASM:
        return tl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, sh],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        w = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
        return (w >> sh.to(tl.int64)).to(tl.int32)


@triton.jit
def _select_bytes(x, sel, USE_ASM: tl.constexpr):
    """Byte b of the result is byte (nibble b of sel) & 3 of x (prmt with x as both sources)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, $2;", "=r,r,r", [x, sel], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        out = tl.zeros_like(x)
        for b in tl.static_range(4):
            idx = (sel >> (4 * b)) & 3
            out = out | (((x >> (8 * idx)) & 0xFF) << (8 * b))
        return out


@triton.jit
def _overflow_bytes(x, r, f4, has, arena_w, arena_words, ovf_off, RES: tl.constexpr, USE_ASM: tl.constexpr):
    """x with its bytes of rank >= RES taken from the page's overflow run: arena byte off + rank - RES."""
    k = _popc(f4, USE_ASM)  # escapes in the word
    a2 = ovf_off + r - RES
    w2 = a2 >> 2
    past = has & (r + k > RES) & (ovf_off >= 0)
    # each word bounded by itself: a run may end at the arena's last word (a word wholly before the run is unused)
    lo2 = tl.load(arena_w + w2, mask=past & (r >= RES) & (w2 < arena_words), other=0)
    hi2 = tl.load(arena_w + w2 + 1, mask=past & ((a2 & 3) + k > 4) & (w2 + 1 < arena_words), other=0)
    x2 = _funnel(lo2, hi2, (a2 & 3) * 8, USE_ASM)
    n_in = tl.maximum(RES - r, 0)  # leading bytes from the page
    m2 = tl.where(n_in >= 4, 0, (n_in * 0 - 1) << (tl.minimum(n_in, 3) * 8))
    return (x & ~m2) | (x2 & m2)


@triton.jit
def _escapes(e4, fg, j, valid, base3, arena_w, arena_words, ovf_off, any_run, T: tl.constexpr, W: tl.constexpr,
             NP: tl.constexpr, ESC_B: tl.constexpr, RES: tl.constexpr, CHECK_OVF: tl.constexpr,
             OVF_BRANCH: tl.constexpr, USE_ASM: tl.constexpr):
    """e4 [T, W, 8] with each escape's exponent put in its byte (see the module docstring). fg [T, W]: bit 8b + j
    set = channel 4j + b of the group escapes; valid [T, 1, 1]: rows holding data (others may be garbage and are
    never fetched from); ovf_off [T, 1, 1]: the row's page's overflow run (byte offset, -1 for none). Arena loads
    stay inside its `arena_words` words whatever garbage rows hold. OVF_BRANCH: the arena only under a branch
    on `any_run` (some row of the tile has a run), which is uniform over the program."""
    cnt = _popc(fg, USE_ASM)
    flat = tl.reshape(cnt, (NP, T * W // NP))
    base = tl.reshape(tl.cumsum(flat, axis=1) - flat, (T, W))  # escapes of the page before this (token, group)
    low = 0x01010101 * ((1 << j) - 1)  # [1, 1, 8]: the group's channels below word j
    r = base[:, :, None] + _popc(fg[:, :, None] & low, USE_ASM)  # [T, W, 8] the word's first rank
    f4 = (fg[:, :, None] >> j) & 0x01010101  # flag of channel 4j + b at bit 0 of byte b
    has = (f4 != 0) & valid
    in_page = has & (r < RES)
    a = ESC_B + r  # byte offset in the page
    wa = a >> 2
    lo = tl.load(base3 + wa, mask=in_page, other=0)
    hi = tl.load(base3 + wa + 1, mask=in_page & ((wa + 1) * 4 < ESC_B + RES), other=0)
    x = _funnel(lo, hi, (a & 3) * 8, USE_ASM)  # the word's escape bytes, in order
    if CHECK_OVF:
        if OVF_BRANCH:
            if any_run:
                x = _overflow_bytes(x, r, f4, has, arena_w, arena_words, ovf_off, RES, USE_ASM)
        else:
            x = _overflow_bytes(x, r, f4, has, arena_w, arena_words, ovf_off, RES, USE_ASM)
    pf = f4 * 0x01010100  # byte b: flags below b (the escape's index within the word)
    sel = ((pf >> 4) & 0xF0) | ((pf >> 8) & 0xF00) | ((pf >> 12) & 0xF000)
    m = f4 * 0xFF
    return (e4 & ~m) | (_select_bytes(x, sel, USE_ASM) & m)


@triton.jit
def _decode_rows(page_w, valid, ovf_off, base4, arena_w, arena_words, T: tl.constexpr, SM_W: tl.constexpr,
                 CODE_W: tl.constexpr,
                 D: tl.constexpr, B: tl.constexpr, ESC_B: tl.constexpr, RES: tl.constexpr, CHECK_OVF: tl.constexpr,
                 USE_ASM: tl.constexpr, OVF_BRANCH: tl.constexpr = True):
    """T rows of K or V -> [T, D] bf16. page_w: one page's first int32 word (B = 0: rows 0..T-1 of that page),
    or [T] such pointers, a row's page each (row t is row t % B of its page). valid, ovf_off: [T]."""
    W: tl.constexpr = D // 32
    t = tl.arange(0, T)[:, None, None]
    g = tl.arange(0, W)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    t2 = tl.arange(0, T)[:, None]
    g2 = tl.arange(0, W)[None, :]
    if B > 0:
        base3 = page_w[:, None, None]
        base2 = page_w[:, None]
        t = t % B
        t2 = t2 % B
    else:
        base3 = page_w
        base2 = page_w
    s4 = tl.load(base3 + SM_W + t * (D // 4) + g * 8 + j)  # [T, W, 8]
    CW: tl.constexpr = 3 * D // 32  # code words a row
    p0w = tl.load(base2 + CODE_W + t2 * CW + g2)  # [T, W]
    p1w = tl.load(base2 + CODE_W + t2 * CW + W + g2)
    p2w = tl.load(base2 + CODE_W + t2 * CW + 2 * W + g2)
    p0, p1, p2 = p0w[:, :, None], p1w[:, :, None], p2w[:, :, None]
    c4 = ((_rotr(p0, j, USE_ASM) & 0x01010101) | (_rotr(p1, (j + 31) % 32, USE_ASM) & 0x02020202)
          | (_rotr(p2, (j + 30) % 32, USE_ASM) & 0x04040404))
    e4 = base4 - c4  # bytes: top >= the largest code, no borrow
    if RES > 0 or CHECK_OVF:
        NP: tl.constexpr = T // B if B > 0 else 1
        any_run = tl.max(ovf_off, axis=0) >= 0
        e4 = _escapes(e4, p0w & p1w & p2w, j, valid[:, None, None], base3, arena_w, arena_words,
                      ovf_off[:, None, None], any_run, T, W, NP, ESC_B, RES, CHECK_OVF, OVF_BRANCH, USE_ASM)
    lo4 = ((e4 << 7) & _HI_BITS) | (s4 & 0x7F7F7F7F)  # e bit 0, then the mantissa
    hi4 = (s4 & _HI_BITS) | ((e4 >> 1) & 0x7F7F7F7F)  # sign, then e bits 7..1
    p01, p23 = _pairs(lo4, hi4, USE_ASM)
    pairs = tl.join(p01, p23)  # [T, W, 8, 2]
    vals = tl.join((pairs & 0xFFFF).to(tl.int16), (pairs >> 16).to(tl.int16))  # [T, W, 8, 2, 2]
    return tl.reshape(vals, (T, D)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _overflow_offsets(ovf_ptr, blk, h, valid, num_kv_heads, CHECK_OVF: tl.constexpr):
    """[T] byte offsets of the rows' pages' overflow runs for K and V (-1: none), from `OverflowStore.ptr`."""
    if CHECK_OVF:
        o = ovf_ptr + (blk * num_kv_heads + h) * 2 + valid.to(tl.int64) * 0  # [T] even for one page a tile
        pk = tl.load(o, mask=valid, other=-1)
        pv = tl.load(o + 1, mask=valid, other=-1)
        return tl.where(pk >= 0, (pk >> 4) * 16, -1), tl.where(pv >= 0, (pv >> 4) * 16, -1)
    else:
        none = tl.full(valid.shape, -1, tl.int32)
        return none, none


@triton.jit
def _head_bases(base_ptr, h, num_kv_heads, D: tl.constexpr):
    """KV head h's window tops for K and V as [1, D/32, 8] words (4 channels each), kept in registers."""
    wi = tl.arange(0, D // 32)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    return tl.load(base_ptr + h * (D // 4) + wi), tl.load(base_ptr + (num_kv_heads + h) * (D // 4) + wi)


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
def _attn_kernel(q_ptr, out_ptr, part_o_ptr, part_ml_ptr, cache_w_ptr, base_ptr, ovf_ptr, arena_w_ptr, arena_words,
                 block_table_ptr, seq_lens_ptr, scale_log2, stride_q0, stride_q1, stride_o0, stride_o1, bt_stride,
                 page_words, num_kv_heads, pages_per_split, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                 B: tl.constexpr, PAGES: tl.constexpr, K_SM: tl.constexpr, V_SM: tl.constexpr, K_CODE: tl.constexpr,
                 V_CODE: tl.constexpr, K_ESC: tl.constexpr, V_ESC: tl.constexpr, K_RES: tl.constexpr,
                 V_RES: tl.constexpr, NUM_SPLITS: tl.constexpr, CHECK_OVF: tl.constexpr, DOT_F32: tl.constexpr,
                 USE_ASM: tl.constexpr, PREFETCH: tl.constexpr, PAGE_LINES: tl.constexpr, OVF_BRANCH: tl.constexpr):
    seq, h, split, seq_len, p_start, p_end, q = _program_setup(q_ptr, seq_lens_ptr, stride_q0, stride_q1,
                                                               pages_per_split, G, BLOCK_G, D, B)
    k_base, v_base = _head_bases(base_ptr, h, num_kv_heads, D)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    head_w = cache_w_ptr + h * page_words
    bt_row = block_table_ptr + seq.to(tl.int64) * bt_stride
    T: tl.constexpr = PAGES * B
    ROWS_B: tl.constexpr = B if PAGES > 1 else 0
    row = tl.arange(0, T)
    for p in range(p_start, p_end, PAGES):
        if PAGES == 1:
            blk = tl.load(bt_row + p).to(tl.int64)
            page_w = head_w + blk * num_kv_heads * page_words  # the page's first word (a scalar pointer)
            valid = p * B + row < seq_len
        else:  # PAGES pages a tile: a page pointer a row
            pidx = p + row // B
            blk = tl.load(bt_row + pidx, mask=pidx < p_end, other=0).to(tl.int64)
            page_w = head_w + blk * num_kv_heads * page_words
            valid = (pidx < p_end) & (pidx * B + row % B < seq_len)
        if PREFETCH:  # the next tile's pages into L2 while this one decodes (a 128-byte line a lane)
            lines = tl.arange(0, PAGE_LINES)
            for i in tl.static_range(PAGES):
                nxt = tl.load(bt_row + p + PAGES + i, mask=p + PAGES + i < p_end, other=0).to(tl.int64)
                ok = (lines * 32 < page_words) & (p + PAGES + i < p_end)
                _prefetch_l2(head_w + nxt * num_kv_heads * page_words + lines * 32, ok)
        k_ovf, v_ovf = _overflow_offsets(ovf_ptr, blk, h, valid, num_kv_heads, CHECK_OVF)
        kt = _decode_rows(page_w, valid, k_ovf, k_base, arena_w_ptr, arena_words, T, K_SM // 4, K_CODE // 4, D, ROWS_B,
                          K_ESC, K_RES, CHECK_OVF, USE_ASM, OVF_BRANCH)
        vt = _decode_rows(page_w, valid, v_ovf, v_base, arena_w_ptr, arena_words, T, V_SM // 4, V_CODE // 4, D, ROWS_B,
                          V_ESC, V_RES, CHECK_OVF, USE_ASM, OVF_BRANCH)
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
    """(ptr, arena as int32 words, CHECK_OVF): the store's, or dummies when no page has overflowed."""
    if overflow is None or overflow.arena.numel() == 0:
        dummy = torch.full((1,), -1, dtype=torch.int32, device=cache.device)
        return dummy, torch.zeros(4, dtype=torch.int32, device=cache.device), False
    return overflow.ptr.contiguous(), overflow.arena.view(torch.int32), True


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


def decode_config(batch: int, num_kv_heads: int) -> tuple[int, int]:
    """(pages a tile, warps) of a decode launch: the H200's best in bench/gpu.py (docs/gpu.md, run 28): 4 warps
    a program but at the largest batches, where 2 warps let more programs share a multiprocessor."""
    return (2, 2) if batch * num_kv_heads >= 1024 else (2, 4)


def kv_decode_attention(query: torch.Tensor, cache: torch.Tensor, layout: KVPageLayout, bases: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                        overflow: OverflowStore | None = None, out: torch.Tensor | None = None,
                        num_splits: int | None = None, pages: int | None = None, num_warps: int | None = None,
                        num_stages: int = 1, prefetch: bool = True, ovf_branch: bool = True,
                        scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence.

    query [S, Hq, D] (bf16); cache uint8 [num_blocks, H, page_bytes] (vLLM's layer tensor viewed so);
    bases int32 [2, H, D/4] from `pack_bases(decode_table_of_the_layer)`; block_table int32 [S, max_blocks];
    seq_lens int32 [S]; `max_seq_len` (host int) sizes the split. overflow: the layer's store, with `ptr` and
    `arena` on the cache's device (None: no page overflowed). Returns out [S, Hq, D] in query's dtype.
    Tuning: pages a tile, num_warps, num_stages, prefetch (the next tile into L2), ovf_branch (the overflow arena
    only in tiles with a run, under a branch); None: `decode_config`'s.
    """
    H, G = _check_query(query, cache, layout)
    S, Hq, D = query.shape
    if pages is None or num_warps is None:
        auto_pages, auto_warps = decode_config(S, H)
        pages, num_warps = pages or auto_pages, num_warps or auto_warps
    if out is None:
        out = torch.empty_like(query)
    num_splits, pages_per_split = split_plan(S, H, max_seq_len, layout.block_size, pages, num_splits)
    ovf_ptr, arena_w, check_ovf = _overflow_args(overflow, cache)
    if scratch is not None:
        part_o, part_ml = scratch
    elif num_splits > 1:
        part_o = torch.empty(S * Hq * num_splits * D, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(S * Hq * num_splits * 2, dtype=torch.float32, device=query.device)
    else:
        part_o = part_ml = out
    _attn_kernel[(S, H, num_splits)](
        query, out, part_o, part_ml, cache.view(-1).view(torch.int32), bases, ovf_ptr, arena_w, arena_w.numel(),
        block_table, seq_lens,
        scale * 1.4426950408889634, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), layout.page_bytes // 4, H, pages_per_split,
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, B=layout.block_size, PAGES=pages,
        NUM_SPLITS=num_splits, CHECK_OVF=check_ovf, DOT_F32=_INTERPRET, USE_ASM=not _INTERPRET,
        PREFETCH=prefetch and not _INTERPRET, PAGE_LINES=triton.next_power_of_2(triton.cdiv(layout.page_bytes, 128)),
        OVF_BRANCH=ovf_branch, num_warps=num_warps, num_stages=num_stages, **_offsets(layout))
    if num_splits > 1:
        _merge_kernel[(S, Hq)](out, part_o, part_ml, out.stride(0), out.stride(1), Hq, D=D,
                               NUM_SPLITS=num_splits, S_PAD=max(2, triton.next_power_of_2(num_splits)))
    return out


@triton.jit
def _decode_pages_kernel(cache_w_ptr, base_ptr, ovf_ptr, arena_w_ptr, arena_words, blocks_ptr, out_k_ptr, out_v_ptr,
                         page_words,
                         num_kv_heads, D: tl.constexpr, B: tl.constexpr, K_SM: tl.constexpr, V_SM: tl.constexpr,
                         K_CODE: tl.constexpr, V_CODE: tl.constexpr, K_ESC: tl.constexpr, V_ESC: tl.constexpr,
                         K_RES: tl.constexpr, V_RES: tl.constexpr, CHECK_OVF: tl.constexpr, USE_ASM: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.arange(0, B)
    d = tl.arange(0, D)
    blk = tl.load(blocks_ptr + n).to(tl.int64)
    page_w = cache_w_ptr + (blk * num_kv_heads + h) * page_words
    valid = row < B  # whole pages: rows past a page's fill decode to garbage, as `KVPageCodec.read` says
    k_ovf, v_ovf = _overflow_offsets(ovf_ptr, blk, h, valid, num_kv_heads, CHECK_OVF)
    k_base, v_base = _head_bases(base_ptr, h, num_kv_heads, D)
    kt = _decode_rows(page_w, valid, k_ovf, k_base, arena_w_ptr, arena_words, B, K_SM // 4, K_CODE // 4, D, 0, K_ESC,
                      K_RES, CHECK_OVF, USE_ASM)
    vt = _decode_rows(page_w, valid, v_ovf, v_base, arena_w_ptr, arena_words, B, V_SM // 4, V_CODE // 4, D, 0, V_ESC,
                      V_RES, CHECK_OVF, USE_ASM)
    o = ((n * num_kv_heads + h) * B + row[:, None]) * D + d[None, :]
    tl.store(out_k_ptr + o, kt)
    tl.store(out_v_ptr + o, vt)


def decode_pages(cache: torch.Tensor, layout: KVPageLayout, bases: torch.Tensor, blocks: torch.Tensor,
                 overflow: OverflowStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Debug/check path: decode whole pages to (K, V) [N, H, B, D] bf16 with the attention kernel's decoder.

    Rows past a page's fill are garbage (as with `KVPageCodec.read`) and may differ from its.
    """
    _check(cache, layout)
    H = cache.shape[1]
    B, D = layout.block_size, layout.head_size
    n = blocks.numel()
    out_k = torch.empty(n, H, B, D, dtype=torch.bfloat16, device=cache.device)
    out_v = torch.empty_like(out_k)
    if n == 0:
        return out_k, out_v
    ovf_ptr, arena_w, check_ovf = _overflow_args(overflow, cache)
    _decode_pages_kernel[(n, H)](cache.view(-1).view(torch.int32), bases, ovf_ptr, arena_w, arena_w.numel(),
                                 blocks.to(torch.int32),
                                 out_k, out_v, layout.page_bytes // 4, H, D=D, B=B, CHECK_OVF=check_ovf,
                                 USE_ASM=not _INTERPRET, **_offsets(layout))
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


__all__ = ["decode_config", "decode_pages", "kv_decode_attention", "num_splits_for", "pack_bases",
           "reference_attention", "split_plan"]
