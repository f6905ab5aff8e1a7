"""The Glyd matmul on the GPU: y = x @ W.T with W in the resident code (docs/format.md section 4).

W [N, K] is held as sign/mantissa bytes, 4-bit exponent offsets below a base (15 = escape) and a sorted
list of escaped values. `resident_linear` decodes each weight tile in registers and feeds it to the
tensor cores, never writing W out in bf16: a decode-sized matmul (1-64 rows of x) reads 1.5 bytes a
weight instead of bf16's 2. Even and odd columns are separate dots, so the nibbles of a byte are never
interleaved: y = x[:, 0::2] @ W[:, 0::2].T + x[:, 1::2] @ W[:, 1::2].T, with sign/mantissa bytes read as
16-bit pairs, decoded two at a time in one 32-bit word, and x read as 32-bit pairs. Escaped weights decode
with offset 15 like the others. K is split so the grid fills the GPU; a second small kernel sums the
splits in a fixed order and adds (value - that) * x for each row's escapes (an `EscapePlan`, made once a
weight), so the same inputs give the same bits on every run.

`resident_decode` writes W out in bf16 (bit for bit): the path for prefill-sized matmuls, where the
GEMM is compute-bound and one decode before cuBLAS costs little.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glyd_engine.format.resident import ESCAPE, ResidentWeight

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 64  # larger batches take resident_decode + the bf16 GEMM
FUSED_ROWS = 16  # up to this many rows the fused kernel beats decode + GEMM on the H200 (docs/gpu.md)


@triton.jit
def _to_bf16(bits):
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


_SIGNS: tl.constexpr = tl.constexpr(-0x7FFF8000)  # 0x80008000 as an int32: both sign bits


@triton.jit
def _pair_bits(pair, offs, base):
    """Two weights at once (SWAR): 16-bit sign/mantissa pair + offset byte -> both bf16 patterns in one
    int32 (even column low). Escapes come out as the pattern with exponent base-15 (corrected later)."""
    x = (pair & 0xFF) | ((pair & 0xFF00) << 8)  # 0x00BB00AA
    y = (offs & 0xF) | ((offs & 0xF0) << 12)  # 0x000H000L
    e = ((base + 256) * 0x10001 - y) & 0x00FF00FF  # per-lane base - offset (the +256 stops a borrow)
    return ((x << 8) & _SIGNS) | (x & 0x007F007F) | (e << 7)


@triton.jit
def _load_tile(sm_pairs, offs_ptr, rn, n_ok, kh, k_ok, KH):
    """W's tile [rows rn, column pairs kh] as stored: sign/mantissa pairs and offset bytes (int32)."""
    w_ok = n_ok[:, None] & k_ok[None, :]
    pair = tl.load(sm_pairs + rn[:, None] * KH + kh[None, :], mask=w_ok, other=0).to(tl.int32)
    # padding lanes decode as escapes: a finite pattern, so 0 * it is 0 even when base is inf's exponent
    offs = tl.load(offs_ptr + rn[:, None] * KH + kh[None, :], mask=w_ok, other=0xFF).to(tl.int32)
    return pair, offs


@triton.jit
def _tile_pairs(sm_pairs, offs_ptr, rn, n_ok, kh, k_ok, KH, base):
    """The decoded pair words (int32) of W's tile [rows rn, column pairs kh]."""
    pair, offs = _load_tile(sm_pairs, offs_ptr, rn, n_ok, kh, k_ok, KH)
    return _pair_bits(pair, offs, base)


@triton.jit
def _resident_linear_kernel(x_pairs, x_ptr, sm_pairs, offs_ptr, part_ptr, y_ptr, rowptr_ptr, esc_col_ptr,
                            esc_corr_ptr, M, N, K, base, stride_xm, KH_SPLIT, SPLITS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr,
                            BLOCK_C: tl.constexpr, DOT_F32: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_KH)
    KH = K // 2
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = split * KH_SPLIT
    k_hi = tl.minimum(k_lo + KH_SPLIT, KH)
    for kh0 in range(k_lo, k_hi, BLOCK_KH):
        kh = kh0 + rk
        k_ok = kh < k_hi
        w = _tile_pairs(sm_pairs, offs_ptr, rn, n_ok, kh, k_ok, KH, base)
        w_even = _to_bf16(w & 0xFFFF)
        w_odd = _to_bf16((w >> 16) & 0xFFFF)
        xp = tl.load(x_pairs + rm[:, None] * (stride_xm // 2) + kh[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0)
        x_even = _to_bf16(xp & 0xFFFF)
        x_odd = _to_bf16((xp >> 16) & 0xFFFF)
        if DOT_F32:  # the CPU interpreter multiplies bf16 dot operands as raw bits: widen them there
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even.to(tl.float32)))
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd.to(tl.float32)))
        else:
            acc += tl.dot(x_even, tl.trans(w_even))
            acc += tl.dot(x_odd, tl.trans(w_odd))
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLITS == 1:  # no split to sum: correct the escapes and write y here, no second launch
        acc = _add_corrections(acc, rn, n_ok, rm, m_ok, x_ptr, stride_xm, rowptr_ptr, esc_col_ptr, esc_corr_ptr,
                               BLOCK_C)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=ok)
    else:
        tl.store(part_ptr + split * M * N + rm[:, None] * N + rn[None, :], acc, mask=ok)


@triton.jit
def _resident_gemv_kernel(x_pairs, x_ptr, sm_pairs, offs_ptr, part_ptr, y_ptr, rowptr_ptr, esc_col_ptr,
                          esc_corr_ptr, N, K, base, KH_SPLIT, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_KH: tl.constexpr, FOLD: tl.constexpr, BLOCK_C: tl.constexpr,
                          PREFETCH: tl.constexpr):
    """One row of x on the CUDA cores: bf16 -> fp32 is a 16-bit shift, products are exact in fp32, no
    padding of the row to a 16-row tensor-core tile. PREFETCH: the next tile's loads are issued before this
    tile is decoded (Triton does not pipeline a loop with no dot), so twice the bytes are in flight."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_KH)
    KH = K // 2
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_KH), tl.float32)
    k_lo = split * KH_SPLIT
    k_hi = tl.minimum(k_lo + KH_SPLIT, KH)
    if PREFETCH:
        pair_n, offs_n = _load_tile(sm_pairs, offs_ptr, rn, n_ok, k_lo + rk, (k_lo + rk) < k_hi, KH)
    one = tl.arange(0, 1)
    fix = tl.zeros((1, BLOCK_N), tl.float32)
    if FOLD:  # noqa: SIM102 (FOLD is a compile-time constant, split is not)
        # the first split adds the escape corrections, before its loop: their chain of loads runs while the
        # first tile and the other splits' tiles load, not after them
        if split == 0:
            fix = _add_corrections(fix, rn, n_ok, one, one < 1, x_ptr, 0, rowptr_ptr, esc_col_ptr, esc_corr_ptr,
                                   BLOCK_C)
    for kh0 in range(k_lo, k_hi, BLOCK_KH):
        kh = kh0 + rk
        k_ok = kh < k_hi
        if PREFETCH:
            pair, offs = pair_n, offs_n
            kn = kh + BLOCK_KH
            pair_n, offs_n = _load_tile(sm_pairs, offs_ptr, rn, n_ok, kn, kn < k_hi, KH)
            w = _pair_bits(pair, offs, base)
        else:
            w = _tile_pairs(sm_pairs, offs_ptr, rn, n_ok, kh, k_ok, KH, base)
        xp = tl.load(x_pairs + kh, mask=k_ok, other=0)
        x_even = (xp << 16).to(tl.float32, bitcast=True)
        x_odd = (xp & -65536).to(tl.float32, bitcast=True)
        acc += (w << 16).to(tl.float32, bitcast=True) * x_even[None, :]
        acc += (w & -65536).to(tl.float32, bitcast=True) * x_odd[None, :]
    out = tl.sum(acc, axis=1)[None, :] + fix  # [1, BLOCK_N]
    if SPLITS == 1 and FOLD:  # nothing left to sum or correct: write y here, no second launch
        tl.store(y_ptr + rn[None, :], out.to(tl.bfloat16), mask=n_ok[None, :])
    else:
        tl.store(part_ptr + split * N + rn[None, :], out, mask=n_ok[None, :])


@triton.jit
def _add_corrections(acc, rn, n_ok, rm, m_ok, x_ptr, stride_xm, rowptr_ptr, esc_col_ptr, esc_corr_ptr,
                     BLOCK_C: tl.constexpr):
    """acc [M, rows] + each row's escape corrections ((value - the pattern the tiles used) * x), a
    [rows, BLOCK_C] tile of them at a time, in list order."""
    first = tl.load(rowptr_ptr + rn, mask=n_ok, other=0)
    count = tl.load(rowptr_ptr + rn + 1, mask=n_ok, other=0) - first
    rc = tl.arange(0, BLOCK_C)
    for c0 in range(0, tl.max(count, axis=0), BLOCK_C):
        e_ok = n_ok[:, None] & ((c0 + rc)[None, :] < count[:, None])  # [rows, BLOCK_C]
        e = first[:, None] + c0 + rc[None, :]
        col = tl.load(esc_col_ptr + e, mask=e_ok, other=0)
        corr = tl.load(esc_corr_ptr + e, mask=e_ok, other=0.0)
        xv = tl.load(x_ptr + rm[:, None, None] * stride_xm + col[None, :, :],
                     mask=m_ok[:, None, None] & e_ok[None, :, :], other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(e_ok[None, :, :], xv * corr[None, :, :], 0.0), axis=2)
    return acc


@triton.jit
def _finish_kernel(part_ptr, y_ptr, x_ptr, rowptr_ptr, esc_col_ptr, esc_corr_ptr, M, N, stride_xm,
                   SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   CORRECT: tl.constexpr):
    """y[:, rows] = the K splits summed in order (+ the escape corrections unless a split already added them)."""
    rn = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    ok = m_ok[:, None] & n_ok[None, :]
    acc = tl.load(part_ptr + rm[:, None] * N + rn[None, :], mask=ok, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * M * N + rm[:, None] * N + rn[None, :], mask=ok, other=0.0)
    if CORRECT:
        acc = _add_corrections(acc, rn, n_ok, rm, m_ok, x_ptr, stride_xm, rowptr_ptr, esc_col_ptr, esc_corr_ptr,
                               BLOCK_C)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=ok)


@triton.jit
def _resident_decode_kernel(sm_pairs, offs_ptr, out_pairs, n_pairs, base, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_pairs
    pair = tl.load(sm_pairs + i, mask=ok, other=0).to(tl.int32)
    offs = tl.load(offs_ptr + i, mask=ok, other=0).to(tl.int32)
    tl.store(out_pairs + i, _pair_bits(pair, offs, base), mask=ok)  # escapes are patched after


@dataclass
class EscapePlan:
    """What the matmul needs of a weight's escapes, made once a weight: row index, column, correction."""

    rowptr: torch.Tensor  # int32[N + 1]: row n's escapes are entries rowptr[n] .. rowptr[n + 1] - 1
    col: torch.Tensor  # int32[e]
    corr: torch.Tensor  # float32[e]: value - the pattern the tiles decode (exponent base - 15)

    @property
    def nbytes(self) -> int:
        return 4 * (self.rowptr.numel() + self.col.numel() + self.corr.numel())


def escape_plan(r: ResidentWeight) -> EscapePlan:
    n_rows, cols = r.shape
    pos = r.esc_pos.to(torch.int64)
    bounds = torch.arange(n_rows + 1, device=pos.device, dtype=torch.int64) * cols
    rowptr = torch.searchsorted(pos, bounds).to(torch.int32)
    sm = r.sm[pos].to(torch.int32)
    used = ((sm & 0x80) << 8) | (((r.base - ESCAPE) & 0xFF) << 7) | (sm & 0x7F)
    used = torch.where(used >= 0x8000, used - 0x10000, used).to(torch.int16).view(torch.bfloat16)
    corr = r.esc_bits.view(torch.bfloat16).float() - used.float()
    return EscapePlan(rowptr, (pos % cols).to(torch.int32), corr)


def _check(r: ResidentWeight) -> tuple[int, int]:
    if len(r.shape) != 2 or r.shape[1] % 2:
        raise ValueError(f"the Glyd matmul needs a 2-D weight with an even width, not {r.shape}")
    return r.shape


def resident_decode(r: ResidentWeight) -> torch.Tensor:
    """W in bf16, bit for bit (escapes patched after the kernel)."""
    n_rows, cols = _check(r)
    out = torch.empty(n_rows, cols, dtype=torch.bfloat16, device=r.sm.device)
    n_pairs = n_rows * cols // 2
    block = 1024
    _resident_decode_kernel[(triton.cdiv(n_pairs, block),)](r.sm.view(torch.int16), r.offs, out.view(torch.int32),
                                                            n_pairs, r.base, BLOCK=block)
    if r.esc_pos.numel():
        out.view(-1).view(torch.int16)[r.esc_pos.to(torch.int64)] = r.esc_bits
    return out


TENSOR_CORE_CONFIG = {"block_n": 64, "block_kh": 64, "splits": 8, "num_warps": 4}  # 8-64 rows: the H200 sweep's best


def gemv_config(n_rows: int, cols: int) -> dict[str, int]:
    """Tiles of the one-row kernel by weight shape: the H200's best of bench/gpu_linear.py's sweep at
    Qwen3-8B's shapes. One K split (the kernel writes y, no second launch) unless K is long."""
    if cols >= 8192:  # down_proj
        return {"block_n": 16, "block_kh": 128, "splits": 2, "num_warps": 4}
    if n_rows <= 4096:  # o_proj
        return {"block_n": 16, "block_kh": 256, "splits": 1, "num_warps": 8}
    return {"block_n": 16, "block_kh": 128, "splits": 1, "num_warps": 4}  # qkv_proj, gate_up_proj


def resident_linear(x: torch.Tensor, r: ResidentWeight, plan: EscapePlan, bias: torch.Tensor | None = None,
                    block_n: int | None = None, block_kh: int | None = None, num_warps: int | None = None,
                    num_stages: int = 3,
                    splits: int | None = None, block_r: int = 16, block_c: int = 16, gemv: bool | None = None,
                    fold: bool | None = None, prefetch: bool = True) -> torch.Tensor:
    """y = x @ W.T (+ bias) for x [M, K] bf16, M <= MAX_ROWS; W decoded tile by tile on chip. `gemv` (default:
    when M is 1): one row of x runs on the CUDA cores instead of a tensor-core tile padded to 16 rows; `fold`
    (default: with gemv) has the first K split add the escape corrections instead of the split-sum launch. Tiles
    left None take the H200's best of bench/gpu_linear.py (`gemv_config`; tensor cores: TENSOR_CORE_CONFIG)."""
    n_rows, cols = _check(r)
    if x.dim() != 2 or x.shape[1] != cols or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [M, {cols}], not {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: the fused kernel takes up to {MAX_ROWS}; decode once and use the bf16 GEMM")
    x = x.contiguous()
    gemv = m == 1 if gemv is None else (gemv and m == 1)  # the CUDA-core kernel takes one row
    tuned = gemv_config(n_rows, cols) if gemv else TENSOR_CORE_CONFIG
    block_n, block_kh = block_n or tuned["block_n"], block_kh or tuned["block_kh"]
    splits, num_warps = splits or tuned["splits"], num_warps or tuned["num_warps"]
    if not gemv and block_kh < 16:
        raise ValueError(f"block_kh {block_kh}: the tensor-core kernel's dot needs K >= 16 pairs a tile")
    n_blocks = triton.cdiv(n_rows, block_n)
    kh = cols // 2
    splits = max(1, min(splits, triton.cdiv(kh, block_kh)))
    kh_split = triton.cdiv(triton.cdiv(kh, splits), block_kh) * block_kh
    splits = triton.cdiv(kh, kh_split)
    fold = (fold is None or fold) and gemv
    direct = splits == 1 and (fold or not gemv)  # the one split writes y itself
    part = torch.empty(0 if direct else splits, m, n_rows, dtype=torch.float32, device=x.device)
    y = torch.empty(m, n_rows, dtype=torch.bfloat16, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    if gemv:
        _resident_gemv_kernel[(n_blocks, splits)](
            x.view(torch.int32), x, r.sm.view(torch.int16), r.offs, part, y, plan.rowptr, plan.col, plan.corr,
            n_rows, cols, r.base, kh_split, SPLITS=splits, BLOCK_N=block_n, BLOCK_KH=block_kh, FOLD=fold,
            BLOCK_C=block_c, PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages)
    else:
        _resident_linear_kernel[(n_blocks, splits)](
            x.view(torch.int32), x, r.sm.view(torch.int16), r.offs, part, y, plan.rowptr, plan.col, plan.corr, m,
            n_rows, cols, r.base, x.stride(0), kh_split, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_KH=block_kh, BLOCK_C=block_c, DOT_F32=_INTERPRET, num_warps=num_warps, num_stages=num_stages)
    if direct:
        return y if bias is None else y + bias
    _finish_kernel[(triton.cdiv(n_rows, block_r),)](part, y, x, plan.rowptr, plan.col, plan.corr, m, n_rows,
                                                     x.stride(0), SPLITS=splits, BLOCK_M=block_m, BLOCK_R=block_r,
                                                     BLOCK_C=block_c, CORRECT=not fold)
    return y if bias is None else y + bias


assert ESCAPE == 15  # the kernels correct escapes as decoded with offset 15
