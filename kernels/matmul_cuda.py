"""Launchers of the CUDA Glyd matmuls (kernels/cuda/matmul.cu, matmul_wide.cu, matmul_wgmma.cu) on fragment-order
weights (format/fragment_weight.py).

`matmul` runs y = x @ W.T (+ bias) for 1-128 rows of x in one launch. Up to 16 rows a block holds 16 rows of W, its
warps stream a share of K each chunk by chunk through registers into the tensor cores, 1-4 more warps add the
escapes, and the warps' sums meet in shared memory in a fixed order (the same bits on every run). Past 16 rows a
block's warps hold 16 rows of W each and share x's chunks through shared memory, K split between blocks whose sums
the last of them adds in order (`WideConfig`); on Hopper, for large W, a warpgroup's four warps decode into the A
registers of warpgroup MMAs, x first laid out as the images of its stages (`WgmmaConfig`). `decode` writes W out
in bf16 for prefill-sized matmuls (decode once, then the bf16 GEMM).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from glyd_engine.format import fragment_weight as fw
from glyd_engine.format.fragment_weight import CHUNK_COLS, TILE_ROWS, FragmentWeight
from glyd_kernels import nvrtc

SOURCE = "matmul.cu"
KERNELS = ("glyd_mm", "glyd_mm_decode", "glyd_mm_patch", "glyd_mm_gather")
WIDE_SOURCE = "matmul_wide.cu"
WGMMA_SOURCE = "matmul_wgmma.cu"  # Hopper only (sm_90a)
MAX_ROWS = 128  # rows of x the kernels take: 8-row MMA tiles of x, 1-16 of them
FUSED_ROWS = 64  # up to this many rows the layer runs the kernels; more decode once and use the bf16 GEMM
WGMMA_WEIGHTS = 16 << 20  # on Hopper, W of at least this many weights runs the warpgroup-MMA kernel past 32 rows
WGMMA_WEIGHTS_32 = 64 << 20  # ... and from 17 rows on, W of at least this many


@dataclass(frozen=True)
class Config:
    tiles: int = 0  # 16-row tiles of W a block (1 or 2; 0: 1 for up to 8 rows of x, 2 above, where W's tiles pair up)
    warps: int = 8  # streaming warps a block, each a share of K
    stages: int = 2  # chunks a warp holds in registers (one decoding, the rest loading)
    min_blocks: int = 2  # blocks a multiprocessor (the register budget)
    escape_warps: int = 1  # warps a block that walk the escape lists (1, 2 or 4)


@dataclass(frozen=True)
class WideConfig:
    """The kernel past 16 rows of x (matmul_wide.cu)."""

    warps: int = 8  # 16-row tiles of W a block, a warp each, sharing x's chunks
    stages: int = 4  # chunks of x and W in the shared-memory ring
    min_blocks: int = 2  # blocks a multiprocessor (the register budget)
    splits: int = 0  # blocks K is split between (0: `wide_splits`)
    pipe: int = 1  # 1: the ring's stages handed over by mbarriers; 0: a block barrier a chunk


@dataclass(frozen=True)
class WgmmaConfig:
    """The kernel past 16 rows of x on Hopper (matmul_wgmma.cu): W decoded into the A registers of warpgroup MMAs."""

    warpgroups: int = 1  # warpgroups a block, each 64 rows of W, sharing x's chunks
    stages: int = 4  # chunks of x and W in the shared-memory ring
    min_blocks: int = 3  # blocks a multiprocessor (the register budget)
    splits: int = 0  # blocks K is split between (0: `wide_splits`)
    x_image: int = 1  # 1: x is first laid out as its stages' images (one bulk copy a stage instead of every thread's)

    @property
    def warps(self) -> int:
        return 4 * self.warpgroups


Wide = WideConfig | WgmmaConfig


def default_config(rows: int, n: int = 0, sms: int = 132, k: int = 4096,
                   wgmma: bool = False) -> Config | WideConfig | WgmmaConfig:
    """The H200's best of bench/gpu_linear.py's sweeps (docs/benchmarks.md) for W of n rows and k columns. Up to 16
    rows of x, where W has at most two 16-row tiles a multiprocessor, more streaming warps a block (each a shorter
    share of K), and for 9-16 rows four escape warps (their walk is the longer there), else 8 or 6 streaming warps
    and two escape warps. 17-32 rows: the streaming kernel on such a W when K is short, else the wide one with 8
    tiles a block; 33-64 rows the wide one with 4 tiles a block, three blocks a multiprocessor (65-128 rows: 4 tiles,
    two blocks, for callers that ask; layers decode past 64 there). On Hopper (`wgmma`) W of WGMMA_WEIGHTS or more
    takes the warpgroup-MMA kernel (x's stage images laid out first) for 33-128 rows, and W of WGMMA_WEIGHTS_32 or
    more from 17 rows, six blocks a multiprocessor there. Every default compiles without spills
    (tests/kernels/test_kv_cuda_build.py)."""
    few_tiles = n // TILE_ROWS <= 2 * sms
    if wgmma and rows > 16 and n * k >= (WGMMA_WEIGHTS if rows > 32 else WGMMA_WEIGHTS_32):
        return WgmmaConfig(warpgroups=1, stages=3, min_blocks=6 if rows <= 32 else 4 if rows <= 64 and k > 4096 else 3)
    if rows > 64:
        return WideConfig(warps=4, stages=4, min_blocks=2)
    if rows > 32:
        return WideConfig(warps=4, stages=3, min_blocks=3)
    if rows > 16:
        return Config(tiles=1, warps=4, stages=2, min_blocks=2, escape_warps=2) if few_tiles and k <= 4096 else \
            WideConfig(warps=8, stages=3, min_blocks=2)
    if rows <= 8:
        return Config(tiles=1, warps=14 if few_tiles else 8, min_blocks=2, escape_warps=2)
    return Config(tiles=1, warps=8, min_blocks=2, escape_warps=4) if few_tiles else \
        Config(tiles=1, warps=6, min_blocks=3, escape_warps=2)


def fused_rows(n: int, k: int, device: int) -> int:
    """Rows of x up to which a layer with W of n x k runs the fused kernels (more: decode once, then the bf16 GEMM).
    On Hopper the warpgroup-MMA kernel beats decoding up to 128 rows for W of WGMMA_WEIGHTS or more."""
    return MAX_ROWS if n * k >= WGMMA_WEIGHTS and has_wgmma(device) else FUSED_ROWS


def _tiles(rows: int, n: int, cfg: Config) -> int:
    nt = cfg.tiles or (2 if 8 < rows <= 16 else 1)
    return nt if (n // TILE_ROWS) % nt == 0 else 1


def x_tiles(rows: int) -> int:
    """8-row MMA tiles of x a build takes: 1, 2, 4, 8 or 16."""
    return 1 << max(0, math.ceil(rows / 8) - 1).bit_length()


def defines(rows: int, cfg: Config, n: int = TILE_ROWS * 2) -> dict[str, int]:
    return {"MT": x_tiles(rows), "NT": _tiles(rows, n, cfg), "WARPS": cfg.warps, "STAGES": cfg.stages,
            "MIN_BLOCKS": cfg.min_blocks, "EW": cfg.escape_warps}


def wide_defines(rows: int, cfg: WideConfig) -> dict[str, int]:
    return {"MT": x_tiles(rows), "WT": cfg.warps, "STAGES": cfg.stages, "MIN_BLOCKS": cfg.min_blocks,
            "PIPE": cfg.pipe}


def wide_smem(rows: int, cfg: Wide) -> int:
    """Bytes of the ring: a stage holds 8 MT rows of x's 64-column chunk and each warp's 1,536-byte chunk of W; the
    warpgroup-MMA kernel takes a kilobyte more to align the ring to its swizzle atoms."""
    ring = cfg.stages * (x_tiles(rows) * 8 * 128 + cfg.warps * 1536)
    return ring + 1024 if isinstance(cfg, WgmmaConfig) else ring


def wgmma_defines(rows: int, cfg: WgmmaConfig) -> dict[str, int]:
    return {"MT": x_tiles(rows), "WG": cfg.warpgroups, "STAGES": cfg.stages, "MIN_BLOCKS": cfg.min_blocks,
            "XIMAGE": cfg.x_image}


def x_image_bytes(rows: int, k: int, cfg: Wide) -> int:
    """Bytes of x's stage images (`WgmmaConfig.x_image`): 8 MT rows of 128 bytes a 64-column chunk."""
    return k // CHUNK_COLS * x_tiles(rows) * 8 * 128 if isinstance(cfg, WgmmaConfig) and cfg.x_image else 0


def wide_groups(n: int, cfg: Wide) -> int:
    """Tile groups of W (a block each, per K split): `cfg.warps` 16-row tiles a group."""
    return -(-n // (TILE_ROWS * cfg.warps))


def wide_splits(n: int, k: int, cfg: Wide, sms: int) -> int:
    """Blocks K is split between: enough for the tile groups to fill the GPU's block slots, each split at least two
    512-column groups (fewer sums to add, a ring that fills)."""
    groups = wide_groups(n, cfg)
    col_groups = -(-k // fw.GROUP_COLS)
    if cfg.splits:
        return max(1, min(cfg.splits, col_groups))
    want = -(-sms * cfg.min_blocks * 9 // 10 // groups)
    return max(1, min(want, col_groups // 2))


@functools.lru_cache(maxsize=64)
def _module(defs: tuple[tuple[str, int], ...], device: int) -> dict:
    return nvrtc.load(SOURCE, dict(defs), KERNELS, device)


@functools.lru_cache(maxsize=32)
def _wide_module(defs: tuple[tuple[str, int], ...], smem: int, device: int) -> nvrtc.Kernel:
    kernel = nvrtc.load(WIDE_SOURCE, dict(defs), ("glyd_mm_wide",), device)["glyd_mm_wide"]
    nvrtc.set_max_smem(kernel, smem)
    return kernel


@functools.lru_cache(maxsize=32)
def _wgmma_module(defs: tuple[tuple[str, int], ...], smem: int, device: int) -> dict[str, nvrtc.Kernel]:
    ks = nvrtc.load(WGMMA_SOURCE, dict(defs), ("glyd_mm_wgmma", "glyd_mm_x_image"), device, arch="sm_90a")
    nvrtc.set_max_smem(ks["glyd_mm_wgmma"], smem)
    return ks


@functools.lru_cache(maxsize=8)
def has_wgmma(device: int) -> bool:
    """Whether the device runs matmul_wgmma.cu: Hopper (sm_90), whose warpgroup MMA no other architecture has, where
    its sm_90a build compiles and loads (else the mma.sync kernels run, logged)."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        wide_kernel(64, WgmmaConfig(), torch.device("cuda", device))
    except nvrtc.KernelBuildError as exc:
        nvrtc.log.warning("Glyd: the warpgroup-MMA matmul is not available (%s); the mma.sync kernels run", exc)
        return False
    return True


def kernels(rows: int, cfg: Config, device: torch.device, n: int = TILE_ROWS * 2) -> dict:
    return _module(tuple(sorted(defines(rows, cfg, n).items())), device.index or 0)


def wide_kernel(rows: int, cfg: Wide, device: torch.device) -> nvrtc.Kernel:
    if isinstance(cfg, WgmmaConfig):
        return _wgmma_kernels(rows, cfg, device)["glyd_mm_wgmma"]
    return _wide_module(tuple(sorted(wide_defines(rows, cfg).items())), wide_smem(rows, cfg), device.index or 0)


def _wgmma_kernels(rows: int, cfg: WgmmaConfig, device: torch.device) -> dict[str, nvrtc.Kernel]:
    return _wgmma_module(tuple(sorted(wgmma_defines(rows, cfg).items())), wide_smem(rows, cfg), device.index or 0)


class _Scratch:
    """A device's split sums (fp32), counters (zero between launches) and x's stage images for the kernels past 16
    rows. Buffers that grew stay alive: a captured CUDA graph may still use them."""

    def __init__(self) -> None:
        self.part: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.image: torch.Tensor | None = None
        self.old: list[torch.Tensor] = []

    def get(self, device: torch.device, part: int, groups: int, image: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.part is None or self.part.numel() < part:
            self._grow()
            self.part = torch.empty(max(part, 1 << 20), dtype=torch.float32, device=device)
        if self.count is None or self.count.numel() < groups:
            self._grow()
            self.count = torch.zeros(max(groups, 4096), dtype=torch.int32, device=device)
        if self.image is None or self.image.numel() < image:
            self._grow()
            self.image = torch.empty(max(image, 1 << 16), dtype=torch.uint8, device=device)
        return self.part, self.count, self.image

    def _grow(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the Glyd matmul's scratch would grow during CUDA-graph capture (preload the weight)")
        self.old += [t for t in (self.part, self.count, self.image) if t is not None]


_SCRATCH: dict[int, _Scratch] = {}


def _scratch(device: torch.device, part: int, groups: int, image: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _SCRATCH.setdefault(device.index or 0, _Scratch()).get(device, part, groups, image)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_x(x: torch.Tensor, cols: int) -> None:
    if x.dim() != 2 or x.shape[1] != cols or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [M, {cols}], not {x.dtype} {tuple(x.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{x.shape[0]} rows: the fused kernel takes up to {MAX_ROWS}; decode once and use the "
                         "bf16 GEMM")


def matmul(x: torch.Tensor, f: FragmentWeight, bias: torch.Tensor | None = None,
           cfg: Config | WideConfig | WgmmaConfig | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias), bf16 [M, N], for x bf16 [M <= 128, K] on W's device."""
    n, k = f.shape
    _check_x(x, k)
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # rows are read as 16-byte vectors
        x = x.contiguous()
    dev = x.device.index or 0
    cfg = cfg or default_config(m, n, _multiprocessors(dev), k, has_wgmma(dev))
    has_bias = bias is not None
    if has_bias and (bias.dtype != torch.bfloat16 or bias.numel() != n):
        bias = bias.to(torch.bfloat16).reshape(n)
    if isinstance(cfg, WideConfig | WgmmaConfig):
        _wide(y, x, f, bias if has_bias else None, cfg)
        return y
    if m > FUSED_ROWS:
        raise ValueError(f"{m} rows: the streaming kernel (Config) takes up to {FUSED_ROWS}; use a WideConfig")
    blocks = n // TILE_ROWS // _tiles(m, n, cfg)
    kernels(m, cfg, x.device, n)["glyd_mm"](
        (blocks,), (32 * (cfg.warps + cfg.escape_warps),),
        [y, f.data, x, bias.contiguous() if has_bias else y, f.rowptr, f.esc, m, n, k, x.stride(0), f.lo,
         int(has_bias)])
    return y


def _wide(y: torch.Tensor, x: torch.Tensor, f: FragmentWeight, bias: torch.Tensor | None, cfg: Wide) -> None:
    n, k = f.shape
    m = x.shape[0]
    if f.colptr is None and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a Glyd weight's colptr must be built before CUDA-graph capture "
                           "(FragmentWeight.with_colptr)")
    f = f.with_colptr()
    splits = wide_splits(n, k, cfg, _multiprocessors(x.device.index or 0))
    groups = wide_groups(n, cfg)
    image_bytes = x_image_bytes(m, k, cfg)
    part, count, image = _scratch(x.device, splits * m * n if splits > 1 else 0, groups, image_bytes)
    src = x
    if image_bytes:  # x's chunks laid out as the stages' images, read by one bulk copy a stage
        units = x_tiles(m) * 8 * 8  # 16-byte units of a chunk's image
        _wgmma_kernels(m, cfg, x.device)["glyd_mm_x_image"](
            (k // CHUNK_COLS, -(-units // 128)), (128,), [image, x, m, x.stride(0)])
        src = image
    wide_kernel(m, cfg, x.device)(
        (groups, splits), (32 * cfg.warps,),
        [y, f.data, src, y if bias is None else bias.contiguous(), f.rowptr, f.colptr, f.esc, part, count, m, n, k,
         x.stride(0), f.lo, int(bias is not None)], smem=wide_smem(m, cfg))


def preload(n: int, device: torch.device, k: int) -> None:
    """Compile and load the builds a weight of n rows (and k columns) runs (one a size class of x up to fused_rows,
    the decode) and its scratch now, at load time: a first load synchronizes the device, which a CUDA-graph capture
    must not see."""
    dev = device.index or 0
    sms, fused = _multiprocessors(dev), fused_rows(n, k, dev)
    for rows in (1, 9, 17, 33, 65):
        if rows > fused:
            break
        cfg = default_config(rows, n, sms, k, has_wgmma(dev))
        if isinstance(cfg, WideConfig | WgmmaConfig):
            wide_kernel(rows, cfg, device)
            top = min(fused, 8 * x_tiles(rows))
            _scratch(device, wide_splits(n, k, cfg, sms) * top * n, wide_groups(n, cfg), x_image_bytes(top, k, cfg))
        else:
            kernels(rows, cfg, device, n)
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


__all__ = ["MAX_ROWS", "Config", "WgmmaConfig", "WideConfig", "decode", "default_config", "gather_rows", "matmul",
           "preload"]
