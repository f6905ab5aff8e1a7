"""EXPERIMENT (not used by the backend): decode attention over a proposed KV page layout decoded 4 values a word.

Why: `kv_decode_attention` spends ~49 thread instructions a decoded value (docs/gpu.md); the speed bars need
~5-7. This kernel measures what the fast path costs when the page layout is made for word-wide (SWAR) decoding:

- exponent tables are windows: code c in 0..6 stands for exponent base - c (one base byte a channel), so four
  exponents are one byte-wise subtraction `BASE4 - C4` instead of four table lookups (on the demo model's K/V a
  7-wide window escapes as often as the 7 most frequent exponents: 2.2-3.3% against 2.2-3.3%);
- code planes keep their bytes but each 32-bit word holds its 32 channels transposed: bit 8b + j of plane p's
  word k is bit p of channel 32k + 4j + b, so the codes of channels 4j..4j+3 come out as bytes with one rotate
  and one mask a plane.

A program holds [T tokens, W = D/32 groups, 8 words] tiles of sign/mantissa words (4 channels each); per word:
C4 from the three planes, E4 = BASE4 - C4, the two bf16 pairs by byte permutes (`prmt`), then the pairs are
joined into the [T, D] tile for the dot (channel = 32 g + 4 j + 2 h + half). Escapes (code 7): with
`escapes=True` (the default, 3-bit layout) each word's escapes are read from the page's escape area by rank and put
in place (`_escapes`); with `escapes=False` they come out as base - 7, which times the fast path alone. Pages must
hold all their escapes (the experiment has no overflow path, so it is not a product kernel). The 4-bit variant
(`NibbleLayout`) never decodes its escapes. `decode_pages_swar` and the tests check pages bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from glyd_engine.format.kv_page import KVPageLayout
from kernels.kv_decode_attention import (
    _check_query,
    _merge_kernel,
    _popc,
    _prefetch_l2,
    _program_setup,
    _softmax_step,
    _store_result,
    split_plan,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class NibbleLayout(KVPageLayout):
    """The experiment's second variant: 4-bit codes (a 15-exponent window, code 15 = escape), 1.5 bytes a value
    before escapes, which are then rare (0.03-0.24% of the demo model's K/V). Code byte 4m + b of a row holds
    channel 8m + b in its low nibble and channel 8m + 4 + b in its high one."""

    @property
    def code_bytes(self) -> int:
        return self.head_size // 2

    @property
    def token_bytes(self) -> int:
        return 2 * (self.head_size + self.code_bytes) + self.k_escapes + self.v_escapes
_HI_BITS: tl.constexpr = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: each byte's top bit


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
def _escapes(e4, p0w, p1w, p2w, base3, j, T: tl.constexpr, W: tl.constexpr, NP: tl.constexpr, ESC_B: tl.constexpr,
             RES: tl.constexpr, USE_ASM: tl.constexpr):
    """e4 [T, W, 8] with each escape's exponent put in its byte. The escapes of a page are its escape area's bytes
    in (token, channel) order: a word's first rank is the page prefix of its (token, group) plus the flags of the
    group's lower words; its escapes are the next k bytes, spread onto its flagged bytes by one byte permute.
    Escapes past the reserve (the overflow arena) are not handled by the experiment."""
    fg = p0w & p1w & p2w  # [T, W]: bit 8b + j set = channel 4j + b of the group escapes
    cnt = _popc(fg, USE_ASM)
    flat = tl.reshape(cnt, (NP, T * W // NP))
    base = tl.reshape(tl.cumsum(flat, axis=1) - flat, (T, W))  # escapes of the page before this (token, group)
    low = 0x01010101 * ((1 << j) - 1)  # [1, 1, 8]: the group's channels below word j
    r = base[:, :, None] + _popc(fg[:, :, None] & low, USE_ASM)  # [T, W, 8] the word's first rank
    f4 = (fg[:, :, None] >> j) & 0x01010101  # flag of channel 4j + b at bit 0 of byte b
    has = f4 != 0
    a = ESC_B + r  # byte offset in the page
    wa = a >> 2
    lo = tl.load(base3 + wa, mask=has, other=0)
    hi = tl.load(base3 + wa + 1, mask=has & ((wa + 1) * 4 < ESC_B + RES), other=0)
    x = _funnel(lo, hi, (a & 3) * 8, USE_ASM)  # the word's escape bytes, in order
    pf = f4 * 0x01010100  # byte b: flags below b (the escape's index within the word)
    sel = ((pf >> 4) & 0xF0) | ((pf >> 8) & 0xF00) | ((pf >> 12) & 0xF000)
    m = f4 * 0xFF
    return (e4 & ~m) | (_select_bytes(x, sel, USE_ASM) & m)


@triton.jit
def _decode_swar(page_w, base4, T: tl.constexpr, SM_W: tl.constexpr, CODE_W: tl.constexpr, D: tl.constexpr,
                 USE_ASM: tl.constexpr, NIB: tl.constexpr = False, B: tl.constexpr = 0, ESC_B: tl.constexpr = 0,
                 RES: tl.constexpr = 0):
    """Rows of K or V -> [T, D] bf16 (escapes not decoded). page_w: one page's first int32 word (B = 0: rows
    0..T-1 of that page), or [T] such pointers, a row's page each (row t is row t % B of its page)."""
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
    if NIB:  # word j's codes are the low or high nibbles of code word (32g + 4j) // 8
        nw = tl.load(base3 + CODE_W + t * (D // 8) + g * 4 + j // 2)
        c4 = (nw >> ((j % 2) * 4)) & 0x0F0F0F0F
    else:
        CW: tl.constexpr = 3 * D // 32  # code words a row
        p0w = tl.load(base2 + CODE_W + t2 * CW + g2)  # [T, W]
        p1w = tl.load(base2 + CODE_W + t2 * CW + W + g2)
        p2w = tl.load(base2 + CODE_W + t2 * CW + 2 * W + g2)
        p0, p1, p2 = p0w[:, :, None], p1w[:, :, None], p2w[:, :, None]
        c4 = ((_rotr(p0, j, USE_ASM) & 0x01010101) | (_rotr(p1, (j + 31) % 32, USE_ASM) & 0x02020202)
              | (_rotr(p2, (j + 30) % 32, USE_ASM) & 0x04040404))
    e4 = base4 - c4  # bytes: base >= the largest code, no borrow
    if RES > 0:
        NP: tl.constexpr = T // B if B > 0 else 1
        e4 = _escapes(e4, p0w, p1w, p2w, base3, j, T, W, NP, ESC_B, RES, USE_ASM)
    lo4 = ((e4 << 7) & _HI_BITS) | (s4 & 0x7F7F7F7F)  # e bit 0, then the mantissa
    hi4 = (s4 & _HI_BITS) | ((e4 >> 1) & 0x7F7F7F7F)  # sign, then e bits 7..1
    p01, p23 = _pairs(lo4, hi4, USE_ASM)
    pairs = tl.join(p01, p23)  # [T, W, 8, 2]
    vals = tl.join((pairs & 0xFFFF).to(tl.int16), (pairs >> 16).to(tl.int16))  # [T, W, 8, 2, 2]
    return tl.reshape(vals, (T, D)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _attn_swar_kernel(q_ptr, out_ptr, part_o_ptr, part_ml_ptr, cache_w_ptr, base_ptr, block_table_ptr,
                      seq_lens_ptr, scale_log2, stride_q0, stride_q1, stride_o0, stride_o1, bt_stride, page_words,
                      num_kv_heads, pages_per_split, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                      B: tl.constexpr, K_SM: tl.constexpr, V_SM: tl.constexpr, K_CODE: tl.constexpr,
                      V_CODE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, USE_ASM: tl.constexpr,
                      PREFETCH: tl.constexpr, PAGE_LINES: tl.constexpr, NIB: tl.constexpr, PAGES: tl.constexpr,
                      K_ESC: tl.constexpr, V_ESC: tl.constexpr, K_RES: tl.constexpr, V_RES: tl.constexpr):
    seq, h, split, seq_len, p_start, p_end, q = _program_setup(q_ptr, seq_lens_ptr, stride_q0, stride_q1,
                                                               pages_per_split, G, BLOCK_G, D, B)
    W: tl.constexpr = D // 32
    wi = tl.arange(0, W)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # [1, W, 8]: word index in D/4
    k_base = tl.load(base_ptr + h * (D // 4) + wi)
    v_base = tl.load(base_ptr + (num_kv_heads + h) * (D // 4) + wi)
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
        kt = _decode_swar(page_w, k_base, T, K_SM // 4, K_CODE // 4, D, USE_ASM, NIB, ROWS_B, K_ESC, K_RES)
        vt = _decode_swar(page_w, v_base, T, V_SM // 4, V_CODE // 4, D, USE_ASM, NIB, ROWS_B, V_ESC, V_RES)
        m_i, l_i, acc = _softmax_step(q, kt, vt, valid[None, :], valid, m_i, l_i, acc, scale_log2, DOT_F32)
    _store_result(out_ptr, part_o_ptr, part_ml_ptr, acc, m_i, l_i, seq, h, split, stride_o0, stride_o1, num_kv_heads,
                  G, BLOCK_G, D, NUM_SPLITS)


@triton.jit
def _decode_pages_swar_kernel(cache_w_ptr, base_ptr, blocks_ptr, out_k_ptr, out_v_ptr, page_words, num_kv_heads,
                              D: tl.constexpr, B: tl.constexpr, K_SM: tl.constexpr, V_SM: tl.constexpr,
                              K_CODE: tl.constexpr, V_CODE: tl.constexpr, USE_ASM: tl.constexpr, NIB: tl.constexpr,
                              K_ESC: tl.constexpr, V_ESC: tl.constexpr, K_RES: tl.constexpr, V_RES: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.arange(0, B)
    d = tl.arange(0, D)
    blk = tl.load(blocks_ptr + n).to(tl.int64)
    page_w = cache_w_ptr + (blk * num_kv_heads + h) * page_words
    wi = tl.arange(0, D // 32)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    kt = _decode_swar(page_w, tl.load(base_ptr + h * (D // 4) + wi), B, K_SM // 4, K_CODE // 4, D, USE_ASM, NIB, 0,
                      K_ESC, K_RES)
    vt = _decode_swar(page_w, tl.load(base_ptr + (num_kv_heads + h) * (D // 4) + wi), B, V_SM // 4, V_CODE // 4,
                      D, USE_ASM, NIB, 0, V_ESC, V_RES)
    o = ((n * num_kv_heads + h) * B + row[:, None]) * D + d[None, :]
    tl.store(out_k_ptr + o, kt)
    tl.store(out_v_ptr + o, vt)


def _escape_args(layout: KVPageLayout, escapes: bool) -> dict[str, int]:
    """The escape areas' offsets and reserves (0: escapes not decoded; the 4-bit variant never decodes them)."""
    on = escapes and not isinstance(layout, NibbleLayout)
    return {"K_ESC": layout.esc_offset(0) if on else 0, "V_ESC": layout.esc_offset(1) if on else 0,
            "K_RES": layout.reserve(0) if on else 0, "V_RES": layout.reserve(1) if on else 0}


def decode_pages_swar(cache: torch.Tensor, layout: KVPageLayout, bases: torch.Tensor, blocks: torch.Tensor,
                      escapes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) [N, H, B, D] bf16 of these pages through the experiment's decoder (bit checks of the fast path)."""
    H, B, D = cache.shape[1], layout.block_size, layout.head_size
    n = blocks.numel()
    out_k = torch.empty(n, H, B, D, dtype=torch.bfloat16, device=cache.device)
    out_v = torch.empty_like(out_k)
    _decode_pages_swar_kernel[(n, H)](cache.view(-1).view(torch.int32), bases, blocks.to(torch.int32), out_k, out_v,
                                      layout.page_bytes // 4, H, D=D, B=B, K_SM=layout.sm_offset(0),
                                      V_SM=layout.sm_offset(1), K_CODE=layout.code_offset(0),
                                      V_CODE=layout.code_offset(1), USE_ASM=not _INTERPRET,
                                      NIB=isinstance(layout, NibbleLayout), **_escape_args(layout, escapes))
    return out_k, out_v


def pack_bases(bases: torch.Tensor, top_code: int = 7) -> torch.Tensor:
    """uint8 [2, H, D] window tops -> int32 [2, H, D/4] (byte b of word w = channel 4w + b)."""
    if int(bases.min()) < top_code:
        raise ValueError(f"a window's top exponent must be at least {top_code} (codes subtract without borrow)")
    return bases.contiguous().view(torch.int32)


def kv_decode_attention_swar(query: torch.Tensor, cache: torch.Tensor, layout: KVPageLayout, bases: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                             out: torch.Tensor | None = None, num_splits: int | None = None, num_warps: int = 2,
                             num_stages: int = 1, prefetch: bool = False, pages: int = 1,
                             escapes: bool = True) -> torch.Tensor:
    """As `kv_decode_attention`, on pages of the proposed layout (escapes decoded unless escapes=False; no overflow
    path: see the module docstring). bases: int32 [2, H, D/4] from `pack_bases`."""
    H, G = _check_query(query, cache, layout)
    S, Hq, D = query.shape
    if out is None:
        out = torch.empty_like(query)
    num_splits, pages_per_split = split_plan(S, H, max_seq_len, layout.block_size, pages, num_splits)
    if num_splits > 1:
        part_o = torch.empty(S * Hq * num_splits * D, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(S * Hq * num_splits * 2, dtype=torch.float32, device=query.device)
    else:
        part_o = part_ml = out
    _attn_swar_kernel[(S, H, num_splits)](
        query, out, part_o, part_ml, cache.view(-1).view(torch.int32), bases, block_table, seq_lens,
        scale * 1.4426950408889634, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), layout.page_bytes // 4, H, pages_per_split, G=G,
        BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, B=layout.block_size, K_SM=layout.sm_offset(0),
        V_SM=layout.sm_offset(1), K_CODE=layout.code_offset(0), V_CODE=layout.code_offset(1),
        NUM_SPLITS=num_splits, DOT_F32=_INTERPRET, USE_ASM=not _INTERPRET, PREFETCH=prefetch and not _INTERPRET,
        PAGE_LINES=triton.next_power_of_2(triton.cdiv(layout.page_bytes, 128)), NIB=isinstance(layout, NibbleLayout),
        PAGES=pages, num_warps=num_warps, num_stages=num_stages, **_escape_args(layout, escapes))
    if num_splits > 1:
        _merge_kernel[(S, Hq)](out, part_o, part_ml, out.stride(0), out.stride(1), Hq, D=D,
                               NUM_SPLITS=num_splits, S_PAD=max(2, triton.next_power_of_2(num_splits)))
    return out


def write_pages_swar(cache: torch.Tensor, layout: KVPageLayout, bases: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, slots: torch.Tensor) -> int:
    """Torch writer of the experiment's layouts: whole pages (slots in page order from offset 0). bases uint8
    [2, H, D]; key/value [T, H, D] bf16. The 3-bit layout's escapes go to the page's escape area in (token,
    channel) order; returns how many escapes did not fit there (the experiment has no overflow path: 0 is needed
    for exact pages). The 4-bit variant writes no escape bytes; it returns how many values escaped."""
    B, D = layout.block_size, layout.head_size
    T, H, _ = key.shape
    dev = key.device
    slots = slots.to(torch.int64)
    blk, off = slots // B, slots % B
    if T % B or not torch.equal(off, torch.arange(T, device=dev) % B):
        raise ValueError("the experiment's writer takes whole pages, in order")
    ch = torch.arange(D, device=dev)
    bitpos = ((ch % 4) * 8 + (ch % 32) // 4).to(torch.int64)  # channel 32k + 4j + b sits at bit 8b + j
    bi, hi = blk.view(T, 1, 1), torch.arange(H, device=dev).view(1, H, 1)
    nib = isinstance(layout, NibbleLayout)
    result = 0
    for kv, x in ((0, key), (1, value)):
        bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        e = (bits >> 7) & 0xFF
        sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
        c = bases[kv].to(torch.int32).unsqueeze(0) - e  # [T, H, D]
        top = 15 if nib else 7
        esc = (c < 0) | (c >= top)
        c = torch.where(esc, torch.full_like(c, top), c)
        cache[bi, hi, layout.sm_offset(kv) + off.view(T, 1, 1) * D + ch.view(1, 1, D)] = sm.to(torch.uint8)
        if nib:  # byte 4m + b: channel 8m + b low, 8m + 4 + b high
            c8 = c.view(T, H, D // 8, 2, 4)
            byte = (c8[:, :, :, 0] | (c8[:, :, :, 1] << 4)).reshape(T, H, D // 2).to(torch.uint8)
            col = layout.code_offset(kv) + off.view(T, 1, 1) * layout.code_bytes
            cache[bi, hi, col + torch.arange(D // 2, device=dev).view(1, 1, -1)] = byte
            result += int(esc.sum())
            continue
        for p in range(3):
            words = torch.zeros(T, H, D // 32, dtype=torch.int64, device=dev)
            words.scatter_add_(2, (ch // 32).expand(T, H, D), ((c >> p) & 1).to(torch.int64) << bitpos)
            w32 = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
            col = layout.code_offset(kv) + off.view(T, 1, 1) * layout.code_bytes + p * (D // 8)
            cache[bi, hi, col + torch.arange(D // 8, device=dev).view(1, 1, -1)] = w32.view(torch.uint8).view(T, H, -1)
        # escapes: a page's j-th escape (token, channel order) is byte j of its escape area
        n = T // B
        flags = esc.view(n, B, H, D).permute(0, 2, 1, 3).reshape(n, H, B * D)
        f = flags.to(torch.int64)
        rank = torch.cumsum(f, -1) - f
        res = layout.reserve(kv)
        put = flags & (rank < res)
        result += int((flags & (rank >= res)).sum())
        pg, hh, pos = put.nonzero(as_tuple=True)
        ev = e.view(n, B, H, D).permute(0, 2, 1, 3).reshape(n, H, B * D)[pg, hh, pos].to(torch.uint8)
        cache[blk.view(n, B)[pg, 0], hh, layout.esc_offset(kv) + rank[pg, hh, pos]] = ev
    return result


__all__ = ["NibbleLayout", "decode_pages_swar", "kv_decode_attention_swar", "pack_bases", "write_pages_swar"]
