"""The CUDA Glyd matmul (kernels/matmul_cuda.py) against the torch reference (runs where a CUDA GPU is).

The decode kernel returns every bf16 pattern bit for bit; the fused matmuls are within bf16 tolerance of an fp32
product for 1-128 rows, with escapes (zeros, outliers, an infinity, a row of escapes only), bias, one or two
16-row tiles of W a block, K in shares of 3-15 warps or split between blocks; they give the same bits twice and
under CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from glyd_engine.format import fragment_weight as fw
from tests.test_bf16_planes import all_patterns
from tests.test_fragment_weight import model_like

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"


def _mm():
    from glyd_kernels import matmul_cuda

    return matmul_cuda


def test_decode_kernel_is_bit_exact_on_every_pattern():
    x = all_patterns().reshape(64, 1024)
    f = fw.from_bits(x).to(DEV)
    assert torch.equal(_mm().decode(f).view(torch.int16).cpu(), x.view(torch.int16))


@pytest.mark.parametrize(("n", "k"), [(16, 64), (192, 576), (960, 576), (4096, 4096), (4096, 12288)])
def test_decode_kernel_is_bit_exact_on_model_weights(n: int, k: int):
    w = model_like(n, k, seed=n + k).to(DEV)
    f = fw.from_bits(w)
    assert torch.equal(_mm().decode(f).view(torch.int16), w.view(torch.int16))


def test_row_gather_is_bit_exact_and_decodes_only_its_rows():
    """Embedding lookups: any rows, repeated and in any order, every pattern and escapes included; ids past the
    table give zero rows."""
    x = all_patterns().reshape(64, 1024)
    w = torch.cat([x, model_like(192, 1024, seed=3)]).to(DEV)
    f = fw.from_bits(w)
    ids = torch.tensor([[0, 63, 64, 255], [17, 17, 8, 200]], device=DEV)
    got = _mm().gather_rows(f, ids)
    assert got.shape == (8, 1024)
    assert torch.equal(got.view(torch.int16), w[ids.reshape(-1)].view(torch.int16))
    every = _mm().gather_rows(f, torch.arange(w.shape[0] - 1, -1, -1, device=DEV))
    assert torch.equal(every.view(torch.int16), w.flip(0).view(torch.int16))
    outside = _mm().gather_rows(f, torch.tensor([-1, 256], device=DEV))
    assert torch.equal(outside.view(torch.int16), torch.zeros(2, 1024, dtype=torch.int16, device=DEV))
    assert _mm().gather_rows(f, ids[:, :0]).shape == (0, 1024)


def _check(x: torch.Tensor, w: torch.Tensor, got: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)
    err = ((got.double() - ref).abs() / (ref.abs() + 1.0))[finite]
    assert float(err.max()) < 1.6e-2, float(err.max())


BUILDS_TO_16 = [(1, 3, 4, 2, 1), (2, 15, 2, 1, 1), (1, 7, 3, 1, 1), (1, 6, 2, 2, 2), (1, 5, 2, 2, 4)]
BUILDS_TO_64 = [(1, 4, 2, 1, 1), (1, 6, 1, 1, 4), (1, 9, 2, 1, 2)]  # (tiles, warps, stages, min blocks, escape warps)
WIDE_BUILDS = [(4, 2, 2, 3), (8, 3, 1, 2), (2, 4, 2, 5), (8, 4, 2, 1), (8, 3, 2, 2, 0), (4, 4, 2, 1, 0)]
# (warps, stages, min blocks, K splits, mbarrier pipeline)
WGMMA_BUILDS = [(1, 4, 3, 0, 0), (2, 3, 2, 0, 0), (1, 3, 1, 5, 0), (2, 4, 1, 2, 0), (1, 6, 1, 1, 0), (1, 3, 3, 0, 1),
                (2, 4, 1, 3, 1), (1, 3, 4, 1, 1)]
WGMMA_BUILDS_TO_32 = [(1, 3, 6, 0, 1), (1, 3, 6, 2, 1)]  # six blocks a multiprocessor: registers for 32 rows at most
# (warpgroups, stages, min blocks, K splits, x's stage images): Hopper only


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 12, 16, 17, 24, 32, 40, 64, 65, 100, 128])
@pytest.mark.parametrize(("n", "k"), [(48, 128), (64, 256), (960, 576), (6144, 4096), (272, 12288)])
def test_matmul_matches_float64(m: int, n: int, k: int):
    """Every build at every row count: 16-row tiles of W a block or a warp, K split between warps or blocks (the
    splits' sums added by the last block), tile groups with idle warps, rows of x past M left unread."""
    mm = _mm()
    w = model_like(n, k, seed=m * 7 + n, outliers=0.004, zeros=0.002).to(DEV)
    w[1, 3] = float("inf")
    w[n - 1, :] = 0.0  # a row of escapes only
    f = fw.from_bits(w)
    g = torch.Generator(device=DEV).manual_seed(m)
    x = (torch.randn(m, k, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    bias = (torch.randn(n, device=DEV, generator=g)).to(torch.bfloat16)
    builds = [mm.Config(*b) for b in (BUILDS_TO_16 if m <= 16 else BUILDS_TO_64 if m <= 64 else [])]
    builds += [mm.WideConfig(*b) for b in WIDE_BUILDS]
    builds += [mm.WgmmaConfig(*b) for b in WGMMA_BUILDS + (WGMMA_BUILDS_TO_32 if m <= 32 else []) if mm.has_wgmma(0)]
    for cfg in (None, *builds):
        got = mm.matmul(x, f, bias if cfg is None else None, cfg)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        _check(x, w, got, bias if cfg is None else None)
        assert torch.equal(got.view(torch.int16), mm.matmul(x, f, bias if cfg is None else None, cfg).view(torch.int16))


def test_matmul_reads_rows_of_a_wider_tensor_and_replays_in_a_cuda_graph():
    mm = _mm()
    n, k, m = 1024, 2048, 4
    w = model_like(n, k, seed=11).to(DEV)
    f = fw.from_bits(w)
    wide = (torch.randn(m, k + 64, device=DEV) * 0.5).to(torch.bfloat16)
    x = wide[:, 64:]  # a view with a row stride of k + 64
    first = mm.matmul(x, f)
    _check(x, w, first, None)
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        mm.matmul(static_x, f)  # compile and warm up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = mm.matmul(static_x, f)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("kind", ["wide", "wgmma", "wgmma_image"])
def test_split_sums_replay_in_a_cuda_graph_with_the_same_bits(kind: str):
    """The wide kernels' last split block adds the sums and resets its counter: replays of one graph, and eager calls
    between them, give the first call's bits; a replay after x changed gives the new x's product (x's stage images
    are laid out inside the graph)."""
    mm = _mm()
    if kind != "wide" and not mm.has_wgmma(0):
        pytest.skip("the warpgroup-MMA kernel runs on Hopper only")
    n, k, m = 512, 4096, 40
    w = model_like(n, k, seed=5, outliers=0.004, zeros=0.002).to(DEV)
    f = fw.from_bits(w)
    x = (torch.randn(m, k, device=DEV) * 0.5).to(torch.bfloat16)
    cfg = {"wide": mm.WideConfig(splits=4), "wgmma": mm.WgmmaConfig(splits=4, x_image=0),
           "wgmma_image": mm.WgmmaConfig(splits=4, x_image=1)}[kind]
    first = mm.matmul(x, f, None, cfg)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        mm.matmul(x, f, None, cfg)
        with torch.cuda.graph(graph, stream=stream):
            out = mm.matmul(x, f, None, cfg)
    for _ in range(3):
        graph.replay()
        again = mm.matmul(x, f, None, cfg)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), first.view(torch.int16))
        assert torch.equal(again.view(torch.int16), first.view(torch.int16))
    x.copy_((torch.randn(m, k, device=DEV) * 0.5).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    _check(x, w, out, None)
    assert torch.equal(out.view(torch.int16), mm.matmul(x, f, None, cfg).view(torch.int16))


def test_rows_above_the_kernels_are_refused_with_the_alternative():
    mm = _mm()
    f = fw.from_bits(model_like(16, 64, seed=1)).to(DEV)
    with pytest.raises(ValueError, match="decode once"):
        mm.matmul(torch.zeros(mm.MAX_ROWS + 1, 64, dtype=torch.bfloat16, device=DEV), f)
    with pytest.raises(ValueError, match="use a WideConfig"):
        mm.matmul(torch.zeros(mm.FUSED_ROWS + 1, 64, dtype=torch.bfloat16, device=DEV), f, None, mm.Config())
