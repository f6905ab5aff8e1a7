"""The SWAR decode experiment (`kernels.kv_decode_swar`): pages decode bit for bit and attention matches fp32, with
escapes (3-bit layout: ~5% of values, so words hold several) and on escape-free data (the 4-bit variant, which does
not decode its escapes). Runs under TRITON_INTERPRET=1 on the CPU; GLYD_TEST_DEVICE=cuda runs it natively (the
inline-asm paths)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernel_helpers import layout  # noqa: E402

from kernels.kv_decode_attention import reference_attention  # noqa: E402
from kernels.kv_decode_swar import (  # noqa: E402
    NibbleLayout,
    decode_pages_swar,
    kv_decode_attention_swar,
    pack_bases,
    write_pages_swar,
)

DEV = os.environ.get("GLYD_TEST_DEVICE", "cpu")


def _windowed(T: int, H: int, D: int, bases: torch.Tensor, g: torch.Generator, width: int,
              escapes: float = 0.0, extreme: bool = False) -> torch.Tensor:
    """bf16 [T, H, D] with random sign/mantissa and exponents inside their channel's window, but for a share
    `escapes` of values, whose exponents are outside it: anywhere in 0..255 (zeros, subnormals, inf/NaN) when
    `extreme`, else within 40 below and 4 above the window (finite, for attention)."""
    sm = torch.randint(0, 256, (T, H, D), generator=g, dtype=torch.int32)
    e = bases.to(torch.int32).unsqueeze(0) - torch.randint(0, width, (T, H, D), generator=g, dtype=torch.int32)
    lo, hi = (0, 256) if extreme else (80, 135)
    out = torch.randint(lo, hi, (T, H, D), generator=g, dtype=torch.int32)
    outside = (out > bases.to(torch.int32)) | (out <= bases.to(torch.int32) - width)
    pick = (torch.rand(T, H, D, generator=g) < escapes) & outside
    e = torch.where(pick, out, e)
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("D,G,nib", [(64, 4, False), (128, 2, False), (128, 4, True)])
def test_swar_layout_decodes_exactly_and_attends(D: int, G: int, nib: bool) -> None:
    g = torch.Generator().manual_seed(D)
    H, B = 2, 16
    lay = NibbleLayout(D, B, 1, 1) if nib else layout(D, B, 8, 8)  # 8 escape bytes a token: no overflow
    width = 15 if nib else 7
    bases = torch.randint(120, 130, (2, H, D), generator=g, dtype=torch.int32).to(torch.uint8)
    lens = [37, 20]
    n_pages = [3, 2]  # whole pages are written (the rows past each length are there but never read)
    rate = 0.0 if nib else 0.05
    nb = 6
    cache = torch.randint(0, 256, (nb, H, lay.page_bytes), dtype=torch.uint8, generator=g)
    bt = torch.tensor([[4, 0, 5], [2, 1, 3]], dtype=torch.int32)
    slots = torch.cat([bt[s, :m].long().repeat_interleave(B) * B + torch.arange(m * B) % B
                       for s, m in enumerate(n_pages)])
    packed = pack_bases(bases, width).to(DEV)
    # every written row of every page, bit for bit, with escapes of any exponent (0 and 255 included)
    xk = _windowed(B * sum(n_pages), H, D, bases[0], g, width, rate, extreme=True)
    xv = _windowed(B * sum(n_pages), H, D, bases[1], g, width, rate, extreme=True)
    assert write_pages_swar(cache, lay, bases, xk, xv, slots) == 0  # every escape fits its page
    dk, dv = decode_pages_swar(cache.to(DEV), lay, packed, bt.view(-1).to(DEV))
    for got, want in ((dk, xk), (dv, xv)):
        rows = torch.cat([got.view(2, 3, H, B, D)[s, :m].permute(0, 2, 1, 3).reshape(-1, H, D)
                          for s, m in enumerate(n_pages)]).cpu()
        assert torch.equal(rows.view(torch.int16), want.view(torch.int16))
    # then finite data for attention
    k = _windowed(B * sum(n_pages), H, D, bases[0], g, width, rate)
    v = _windowed(B * sum(n_pages), H, D, bases[1], g, width, rate)
    assert write_pages_swar(cache, lay, bases, k, v, slots) == 0
    k = torch.cat([k[: lens[0]], k[B * n_pages[0] : B * n_pages[0] + lens[1]]])
    v = torch.cat([v[: lens[0]], v[B * n_pages[0] : B * n_pages[0] + lens[1]]])
    cache = cache.to(DEV)
    dk, dv = decode_pages_swar(cache, lay, packed, bt.view(-1).to(DEV))
    ks, vs = list(torch.split(k, lens)), list(torch.split(v, lens))
    for s, n in enumerate(lens):
        for got, want in ((dk, ks[s]), (dv, vs[s])):
            rows = got.view(2, 3, H, B, D)[s].permute(0, 2, 1, 3).reshape(-1, H, D)[:n].cpu()
            assert torch.equal(rows.view(torch.int16), want.view(torch.int16))
    q = torch.randn(2, H * G, D, generator=g).to(torch.bfloat16)
    ref = reference_attention(q, ks, vs, D ** -0.5)
    for splits, pages in ((1, 1), (2, 1), (1, 2), (2, 2)):
        out = torch.full_like(q, float("nan")).to(DEV)
        kv_decode_attention_swar(q.to(DEV), cache, lay, packed, bt.to(DEV), torch.tensor(lens, dtype=torch.int32,
                                 device=DEV), max(lens), D ** -0.5, out=out, num_splits=splits, pages=pages)
        err = float((out.float().cpu() - ref).norm() / ref.norm())
        assert not out.isnan().any() and err < 1e-2, err
