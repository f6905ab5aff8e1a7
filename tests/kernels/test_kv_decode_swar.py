"""The SWAR decode experiment (`kernels.kv_decode_swar`): its fast path decodes pages bit for bit and its
attention matches fp32, on data without escapes (the experiment does not decode escapes). Runs under
TRITON_INTERPRET=1 on the CPU; GLYD_TEST_DEVICE=cuda runs it natively (the inline-asm paths)."""

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


def _windowed(T: int, H: int, D: int, bases: torch.Tensor, g: torch.Generator, width: int) -> torch.Tensor:
    """bf16 [T, H, D] with random sign/mantissa and every exponent inside its channel's window (no escapes)."""
    sm = torch.randint(0, 256, (T, H, D), generator=g, dtype=torch.int32)
    e = bases.to(torch.int32).unsqueeze(0) - torch.randint(0, width, (T, H, D), generator=g, dtype=torch.int32)
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("D,G,nib", [(64, 4, False), (128, 2, False), (128, 4, True)])
def test_swar_fast_path_decodes_exactly_and_attends(D: int, G: int, nib: bool) -> None:
    g = torch.Generator().manual_seed(D)
    H, B = 2, 16
    lay = NibbleLayout(D, B, 1, 1) if nib else layout(D, B, 1, 1)
    width = 15 if nib else 7
    bases = torch.randint(120, 130, (2, H, D), generator=g, dtype=torch.int32).to(torch.uint8)
    lens = [37, 20]
    k = _windowed(sum(lens), H, D, bases[0], g, width)
    v = _windowed(sum(lens), H, D, bases[1], g, width)
    nb = 6
    cache = torch.randint(0, 256, (nb, H, lay.page_bytes), dtype=torch.uint8, generator=g)
    bt = torch.tensor([[4, 0, 5], [2, 1, 3]], dtype=torch.int32)
    slots = torch.cat([bt[s, torch.arange(n) // B].long() * B + torch.arange(n) % B for s, n in enumerate(lens)])
    assert write_pages_swar(cache, lay, bases, k, v, slots) == 0
    cache, packed = cache.to(DEV), pack_bases(bases, width).to(DEV)
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
