"""Appending K/V tokens into Glyd's compressed KV pages (docs/format.md section 2), in Triton.

Two launches over (group of TB tokens of the call, KV head), K and V in the same program; a group loads
its head's tables once:

1. `_write_rows_kernel`: split each bf16 value into exponent and sign/mantissa, code the exponent
   against the channel's window (code = top - exponent, 7 = escape when outside 0..6), write the tokens'
   sign/mantissa rows and their 3 code-plane rows (32-bit words, the format's bit order), and each row's
   escape count into scratch. Rows of one page written by one call do
   not depend on each other here.
2. `_write_escapes_kernel`: once every code row of the call is in place, each token sums the escapes
   of its page's rows before it (rows this call wrote: the scratch counts; rows of earlier calls:
   popcounts of plane0 & plane1 & plane2 bytes), adds its in-row prefix count (its flags read back from
   its code-plane words, no table lookup), and stores its escape exponents at those ranks in the page's escape
   area. Ranks at or past the reserve are not stored: they are counted (`stats[kv]`) and their row's first
   rank is kept.

Escapes past the reserve (the overflow path: rare, the lossless path for adversarial prompts) are then
written by torch in `write_pages` into a `DeviceOverflowStore` (OverflowStore whose arena lives on the
device): `overflow_values` counts them. With `check_overflow=False` the call never synchronises (CUDA
graphs): the caller must then read `stats` itself and call `finish_overflow`.

The torch reference is `glyd_engine.format.kv_page.KVPageCodec.write`; pages written here are byte for
byte the reference's (tests/kernels/test_kv_kernels.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from glyd_engine.format import bf16
from glyd_engine.format.kv_page import (
    ESCAPE,
    OVERFLOW_MIN_RUN,
    KVPageLayout,
    OverflowStore,
    encode_table,
    window_bases,
)
from kernels.kv_decode_attention import _offsets, _popc

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class DeviceOverflowStore(OverflowStore):
    """OverflowStore with `ptr` and `arena` on a device (the kernels read them there)."""

    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ptr = self.ptr.to(self.device)
        self.arena = self.arena.to(self.device)


@dataclass
class WriteCounters:
    calls: int = 0
    values: int = 0
    overflow_values: int = 0  # escapes that went to the overflow store through torch
    overflow_calls: int = 0   # calls that took the torch overflow path
    extra: dict[str, int] = field(default_factory=dict)


@triton.jit
def _row_bits(x_ptr, t, ok, stride_x0, D: tl.constexpr):
    """bf16 rows [TB, D] of tokens t (one head's, x_ptr at its first channel) as int32 bit patterns."""
    d = tl.arange(0, D)
    x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x0 + d[None, :], mask=ok[:, None], other=0)
    return x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _codes(x_ptr, t, ok, top_ptr, stride_x0, D: tl.constexpr):
    """bf16 rows [TB, D] of tokens t -> (exponent, sign/mantissa, code) int32 against the channels' windows
    (tops loaded once a program)."""
    d = tl.arange(0, D)
    bits = _row_bits(x_ptr, t, ok, stride_x0, D)
    e = (bits >> 7) & 0xFF
    sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
    c = tl.load(top_ptr + d).to(tl.int32)[None, :] - e
    code = tl.where((c >= 0) & (c < 7), c, 7)
    return e, sm, code


@triton.jit
def _bit_shifts():
    """[32]: where channel i of a 32-channel word puts its code bit (kv_page.code_bit_positions)."""
    i = tl.arange(0, 32)
    return 8 * (i % 4) + i // 4


@triton.jit
def _tokens(slots_ptr, cache_ptr, T, h, page_bytes, num_kv_heads, B: tl.constexpr, TB: tl.constexpr):
    """The program's tokens: index, in range and not padding, slot, offset in page, page pointer."""
    t = tl.program_id(0) * TB + tl.arange(0, TB)
    slot = tl.load(slots_ptr + t, mask=t < T, other=-1)
    ok = slot >= 0
    blk = tl.where(ok, slot // B, 0)
    page = cache_ptr + (blk * num_kv_heads + h) * page_bytes
    return t, ok, slot, tl.where(ok, slot % B, 0), page


@triton.jit
def _write_rows_kernel(key_ptr, val_ptr, slots_ptr, top_ptr, cache_ptr, cache_w_ptr, count_ptr, T, stride_x0,
                       stride_x1, page_bytes, num_kv_heads, D: tl.constexpr, B: tl.constexpr, TB: tl.constexpr,
                       K_SM: tl.constexpr, V_SM: tl.constexpr, K_CODE: tl.constexpr, V_CODE: tl.constexpr):
    h = tl.program_id(1)
    t, ok, slot, off, page = _tokens(slots_ptr, cache_ptr, T, h, page_bytes, num_kv_heads, B, TB)
    d = tl.arange(0, D)
    W: tl.constexpr = D // 32
    k = tl.arange(0, W)
    sh = _bit_shifts()
    blk = tl.where(ok, slot // B, 0)
    page_word = (blk * num_kv_heads + h) * (page_bytes // 4)  # pages and code rows are whole words
    for kv in tl.static_range(2):
        x_ptr = (key_ptr if kv == 0 else val_ptr) + h * stride_x1
        e, sm, code = _codes(x_ptr, t, ok, top_ptr + (kv * num_kv_heads + h) * D, stride_x0, D)
        SM = K_SM if kv == 0 else V_SM
        CO = K_CODE if kv == 0 else V_CODE
        tl.store(page[:, None] + SM + off[:, None] * D + d[None, :], sm.to(tl.uint8), mask=ok[:, None])
        c3 = tl.reshape(code, (TB, W, 32))
        row = cache_w_ptr + page_word[:, None] + (CO + off[:, None] * (3 * D // 8)) // 4 + k[None, :]
        for p in tl.static_range(3):
            word = tl.sum(((c3 >> p) & 1) << sh[None, None, :], axis=2)  # distinct bits: the sum is their OR
            tl.store(row + p * W, word, mask=ok[:, None])
        # this row's escape count, so the escape pass need not re-count rows written by this call
        tl.store(count_ptr + (t * num_kv_heads + h) * 2 + kv, tl.sum((code == 7).to(tl.int32), axis=1), mask=ok)


@triton.jit
def _popc8(x):
    x = x - ((x >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    return (x + (x >> 4)) & 0x0F


@triton.jit
def _write_escapes_kernel(key_ptr, val_ptr, slots_ptr, cache_ptr, cache_w_ptr, count_ptr, stats_ptr, first_rank_ptr, T,
                          stride_x0, stride_x1, page_bytes, num_kv_heads,
                          D: tl.constexpr, B: tl.constexpr, TB: tl.constexpr, K_CODE: tl.constexpr,
                          V_CODE: tl.constexpr, K_ESC: tl.constexpr, V_ESC: tl.constexpr, K_RES: tl.constexpr,
                          V_RES: tl.constexpr, USE_ASM: tl.constexpr):
    h = tl.program_id(1)
    t, ok, slot, off, page = _tokens(slots_ptr, cache_ptr, T, h, page_bytes, num_kv_heads, B, TB)
    j = tl.arange(0, D // 8)
    # Escapes in the rows before each token of its page, [TB tokens, B rows] at once (no dependent loop). A row
    # this call wrote sits at the same distance back in the call (a run): take its count from scratch. Rows of
    # earlier calls (decode tokens, the first page of a chunk): popcount their code planes, only where there are.
    r = tl.arange(0, B)
    back = off[:, None] - r[None, :]
    before = ok[:, None] & (back > 0)
    tp = t[:, None] - back
    prev = tl.load(slots_ptr + tp, mask=before & (tp >= 0), other=-2)
    in_call = before & (tp >= 0) & (prev == slot[:, None] - back)
    cnt = count_ptr + (tp * num_kv_heads + h) * 2
    base_k = tl.sum(tl.load(cnt, mask=in_call, other=0), axis=1)
    base_v = tl.sum(tl.load(cnt + 1, mask=in_call, other=0), axis=1)
    old = before & ~in_call
    if tl.sum(tl.sum(old.to(tl.int32), axis=1), axis=0) > 0:
        rows_k = page[:, None, None] + K_CODE + r[None, :, None] * (3 * D // 8) + j[None, None, :]
        for kv in tl.static_range(2):
            rows = rows_k + (V_CODE - K_CODE) * kv
            m3 = old[:, :, None]
            p0 = tl.load(rows, mask=m3, other=0).to(tl.int32)
            p1 = tl.load(rows + D // 8, mask=m3, other=0).to(tl.int32)
            p2 = tl.load(rows + 2 * (D // 8), mask=m3, other=0).to(tl.int32)
            n = tl.sum(tl.sum(_popc8(p0 & p1 & p2), axis=2), axis=1)
            if kv == 0:
                base_k += n
            else:
                base_v += n
    W: tl.constexpr = D // 32
    k = tl.arange(0, W)
    sh = _bit_shifts()
    blk = tl.where(ok, slot // B, 0)
    page_word = (blk * num_kv_heads + h) * (page_bytes // 4)
    for kv in tl.static_range(2):
        CO = K_CODE if kv == 0 else V_CODE
        ESC = K_ESC if kv == 0 else V_ESC
        RES = K_RES if kv == 0 else V_RES
        base = base_k if kv == 0 else base_v
        # this row's escape flags from the code words the first pass wrote (code 7: all three bits set)
        row = cache_w_ptr + page_word[:, None] + (CO + off[:, None] * (3 * D // 8)) // 4 + k[None, :]
        fw = (tl.load(row, mask=ok[:, None], other=0) & tl.load(row + W, mask=ok[:, None], other=0)
              & tl.load(row + 2 * W, mask=ok[:, None], other=0))
        flags = tl.reshape((fw[:, :, None] >> sh[None, None, :]) & 1, (TB, D))
        is_esc = flags != 0
        # in-row rank by popcounts, not a scan over D flags (1.4x the pass's speed, run 34): the row's escapes in
        # earlier groups plus the group's flags of the channels below (bits 8b' + j' with j' < j, or j' = j, b' < b)
        gc = _popc(fw, USE_ASM)
        i = tl.arange(0, 32)
        below = (0x01010101 * ((1 << (i // 4)) - 1)) | ((0x01010101 << (i // 4)) & ((1 << sh) - 1))
        in_row = (tl.cumsum(gc, axis=1) - gc)[:, :, None] + _popc(fw[:, :, None] & below[None, None, :], USE_ASM)
        rank = base[:, None] + tl.reshape(in_row, (TB, D))
        # whole rows, wide loads (loading only the escapes' values was slower, run 34)
        e = (_row_bits((key_ptr if kv == 0 else val_ptr) + h * stride_x1, t, ok, stride_x0, D) >> 7) & 0xFF
        tl.store(page[:, None] + ESC + rank, e.to(tl.uint8), mask=is_esc & (rank < RES))
        n_over = tl.sum(tl.sum((is_esc & (rank >= RES)).to(tl.int32), axis=1), axis=0)
        tl.store(first_rank_ptr + (t * num_kv_heads + h) * 2 + kv, base, mask=ok)
        if n_over > 0:
            tl.atomic_add(stats_ptr + kv, n_over)


class PageWriter:
    """Write path of one layer: decode table uint8 [2, H, D, 7] (windows) on the cache's device, and scratch."""

    def __init__(self, layout: KVPageLayout, decode_table: torch.Tensor, tokens_per_program: int = 32,
                 num_warps: int = 4, escape_tokens_per_program: int = 8, escape_num_warps: int = 1) -> None:
        if layout.head_size & (layout.head_size - 1) or layout.head_size < 32:
            raise ValueError(f"the Triton page writer needs a power-of-two head size >= 32, not {layout.head_size}")
        if layout.block_size & (layout.block_size - 1) or layout.block_size < 4:
            raise ValueError(f"the Triton page writer needs a power-of-two block size >= 4 (pages of whole 32-bit "
                             f"words), not {layout.block_size}")
        for name, n in (("tokens_per_program", tokens_per_program), ("num_warps", num_warps),
                        ("escape_tokens_per_program", escape_tokens_per_program),
                        ("escape_num_warps", escape_num_warps)):
            if n < 1 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two, not {n}")
        self.layout = layout
        self.tops = window_bases(decode_table).contiguous()
        self.enc = encode_table(decode_table.cpu()).to(decode_table.device)
        self.counters = WriteCounters()
        # powers of two; the defaults are the H200's best (docs/gpu.md): a token group shares the tables' loads
        self.tokens_per_program, self.num_warps = tokens_per_program, num_warps
        self.escape_tokens_per_program, self.escape_num_warps = escape_tokens_per_program, escape_num_warps

    def launch(self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
               escapes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Both kernels (the first alone with escapes=False: a timing, pages incomplete); returns (stats int32 [2]:
        escapes past the reserve for K, V; first_rank [T, H, 2])."""
        lay = self.layout
        T, H, D = key.shape
        if value.stride() != key.stride():
            value = value.contiguous()
            key = key.contiguous()
        stats = torch.zeros(2, dtype=torch.int32, device=cache.device)
        first = torch.empty(T, H, 2, dtype=torch.int32, device=cache.device)
        if T == 0:
            return stats, first
        if key.stride(2) != 1:
            key, value = key.contiguous(), value.contiguous()
        slots = slots.to(torch.int64).contiguous()
        counts = torch.empty(T, H, 2, dtype=torch.int32, device=cache.device)
        offs = _offsets(lay)
        tb, etb = self.tokens_per_program, self.escape_tokens_per_program
        grid = (triton.cdiv(T, tb), H)
        cache_w = cache.view(-1).view(torch.int32)
        _write_rows_kernel[grid](key, value, slots, self.tops, cache, cache_w, counts, T, key.stride(0), key.stride(1),
                                 lay.page_bytes, H, D=D, B=lay.block_size, TB=tb, K_SM=offs["K_SM"],
                                 V_SM=offs["V_SM"], K_CODE=offs["K_CODE"], V_CODE=offs["V_CODE"],
                                 num_warps=self.num_warps)
        if not escapes:
            return stats, first
        _write_escapes_kernel[(triton.cdiv(T, etb), H)](key, value, slots, cache, cache_w, counts, stats, first, T,
                                    key.stride(0), key.stride(1), lay.page_bytes, H, D=D, B=lay.block_size, TB=etb,
                                    K_CODE=offs["K_CODE"], V_CODE=offs["V_CODE"], K_ESC=offs["K_ESC"],
                                    V_ESC=offs["V_ESC"], K_RES=offs["K_RES"], V_RES=offs["V_RES"],
                                    USE_ASM=not _INTERPRET, num_warps=self.escape_num_warps)
        self.counters.calls += 1
        self.counters.values += 2 * key.numel()
        return stats, first

    def finish_overflow(self, overflow: OverflowStore, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                        first: torch.Tensor) -> int:
        """Torch path for escapes past the reserve (rare): write them to the overflow store. Returns how many."""
        lay = self.layout
        B = lay.block_size
        slots = slots.to(torch.int64)
        H, D = key.shape[1], key.shape[2]
        total = 0
        for kv, x in ((0, key), (1, value)):
            res = lay.reserve(kv)
            exp, _ = bf16.split(x)
            idx = (torch.arange(H, device=x.device).view(1, H, 1) * D + torch.arange(D, device=x.device)) * 256
            codes = torch.take(self.enc[kv], idx + exp.to(torch.int64))
            flags = (codes == ESCAPE).to(torch.int64) & (slots >= 0).view(-1, 1, 1)
            rank = first[..., kv].to(torch.int64).unsqueeze(-1) + torch.cumsum(flags, -1) - flags
            t_i, h_i, d_i = ((flags > 0) & (rank >= res)).nonzero(as_tuple=True)
            if t_i.numel() == 0:
                continue
            r = rank[t_i, h_i, d_i] - res
            blk = slots[t_i] // B
            offsets = overflow.reserve_bytes(blk, h_i, kv, r + 1)
            overflow.arena[offsets + r] = exp[t_i, h_i, d_i]
            overflow.values_written += int(t_i.numel())
            total += int(t_i.numel())
        self.counters.overflow_values += total
        self.counters.overflow_calls += 1
        return total

    def write(self, cache: torch.Tensor, overflow: OverflowStore | None, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, check_overflow: bool = True) -> torch.Tensor:
        """Append tokens key/value [T, H, D] bf16 at `slots` (block * B + offset, -1 = padding).

        With check_overflow (the default) the call reads the overflow counters (one sync) and writes any
        escapes past the reserve through torch; blocks rewritten from offset 0 give their runs back first.
        Returns stats (int32 [2], escapes past the reserve for K and V).
        """
        if overflow is not None and check_overflow and overflow.runs_in_use:
            s = slots.to(torch.int64)
            restarted = torch.unique(s[(s >= 0) & (s % self.layout.block_size == 0)] // self.layout.block_size)
            if restarted.numel():
                overflow.release(restarted.to(overflow.ptr.device))
        stats, first = self.launch(cache, key, value, slots)
        if check_overflow and int(stats.sum()) > 0:
            if overflow is None:
                raise RuntimeError("escapes past the page reserve but no overflow store was given")
            self.finish_overflow(overflow, key, value, slots, first)
        return stats


def write_pages(cache: torch.Tensor, overflow: OverflowStore | None, key: torch.Tensor, value: torch.Tensor,
                slots: torch.Tensor, layout: KVPageLayout, decode_table: torch.Tensor) -> torch.Tensor:
    """One-shot `PageWriter(layout, decode_table).write(...)` (build a PageWriter once per layer instead)."""
    return PageWriter(layout, decode_table).write(cache, overflow, key, value, slots)


__all__ = ["OVERFLOW_MIN_RUN", "DeviceOverflowStore", "PageWriter", "write_pages"]
