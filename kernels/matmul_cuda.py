"""Launchers of the CUDA Glyd matmul (kernels/cuda/matmul.cu) on fragment-order weights (format/fragment_weight.py).

`matmul` runs y = x @ W.T (+ bias) for 1-64 rows of x in one launch: a block holds 16 or 32 rows of W, its warps
stream a share of K each chunk by chunk through registers into the tensor cores, 1-4 more warps add the escapes,
and the warps' sums meet in shared memory in a fixed order (the same bits on every run). `decode` writes W out in
bf16 for prefill-sized matmuls (decode once, then the bf16 GEMM).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from glyd_engine.format.fragment_weight import CHUNK_COLS, TILE_ROWS, FragmentWeight
from kernels import nvrtc

SOURCE = "matmul.cu"
KERNELS = ("glyd_mm", "glyd_mm_decode", "glyd_mm_patch", "glyd_mm_gather")
MAX_ROWS = 64  # rows of x the kernel takes: 8-row MMA tiles of x, 1, 2, 4 or 8 of them
FUSED_ROWS = 64  # up to this many rows the layer runs the kernel; more decode once and use the bf16 GEMM


@dataclass(frozen=True)
class Config:
    tiles: int = 0  # 16-row tiles of W a block (1 or 2; 0: 1 for up to 8 rows of x, 2 above, where W's tiles pair up)
    warps: int = 8  # streaming warps a block, each a share of K
    stages: int = 2  # chunks a warp holds in registers (one decoding, the rest loading)
    min_blocks: int = 2  # blocks a multiprocessor (the register budget)
    escape_warps: int = 1  # warps a block that walk the escape lists (1, 2 or 4)


def default_config(rows: int, n: int = 0, sms: int = 132) -> Config:
    """The H200's best of bench/gpu_linear.py's sweeps (docs/benchmarks.md) for W with n rows: up to 16 rows of x,
    where W has at most two 16-row tiles a multiprocessor, more streaming warps a block (each a shorter share of K),
    and for 9-16 rows four escape warps (their walk is the longer there), else 8 or 6 streaming warps and two escape
    warps; for 17-64 rows few streaming warps, whatever the shape. Every default compiles without spills
    (tests/kernels/test_kv_cuda_build.py)."""
    few_tiles = n // TILE_ROWS <= 2 * sms
    if rows > 32:
        return Config(tiles=1, warps=6, stages=1, min_blocks=1, escape_warps=4)
    if rows > 16:
        return Config(tiles=1, warps=4, stages=2, min_blocks=2, escape_warps=2)
    if rows <= 8:
        return Config(tiles=1, warps=14 if few_tiles else 8, min_blocks=2, escape_warps=2)
    return Config(tiles=1, warps=8, min_blocks=2, escape_warps=4) if few_tiles else \
        Config(tiles=1, warps=6, min_blocks=3, escape_warps=2)


def _tiles(rows: int, n: int, cfg: Config) -> int:
    nt = cfg.tiles or (2 if 8 < rows <= 16 else 1)
    return nt if (n // TILE_ROWS) % nt == 0 else 1


def x_tiles(rows: int) -> int:
    """8-row MMA tiles of x a build takes: 1, 2, 4 or 8."""
    return 1 << max(0, math.ceil(rows / 8) - 1).bit_length()


def defines(rows: int, cfg: Config, n: int = TILE_ROWS * 2) -> dict[str, int]:
    return {"MT": x_tiles(rows), "NT": _tiles(rows, n, cfg), "WARPS": cfg.warps, "STAGES": cfg.stages,
            "MIN_BLOCKS": cfg.min_blocks, "EW": cfg.escape_warps}


@functools.lru_cache(maxsize=64)
def _module(defs: tuple[tuple[str, int], ...], device: int) -> dict:
    return nvrtc.load(SOURCE, dict(defs), KERNELS, device)


def kernels(rows: int, cfg: Config, device: torch.device, n: int = TILE_ROWS * 2) -> dict:
    return _module(tuple(sorted(defines(rows, cfg, n).items())), device.index or 0)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_x(x: torch.Tensor, cols: int) -> None:
    if x.dim() != 2 or x.shape[1] != cols or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [M, {cols}], not {x.dtype} {tuple(x.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{x.shape[0]} rows: the fused kernel takes up to {MAX_ROWS}; decode once and use the "
                         "bf16 GEMM")


def matmul(x: torch.Tensor, f: FragmentWeight, bias: torch.Tensor | None = None, cfg: Config | None = None
           ) -> torch.Tensor:
    """y = x @ W.T (+ bias), bf16 [M, N], for x bf16 [M <= 64, K] on W's device."""
    n, k = f.shape
    _check_x(x, k)
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # rows are read as 16-byte vectors
        x = x.contiguous()
    cfg = cfg or default_config(m, n, _multiprocessors(x.device.index or 0))
    has_bias = bias is not None
    if has_bias and (bias.dtype != torch.bfloat16 or bias.numel() != n):
        bias = bias.to(torch.bfloat16).reshape(n)
    blocks = n // TILE_ROWS // _tiles(m, n, cfg)
    kernels(m, cfg, x.device, n)["glyd_mm"](
        (blocks,), (32 * (cfg.warps + cfg.escape_warps),),
        [y, f.data, x, bias.contiguous() if has_bias else y, f.rowptr, f.esc, m, n, k, x.stride(0), f.lo,
         int(has_bias)])
    return y


def preload(n: int, device: torch.device) -> None:
    """Compile and load the builds a weight of n rows runs (one a size class of x up to FUSED_ROWS, the decode) now,
    at load time: a first load synchronizes the device, which a CUDA-graph capture must not see."""
    sms = _multiprocessors(device.index or 0)
    for rows in (1, 9, 17, 33):
        if rows <= FUSED_ROWS:
            kernels(rows, default_config(rows, n, sms), device, n)
    kernels(1, Config(), device)


def decode(f: FragmentWeight) -> torch.Tensor:
    """W in bf16 [N, K], bit for bit."""
    n, k = f.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=f.data.device)
    ks = kernels(1, Config(), f.data.device)
    units = (n // TILE_ROWS) * (k // CHUNK_COLS)
    ks["glyd_mm_decode"]((math.ceil(units / 4),), (128,), [out, f.data, n, k, f.lo])
    if f.esc.numel():
        ks["glyd_mm_patch"]((math.ceil(n / 4),), (128,), [out, f.rowptr, f.esc, n, k])
    return out


def gather_rows(f: FragmentWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W, bf16 [ids.numel(), K], bit for bit, decoding only those rows (an embedding lookup); ids
    outside [0, N) give zero rows."""
    n, k = f.shape
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), k, dtype=torch.bfloat16, device=f.data.device)
    if flat.numel():
        ks = kernels(1, Config(), f.data.device)
        esc = f.esc if f.esc.numel() else f.rowptr  # never read: every row's list is empty
        ks["glyd_mm_gather"]((flat.numel(),), (128,), [out, f.data, flat, f.rowptr, esc, n, k, f.lo])
    return out


__all__ = ["MAX_ROWS", "Config", "decode", "default_config", "gather_rows", "matmul", "preload"]
