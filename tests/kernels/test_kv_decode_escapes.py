"""The word-wide decoder on escape-heavy pages: ~5% of values escape (so words hold several), with exponents of
any value (0 and 255 included), pages holding all their escapes or overflowing most of them. Every written value
decodes bit for bit and attention matches fp32, with several pages a tile and context splits. Runs under
TRITON_INTERPRET=1 on the CPU; GLYD_TEST_DEVICE=cuda runs it natively (the inline-asm paths)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernel_helpers import layout  # noqa: E402

from glyd_engine.format.kv_page import KVPageCodec, window_tables  # noqa: E402
from kernels.kv_decode_attention import decode_pages, kv_decode_attention, pack_bases, reference_attention  # noqa: E402
from kernels.kv_page_write import DeviceOverflowStore, PageWriter  # noqa: E402

DEV = os.environ.get("GLYD_TEST_DEVICE", "cpu")
WIDTH = 7


def _windowed(T: int, H: int, D: int, tops: torch.Tensor, g: torch.Generator, escapes: float,
              extreme: bool = False) -> torch.Tensor:
    """bf16 [T, H, D] with random sign/mantissa and exponents inside their channel's window, but for a share
    `escapes` of values, whose exponents are outside it: anywhere in 0..255 (zeros, subnormals, inf/NaN) when
    `extreme`, else within 40 below and 4 above the window (finite, for attention)."""
    sm = torch.randint(0, 256, (T, H, D), generator=g, dtype=torch.int32)
    e = tops.to(torch.int32).unsqueeze(0) - torch.randint(0, WIDTH, (T, H, D), generator=g, dtype=torch.int32)
    lo, hi = (0, 256) if extreme else (80, 135)
    out = torch.randint(lo, hi, (T, H, D), generator=g, dtype=torch.int32)
    outside = (out > tops.to(torch.int32)) | (out <= tops.to(torch.int32) - WIDTH)
    pick = (torch.rand(T, H, D, generator=g) < escapes) & outside
    e = torch.where(pick, out, e)
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("D,G,reserve", [(64, 4, 8), (128, 2, 16), (64, 2, 1)])
def test_escape_heavy_pages_decode_exactly_and_attend(D: int, G: int, reserve: int) -> None:
    g = torch.Generator().manual_seed(D + reserve)
    H, B = 2, 16
    lay = layout(D, B, reserve, reserve)  # 8 escape bytes a token at D 64, 16 at 128: all fit; 1: most overflow
    tops = torch.randint(120, 130, (2, H, D), generator=g, dtype=torch.int32).to(torch.uint8)
    dec = window_tables(tops)
    lens = [37, 20]
    bt = torch.tensor([[4, 0, 5], [2, 1, 3]], dtype=torch.int32)
    slots = torch.cat([bt[s, : (n + B - 1) // B].long().repeat_interleave(B)[:n] * B + torch.arange(n) % B
                       for s, n in enumerate(lens)])
    packed = pack_bases(dec).to(DEV)
    writer = PageWriter(lay, dec.to(DEV))
    codec = KVPageCodec(lay, dec)
    for extreme in (True, False):  # any exponent for the bit checks, then finite data for attention
        cache = torch.randint(0, 256, (6, H, lay.page_bytes), dtype=torch.uint8, generator=g)
        ref_cache, ref_ovf = cache.clone(), codec.new_overflow(6)
        ovf = DeviceOverflowStore(6, H, device=DEV)
        cache = cache.to(DEV)
        k = _windowed(sum(lens), H, D, tops[0], g, 0.05, extreme)
        v = _windowed(sum(lens), H, D, tops[1], g, 0.05, extreme)
        writer.write(cache, ovf, k.to(DEV), v.to(DEV), slots.to(DEV))
        codec.write(ref_cache, ref_ovf, k, v, slots)
        assert (ovf.values_written > 0) == (reserve == 1)
        dk, dv = decode_pages(cache, lay, packed, bt.view(-1).to(DEV), ovf if ovf.values_written else None)
        ks, vs = list(torch.split(k, lens)), list(torch.split(v, lens))
        for s, n in enumerate(lens):
            for got, want in ((dk, ks[s]), (dv, vs[s])):
                rows = got.view(2, 3, H, B, D)[s].permute(0, 2, 1, 3).reshape(-1, H, D)[:n].cpu()
                assert torch.equal(rows.view(torch.int16), want.view(torch.int16))
    q = torch.randn(2, H * G, D, generator=g).to(torch.bfloat16)
    ref = reference_attention(q, ks, vs, D ** -0.5)
    for splits, pages in ((1, 1), (2, 1), (1, 2), (2, 2)):
        out = torch.full_like(q, float("nan")).to(DEV)
        kv_decode_attention(q.to(DEV), cache, lay, packed, bt.to(DEV), torch.tensor(lens, dtype=torch.int32,
                            device=DEV), max(lens), D ** -0.5, ovf if ovf.values_written else None, out=out,
                            num_splits=splits, pages=pages)
        err = float((out.float().cpu() - ref).norm() / ref.norm())
        assert not out.isnan().any() and err < 1e-2, err


def test_a_run_ending_at_the_arena_end_decodes() -> None:
    """The arena's last word holds escapes too: runs are handed out up to the arena's end before it grows."""
    H, D, B = 1, 64, 16
    lay = layout(D, B, 0, 0)  # no reserve: every escape goes to the block's overflow run
    dec = window_tables(torch.full((2, H, D), 126, dtype=torch.uint8))
    g = torch.Generator().manual_seed(3)
    k = _windowed(B, H, D, torch.full((H, D), 126, dtype=torch.uint8), g, 0.0)
    v = _windowed(B, H, D, torch.full((H, D), 126, dtype=torch.uint8), g, 0.0)
    bits = k.view(torch.int16).view(-1)
    spots = torch.randperm(B * D, generator=g)[:16]
    bits[spots] = (bits[spots] & ~0x7F80) | (50 << 7)  # 16 K escapes: a 16-byte run, the whole arena
    ovf = DeviceOverflowStore(1, H, initial_bytes=16, device=DEV)
    cache = torch.zeros(1, H, lay.page_bytes, dtype=torch.uint8, device=DEV)
    PageWriter(lay, dec.to(DEV)).write(cache, ovf, k.to(DEV), v.to(DEV), torch.arange(B, device=DEV))
    assert ovf.arena.numel() == 16 and ovf.values_written == 16 and ovf.grows == 0
    dk, dv = decode_pages(cache, lay, pack_bases(dec).to(DEV), torch.zeros(1, dtype=torch.int32, device=DEV), ovf)
    assert torch.equal(dk[0].transpose(0, 1).cpu().view(torch.int16), k.view(torch.int16))
    assert torch.equal(dv[0].transpose(0, 1).cpu().view(torch.int16), v.view(torch.int16))
