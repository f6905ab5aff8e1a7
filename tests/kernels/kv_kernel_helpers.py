"""Shared builders for the kernel tests: tables and K/V with real-looking exponent statistics."""

from __future__ import annotations

import torch

from glyd_engine.format import bf16
from glyd_engine.format.kv_page import KVPageLayout, best_windows


def make_kv(T: int, H: int, D: int, gen: torch.Generator, spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """K with per-channel scales (keys cluster by channel), V per token; a few specials (0, -0, tiny, big)."""
    ch = torch.exp(torch.randn(H, D, generator=gen) * 1.5 * spread)
    k = (torch.randn(T, H, D, generator=gen) * ch).to(torch.bfloat16)
    tok = torch.exp(torch.randn(T, 1, 1, generator=gen) * spread)
    v = (torch.randn(T, H, D, generator=gen) * tok).to(torch.bfloat16)
    flat = k.view(-1)
    n = flat.numel()
    idx = torch.randint(0, n, (max(1, n // 500),), generator=gen)
    flat[idx[0::4]] = 0.0
    flat[idx[1::4]] = -0.0
    flat[idx[2::4]] = 1e-30
    flat[idx[3::4]] = 3e4
    return k, v


def tables_from(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """decode table uint8 [2, H, D, 7]: each channel's best 7-exponent window in this data."""
    out = []
    for x in (k, v):
        e, _ = bf16.split(x)
        out.append(best_windows(torch.nn.functional.one_hot(e.to(torch.int64), 256).sum(0)))  # [H, D, 7]
    return torch.stack(out)


def layout(D: int, B: int = 16, e_k: int = 2, e_v: int = 2) -> KVPageLayout:
    return KVPageLayout(D, B, e_k, e_v)
