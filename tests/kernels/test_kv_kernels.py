"""Triton KV kernels against the torch reference (KVPageCodec), run under TRITON_INTERPRET=1 on the CPU.

Checks: pages written by the Triton writer equal the reference's byte for byte (escapes in the page and
past the reserve, decode tokens appended to a page written by a prefill run); pages decoded by the
attention kernel's decoder equal `KVPageCodec.read` bit for bit; decode attention within bf16 tolerance
of an fp32 reference, outputs poisoned with NaN first, with and without the context split, head sizes 64
and 128, GQA, fresh random and recorded demo-model K/V.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernel_helpers import layout, make_kv, tables_from  # noqa: E402

from glyd_engine.format.kv_page import KVPageCodec, window_tables  # noqa: E402
from kernels.kv_decode_attention import (  # noqa: E402
    decode_pages,
    kv_decode_attention,
    pack_bases,
    reference_attention,
)
from kernels.kv_page_write import DeviceOverflowStore, PageWriter  # noqa: E402
from kernels.kv_prefill_attention import kv_prefill_attention, reference_prefill_attention  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[2] / "bench" / "kv_samples" / "smollm2_kv.safetensors"


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def _sections(lay):  # noqa: ANN001, ANN202
    return [(lay.sm_offset(kv), lay.sm_offset(kv) + lay.block_size * lay.head_size) for kv in (0, 1)] + [
        (lay.code_offset(kv), lay.code_offset(kv) + lay.block_size * lay.code_bytes) for kv in (0, 1)]


@pytest.mark.parametrize("D,e,tb,etb", [(64, 1, 16, 4), (128, 3, 4, 1), (64, 2, 1, 8), (256, 2, 8, 2)])
def test_write_matches_reference_and_decodes_exactly(D: int, e: int, tb: int, etb: int) -> None:
    g = torch.Generator().manual_seed(D)
    H, B, nb = 2, 16, 5
    lay = layout(D, B, e, e)
    k, v = make_kv(39, H, D, g, spread=1.5)
    dec = tables_from(k[:12], v[:12])
    codec = KVPageCodec(lay, dec)
    ref_cache = torch.randint(0, 256, (nb, H, lay.page_bytes), dtype=torch.uint8, generator=g)
    cache = ref_cache.clone()
    ref_ovf, ovf = codec.new_overflow(nb), DeviceOverflowStore(nb, H)
    writer = PageWriter(lay, dec, tokens_per_program=tb, escape_tokens_per_program=etb)
    # A prefill run over blocks 3, 1, 4 (the last one partly full), a decode token, a padding slot, then a
    # run that goes on mid-page (rows before it from earlier calls and from itself) with a padding slot inside.
    blocks = torch.tensor([3, 1, 4])
    t = torch.arange(34)
    prefill = blocks[t // B] * B + t % B
    runs = [(slice(0, 34), prefill), (slice(34, 35), torch.tensor([4 * B + 2])),
            (slice(35, 36), torch.tensor([-1])), (slice(36, 39), torch.tensor([4 * B + 3, -1, 4 * B + 4]))]
    for sl, slots in runs:
        codec.write(ref_cache, ref_ovf, k[sl], v[sl], slots)
        writer.write(cache, ovf, k[sl], v[sl], slots)
    assert codec.stats.overflow > 0, "the test must exercise the overflow path"
    assert writer.counters.overflow_values == codec.stats.overflow
    filled = {3: B, 1: B, 4: 5}
    for blk, rows in filled.items():
        for a, b in _sections(lay):
            n = (b - a) // B * rows
            assert torch.equal(cache[blk, :, a : a + n], ref_cache[blk, :, a : a + n])
    rk, rv = codec.read(ref_cache, ref_ovf, blocks)
    ok, ov = codec.read(cache, ovf, blocks)
    dk, dv = decode_pages(cache, lay, pack_bases(dec), blocks, ovf)
    for i, blk in enumerate(blocks.tolist()):
        r = filled[blk]
        for a, b in ((rk, ok), (rv, ov), (rk, dk), (rv, dv)):
            assert torch.equal(_bits(a[i, :, :r]), _bits(b[i, :, :r]))
    # and the values are the inputs
    keys = torch.cat([dk[0].transpose(0, 1), dk[1].transpose(0, 1), dk[2, :, :5].transpose(0, 1)])
    assert torch.equal(_bits(keys), _bits(torch.cat([k[:35], k[36:37], k[38:39]])))


def test_kernels_refuse_what_they_cannot_do() -> None:
    lay = layout(64)
    dec = window_tables(torch.full((2, 1, 64), 126, dtype=torch.uint8))
    with pytest.raises(ValueError, match="power of two"):
        PageWriter(lay, dec, tokens_per_program=3)
    with pytest.raises(ValueError, match="windows"):  # a version-1 (top-7) table
        PageWriter(lay, dec.flip(-1))
    with pytest.raises(ValueError, match="block size >= 4"):  # pages of whole 32-bit words
        PageWriter(layout(64, 2), dec)
    cache = torch.zeros(1, 1, lay.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bf16"):
        kv_prefill_attention(torch.zeros(1, 1, 64), cache, lay, pack_bases(dec), torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1, 0.125)


def _paged(lens, H, D, B, e, g, kv=None):  # noqa: ANN001, ANN202
    lay = layout(D, B, e, e)
    total = sum(lens)
    k, v = kv if kv is not None else make_kv(total, H, D, g)
    dec = tables_from(k, v)
    nb = sum((n + B - 1) // B for n in lens) + 3
    cache = torch.randint(0, 256, (nb, H, lay.page_bytes), dtype=torch.uint8, generator=g)
    ovf = DeviceOverflowStore(nb, H)
    perm = torch.randperm(nb, generator=g)
    width = max((n + B - 1) // B for n in lens) + 1
    bt = torch.randint(0, nb, (len(lens), width), dtype=torch.int32, generator=g)  # garbage past the fill
    slots, used = [], 0
    for i, n in enumerate(lens):
        m = (n + B - 1) // B
        bt[i, :m] = perm[used : used + m].to(torch.int32)
        used += m
        t = torch.arange(n)
        slots.append(bt[i, t // B].long() * B + t % B)
    PageWriter(lay, dec).write(cache, ovf, k, v, torch.cat(slots))
    return lay, dec, cache, ovf, bt, list(torch.split(k, lens)), list(torch.split(v, lens))


@pytest.mark.parametrize("D,G,splits,kw", [(64, 4, None, {}), (128, 2, 3, {"pages": 2, "num_warps": 4}),
                                           (256, 2, 2, {"pages": 1})])
def test_attention_matches_fp32_reference(D: int, G: int, splits: int | None, kw: dict) -> None:
    g = torch.Generator().manual_seed(7 + D)
    H, B = 2, 16
    lens = [1, 23, 130]
    lay, dec, cache, ovf, bt, ks, vs = _paged(lens, H, D, B, 1, g)
    q = torch.randn(len(lens), H * G, D, generator=g).to(torch.bfloat16)
    scale = D ** -0.5
    ref = reference_attention(q, ks, vs, scale)
    outs = []
    for num_splits in (splits, 1):
        out = torch.full_like(q, float("nan"))
        kv_decode_attention(q, cache, lay, pack_bases(dec), bt, torch.tensor(lens, dtype=torch.int32), max(lens),
                            scale, ovf, out=out, num_splits=num_splits, **kw)
        assert not out.isnan().any()
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < 1e-2, err
        outs.append(out)
    again = torch.full_like(q, float("nan"))
    kv_decode_attention(q, cache, lay, pack_bases(dec), bt, torch.tensor(lens, dtype=torch.int32), max(lens),
                        scale, ovf, out=again, num_splits=splits, **kw)
    assert torch.equal(_bits(again), _bits(outs[0])), "same inputs, same bits"


def _each_sequence_close(out: torch.Tensor, ref: torch.Tensor, start: torch.Tensor, tag: object = None) -> None:
    """Every sequence's rows within 1e-2 of fp32, so a slip in one cannot hide in the mean."""
    for s in range(start.numel() - 1):
        rows = slice(int(start[s]), int(start[s + 1]))
        err = float((out[rows].float() - ref[rows]).norm() / ref[rows].norm())
        assert err < 1e-2, (tag, s, err)


def _prefill_twice_against(ref: torch.Tensor, q: torch.Tensor, batch: tuple, **kw: object) -> torch.Tensor:
    """Prefill attention of the batch twice on NaN-poisoned outputs: every sequence's rows within 1e-2 of `ref`,
    the same bits both times. batch: (cache, layout, decode table, block table, lens, start, q_lens, scale,
    overflow)."""
    cache, lay, dec, bt, lens, start, q_lens, scale, ovf = batch
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        kv_prefill_attention(q, cache, lay, pack_bases(dec), bt, torch.tensor(lens, dtype=torch.int32), start,
                             max(q_lens), scale, ovf, out=out, **kw)
        assert not out.isnan().any()
        _each_sequence_close(out, ref, start)
        outs.append(out)
    assert torch.equal(_bits(outs[0]), _bits(outs[1])), "same inputs, same bits"
    return outs[0]


@pytest.mark.parametrize("D,G,block_q,pages", [(64, 4, None, 1), (128, 2, 3, 2), (256, 1, 2, 1), (64, 2, 4, 4)])
def test_mixed_batch_attention_matches_fp32_reference(D: int, G: int, block_q: int | None, pages: int) -> None:
    """A prefill run, a chunk after full pages, a chunk mid-page and a decode token in one varlen batch."""
    g = torch.Generator().manual_seed(11 + D)
    H, B = 2, 16
    lens = [40, 70, 37, 33]  # tokens in the pages, this step's included
    q_lens = [40, 22, 5, 1]
    lay, dec, cache, ovf, bt, ks, vs = _paged(lens, H, D, B, 1, g)
    q = torch.randn(sum(q_lens), H * G, D, generator=g).to(torch.bfloat16)
    start = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    scale = D ** -0.5
    ref = reference_prefill_attention(q, start, ks, vs, scale)
    out = _prefill_twice_against(ref, q, (cache, lay, dec, bt, lens, start, q_lens, scale, ovf),
                                 block_q=block_q, pages=pages)
    # the decode token's row equals the decode kernel's answer for the same sequence, within bf16 rounding
    one = torch.full_like(q[-1:], float("nan"))
    kv_decode_attention(q[-1:], cache, lay, pack_bases(dec), bt[3:], torch.tensor(lens[3:], dtype=torch.int32),
                        lens[3], scale, ovf, out=one, num_splits=1)
    torch.testing.assert_close(one.float(), out[-1:].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("D,G,block_q,block_f,pages", [(64, 4, None, 32, 1), (128, 2, 3, 16, 2)])
def test_prefill_reads_its_own_kv_from_the_step_and_the_prefix_from_pages(D: int, G: int, block_q: int | None,
                                                                         block_f: int, pages: int) -> None:
    """Given the step's K/V, the prefill kernel reads them for the step's own keys and decodes only the cached
    prefix: with step K/V that differ from what the pages hold, the answer is attention over the pages' prefix
    followed by the step's K/V (so neither source can stand in for the other unseen)."""
    g = torch.Generator().manual_seed(13 + D)
    H, B = 2, 16
    lens, q_lens = [40, 70, 37, 33], [40, 22, 5, 1]  # a prefill run, chunks after full pages and mid-page, a decode
    lay, dec, cache, ovf, bt, ks, vs = _paged(lens, H, D, B, 1, g)
    kf, vf = make_kv(sum(q_lens), H, D, g)  # not what the pages hold for these positions
    q = torch.randn(sum(q_lens), H * G, D, generator=g).to(torch.bfloat16)
    start = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    keys = [torch.cat([ks[s][: lens[s] - q_lens[s]], kf[start[s]:start[s + 1]]]) for s in range(len(lens))]
    values = [torch.cat([vs[s][: lens[s] - q_lens[s]], vf[start[s]:start[s + 1]]]) for s in range(len(lens))]
    scale = D ** -0.5
    ref = reference_prefill_attention(q, start, keys, values, scale)
    _prefill_twice_against(ref, q, (cache, lay, dec, bt, lens, start, q_lens, scale, ovf), block_q=block_q,
                           pages=pages, key=kf, value=vf, block_f=block_f)
    with pytest.raises(ValueError, match="key and value"):
        kv_prefill_attention(q, cache, lay, pack_bases(dec), bt, torch.tensor(lens, dtype=torch.int32), start,
                             max(q_lens), scale, ovf, key=kf[1:], value=vf[1:])
    with pytest.raises(ValueError, match="bf16"):
        kv_prefill_attention(q, cache, lay, pack_bases(dec), bt, torch.tensor(lens, dtype=torch.int32), start,
                             max(q_lens), scale, ovf, key=kf.float(), value=vf.float())
    with pytest.raises(ValueError, match="key and value"):  # one without the other
        kv_prefill_attention(q, cache, lay, pack_bases(dec), bt, torch.tensor(lens, dtype=torch.int32), start,
                             max(q_lens), scale, ovf, value=vf)


@pytest.mark.skipif(not SAMPLES.exists(), reason="recorded demo-model K/V not present")
def test_attention_on_recorded_kv() -> None:
    from safetensors.torch import load_file

    rec = load_file(str(SAMPLES))
    k, v = rec["k15"][:96], rec["v15"][:96]  # [T, 3, 64]
    g = torch.Generator().manual_seed(3)
    lens = [40, 56]
    lay, dec, cache, ovf, bt, ks, vs = _paged(lens, 3, 64, 16, 2, g, kv=(k, v))
    q = (torch.randn(2, 9, 64, generator=g)).to(torch.bfloat16)
    ref = reference_attention(q, ks, vs, 0.125)
    out = torch.full_like(q, float("nan"))
    kv_decode_attention(q, cache, lay, pack_bases(dec), bt, torch.tensor(lens, dtype=torch.int32), 56, 0.125, ovf,
                        out=out, num_splits=2)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 1e-2, err


def test_layer_splits_leading_decodes_from_prefills() -> None:
    """Several decode tokens first, then a prefill run and a chunk: the layer sends the decodes to the decode kernel
    and the rest (query offsets rebased) to the prefill kernel; each row matches fp32 as the unsplit batch does."""
    from kernels.kv_layer import TritonKVLayer

    g = torch.Generator().manual_seed(23)
    H, G, D, B = 2, 2, 64, 16
    lens, q_lens = [33, 20, 47, 40, 70], [1, 1, 1, 40, 22]
    lay, dec, cache, ovf, bt, ks, vs = _paged(lens, H, D, B, 1, g)
    layer = TritonKVLayer(lay, dec, cache)
    layer.overflow = ovf  # the pages' own store
    q = torch.randn(sum(q_lens), H * G, D, generator=g).to(torch.bfloat16)
    start = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = reference_prefill_attention(q, start, ks, vs, D ** -0.5)
    for num_decodes in (3, None):
        out = torch.full_like(q, float("nan"))
        layer.attend(q, out, bt, seq_lens, start, max(q_lens), max(lens), D ** -0.5, num_decodes)
        assert not out.isnan().any()
        _each_sequence_close(out, ref, start, num_decodes)
