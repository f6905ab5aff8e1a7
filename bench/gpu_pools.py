"""What bench/gpu.py, bench/gpu_model.py and bench/gpu_graph.py share: the shapes (Qwen3-8B's attention layer, the
modelled decode step), the source of K/V tokens, a page code's pool (`Code`), the pools of every code (`Pools`) and
the timer. The three import it and not each other's types, so bench/ imports in no circle
(tests/test_import_graph.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from glyd_engine.format import kv_page as kp
from glyd_kernels import kv_cuda

ROOT = Path(__file__).resolve().parents[1]
HQ, H, D, B = 32, 8, 128, 16
SAMPLES = ROOT / "bench" / "kv_samples" / "smollm2_kv.safetensors"
MAX_BITS = 11.3  # the page code's budget at D = 128, everything included
SCALE = D ** -0.5
LAYERS = 36  # a decode step of Qwen3-8B: its attention layers
CONTEXT = 8192  # the modelled sequences' tokens


def bench_fn(fn: Callable[[], object]) -> float:
    """Median ms of fn replayed from a CUDA graph."""
    import triton.testing as tt

    return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))


class Source:
    """Resamples recorded K/V rows into [N, 8, 128] bf16 with the recorded per-channel statistics. `shift` scales
    every value by 2**shift, exactly (bf16 keeps the mantissa): every exponent moves by `shift`, so tables
    calibrated on the unscaled values see many escapes (the high-escape regime of bench/gpu.py)."""

    def __init__(self, layer: int, device: str, seed: int = 0, shift: int = 0) -> None:
        from safetensors.torch import load_file

        rec = load_file(str(SAMPLES))
        tiled = []
        for kv in ("k", "v"):
            x = rec[f"{kv}{layer}"]  # [T, 3, 64]
            heads = [torch.cat([x[:, h % 3], x[:, (h + 1) % 3]], dim=-1) for h in range(H)]
            t = torch.stack(heads, dim=1)  # [T, 8, 128]
            if shift:
                scaled = (t.float() * 2.0**shift).to(torch.bfloat16)
                if not torch.equal(scaled.float(), t.float() * 2.0**shift):
                    raise ValueError(f"layer {layer} scaled by 2**{shift} is not exact in bf16")
                t = scaled
            tiled.append(t.to(device))
        self.k, self.v = tiled
        self.layer, self.shift = layer, shift
        self.n = self.k.shape[0]
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, self.n, (n, H), generator=self.gen, device=self.device)
        hh = torch.arange(H, device=self.device).view(1, H)
        return self.k[idx, hh], self.v[idx, hh]

    def tops(self, code_bits: int) -> torch.Tensor:
        counts = []
        for x in (self.k, self.v):
            e = ((x.view(torch.int16).to(torch.int32) >> 7) & 0xFF).to(torch.int64).cpu()
            counts.append(torch.nn.functional.one_hot(e, 256).sum(0))
        return kp.best_windows(torch.stack(counts), code_bits)  # [2, H, D]


def escape_stats(src: Source, tops: torch.Tensor, code_bits: int) -> dict[str, float]:
    """Escapes of 64k tokens drawn from `src` under the window tops: rates of K, V and both, entries a 16-token tile."""
    w = kp.window(code_bits)
    k, v = src.draw(4096 * 16)
    low = tops.to(k.device).to(torch.int32) - (w - 1)
    esc = []
    for kv, x in enumerate((k, v)):
        e = (x.view(torch.int16).to(torch.int32) >> 7) & 0xFF
        esc.append(((e < low[kv]) | (e >= low[kv] + w)).view(-1, 16, H, D).sum((1, 3)).float())  # [tiles, H]
    per_tile = (esc[0] + esc[1]).flatten()
    k_rate, v_rate = float(esc[0].mean() / (16 * D)), float(esc[1].mean() / (16 * D))
    return {"k_escape_rate": k_rate, "v_escape_rate": v_rate, "escape_rate": (k_rate + v_rate) / 2,
            "entries_a_tile_mean": float(per_tile.mean()), "entries_a_tile_p90": float(per_tile.quantile(0.9)),
            "entries_a_tile_max": float(per_tile.max())}


def reserve_for(src: Source, tops: torch.Tensor, code_bits: int) -> tuple[int, dict[str, float]]:
    """The reserve (entries a tile): the 3-bit code's as large as MAX_BITS allows (a tile past its list costs the
    kernel dependent loads), the 4-bit code's the calibration rule's (mean + one standard deviation)."""
    stats = escape_stats(src, tops, code_bits)
    mean = stats["entries_a_tile_mean"]
    if code_bits == 3:
        reserve = max(r for r in range(4, 400, 8) if bits_per_value(kp.KVPageLayout(D, B, r, 3)) <= MAX_BITS)
    else:
        reserve = kp.valid_reserve(math.ceil(mean + math.sqrt(mean)))
    return reserve, stats


def bits_per_value(lay: kp.KVPageLayout) -> float:
    """Pages plus the overflow run pointers (4 bytes a tile and K/V)."""
    return 8 * lay.token_bytes / (2 * D) + 64 / (B * 2 * D)


class Code:
    """One page code (3 or 4 bits) over the shared source data: its layout, its pool written by the CUDA writer."""

    def __init__(self, code_bits: int, src: Source, nblocks: int, dev: str, calib: Source | None = None) -> None:
        """Tables (window tops, reserve) from `calib` (default: `src`, whose tokens the pool holds), as the product
        calibrates on some text and then holds any; the escape figures are those of `src` under those tables."""
        self.bits = code_bits
        calib = src if calib is None else calib
        tops = calib.tops(code_bits)
        reserve, stats = reserve_for(calib, tops, code_bits)
        if calib is not src:
            stats = escape_stats(src, tops, code_bits)
        self.lay = kp.KVPageLayout(D, B, reserve, code_bits)
        self.tops = tops.to(dev)
        self.info = {"reserve": reserve, "token_bytes": self.lay.token_bytes, "bits_per_value": bits_per_value(
            self.lay), "capacity_vs_bf16": 4 * D / (self.lay.token_bytes + 8 / B), **stats}
        t0 = time.perf_counter()
        kv_cuda.kernels(self.lay, HQ // H, torch.device(dev))
        self.info["first_compile_s"] = time.perf_counter() - t0
        self.cache = torch.empty(nblocks, H, self.lay.page_bytes, dtype=torch.uint8, device=dev)
        self.ovf = kp.OverflowStore(nblocks, H, device=dev)
        self.write_rounds = 0

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.write_rounds += kv_cuda.write(self.cache, self.lay, self.tops, self.ovf, k, v, slots)

    def pool_info(self, tokens: int) -> dict[str, object]:
        return {"overflow_runs": self.ovf.runs_in_use, "overflow_bits_per_value": 8 * self.ovf.bytes_held / (
            tokens * H * 2 * D), "write_rounds": self.write_rounds}


# --- the pools: the same bf16 tokens in vLLM's layout and in each code's pages ---------------------------------------
@dataclass
class Pools:
    k: torch.Tensor  # [blocks, B, H, D] bf16: vLLM's layout
    v: torch.Tensor
    codes: dict[int, Code]  # bits -> the same tokens in that code's pages
    tokens: int
    refused: dict[int, str]  # bits -> why the overflow arena refused that code's tokens (its pool dropped)

    @property
    def nblocks(self) -> int:
        return self.k.shape[0]


def fill_pools(src: Source, code_bits: list[int], max_tokens: int, dev: str, calib: Source | None = None) -> Pools:
    """Every code's pages written by the CUDA writer from the same tokens as the bf16 pool, 32k tokens a call (each
    code's tables calibrated on `calib`, default `src`). A code whose escapes outgrow the overflow arena's address
    range (MemoryError, as the engine would refuse it) is dropped and named in `refused`; the others go on."""
    chunk = 32768
    max_tokens = -(-max_tokens // chunk) * chunk  # whole chunks: every block of the pool holds written tokens
    nblocks = max_tokens // B
    k_pool = torch.empty(nblocks, B, H, D, dtype=torch.bfloat16, device=dev)
    v_pool = torch.empty_like(k_pool)
    codes = {cb: Code(cb, src, nblocks, dev, calib) for cb in code_bits}
    refused: dict[int, str] = {}
    for start in range(0, max_tokens, chunk):
        k, v = src.draw(chunk)
        k_pool.view(-1, H, D)[start : start + chunk] = k
        v_pool.view(-1, H, D)[start : start + chunk] = v
        slots = torch.arange(start, start + chunk, device=dev)
        for cb, code in list(codes.items()):
            try:
                code.write(k, v, slots)
            except MemoryError as exc:
                refused[cb] = f"after {start} of {max_tokens} tokens: {exc}"
                del codes[cb]
                torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return Pools(k_pool, v_pool, codes, max_tokens, refused)
