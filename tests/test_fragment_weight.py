"""The fragment-order weight code (format/fragment_weight.py), the layout the CUDA matmul reads, on the CPU.

Every bf16 pattern comes back bit for bit through the kernel's word arithmetic; shapes and values from
hypothesis; the bytes sit where the kernel's lanes load them; the matmul's model (escapes decoded as code 0,
then corrected) matches a float64 product; shapes the layout cannot hold are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glyd_engine.format import fragment_weight as fw
from glyd_engine.format import resident
from tests.test_bf16_planes import all_patterns


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16)


def model_like(n: int, k: int, seed: int, outliers: float = 0.002, zeros: float = 0.0005) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    u = torch.rand(n, k, generator=g)
    w = torch.where(u < outliers, w * 100, w)
    w = torch.where((u >= outliers) & (u < outliers + zeros), torch.zeros_like(w), w)
    return w.to(torch.bfloat16)


def test_every_pattern_round_trips():
    x = all_patterns().reshape(16, 4096)  # ±0, subnormals, ±inf, every NaN payload
    f = fw.from_bits(x)
    assert f.esc.numel() > 0 and f.lo % 2 == 0
    assert torch.equal(_bits(fw.decode(f)), _bits(x))
    # rows in another order: every pattern in another lane, plane and chunk
    y = x.reshape(-1)[torch.randperm(65536, generator=torch.Generator().manual_seed(1))].reshape(64, 1024)
    assert torch.equal(_bits(fw.decode(fw.from_bits(y))), _bits(y))


@settings(max_examples=40, deadline=None)
@given(tiles=st.integers(1, 4), chunks=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-30, 1e-3, 0.02, 1.0, 3e4]), spread=st.floats(0.0, 20.0))
def test_hypothesis_round_trip(tiles: int, chunks: int, seed: int, scale: float, spread: float):
    n, k = 16 * tiles, 64 * chunks
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * scale * torch.exp2(torch.rand(n, k, generator=g) * spread)).to(torch.bfloat16)
    w.view(-1)[torch.randint(0, n * k, (3,), generator=g)] = torch.tensor([0.0, float("inf"), float("nan")],
                                                                          dtype=torch.bfloat16)
    f = fw.from_bits(w)
    assert torch.equal(_bits(fw.decode(f)), _bits(w))
    assert f.rowptr.shape == (n + 1,) and int(f.rowptr[-1]) == f.esc.numel()


def test_the_window_is_even_based_and_escapes_are_the_values_outside_it():
    w = model_like(64, 512, seed=3)
    f = fw.from_bits(w)
    e = (_bits(w).to(torch.int32) >> 7) & 0xFF
    outside = (e < f.lo + 1) | (e > f.lo + 15)
    assert f.lo % 2 == 0 and f.esc.numel() == int(outside.sum())
    assert 0.001 < f.esc.numel() / w.numel() < 0.006  # the zeros, tiny values and outliers
    entry = f.esc.to(torch.int64) & 0xFFFFFFFF
    rows = torch.repeat_interleave(torch.arange(64), (f.rowptr[1:] - f.rowptr[:-1]).to(torch.int64))
    assert torch.equal(outside.nonzero(), torch.stack([rows, entry >> 16], 1))  # row-major, columns ascending
    assert 12.0 <= f.bits_per_value < 12.3


def test_a_lanes_bytes_are_its_fragment_values():
    """Lane 4g + t of (tile, chunk) reads rows g and g+8, columns 16t..16t+15: low bytes as stored, high bytes
    (sign and the code's upper bits) in the H plane."""
    w = model_like(32, 128, seed=5)
    f = fw.from_bits(w)
    u = _bits(w).to(torch.int32) & 0xFFFF
    c = ((u >> 7) & 0xFF) - f.lo
    c = torch.where((c >= 1) & (c <= 15), c, torch.zeros_like(c))
    blocks = f.data.view(2, 2, 3, 32, 16)
    for tile, chunk, g, t in ((0, 0, 0, 0), (1, 1, 7, 3), (0, 1, 5, 2)):
        lane = 4 * g + t
        cols = slice(64 * chunk + 16 * t, 64 * chunk + 16 * t + 16)
        for h in (0, 1):
            row = 16 * tile + g + 8 * h
            low = (((c[row, cols] & 1) << 7) | (u[row, cols] & 0x7F)).to(torch.uint8)
            assert torch.equal(blocks[tile, chunk, h, lane], low)
        hbytes = blocks[tile, chunk, 2, lane].to(torch.int32)
        row = 16 * tile + g
        assert torch.equal(hbytes & 0x87, ((u[row, cols] >> 8) & 0x80) | (c[row, cols] >> 1))


def test_matmul_model_matches_float64():
    w = model_like(48, 256, seed=7, outliers=0.01, zeros=0.01)
    w[3, 5] = float("inf")
    f = fw.from_bits(w)
    x = (torch.randn(5, 256, generator=torch.Generator().manual_seed(8)) * 0.5).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    got = fw.matmul_reference(x, f).double()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got)) and not bool(finite[:, 3].any())  # inf touches only its row
    assert float(((got - ref)[finite].abs() / (ref[finite].abs() + 1)).max()) < 1e-5


def test_decode_rows_is_the_rows_of_decode():
    w = model_like(80, 128, seed=12, outliers=0.02, zeros=0.02)
    f = fw.from_bits(w)
    ids = torch.tensor([[79, 0, 17], [17, 33, 64]])
    assert torch.equal(_bits(fw.decode_rows(f, ids)), _bits(w)[ids.reshape(-1)])
    assert fw.decode_rows(f, ids[:0]).shape == (0, 128)


def test_from_resident_equals_from_bf16(monkeypatch: pytest.MonkeyPatch):
    w = model_like(80, 192, seed=9, outliers=0.01, zeros=0.01)
    b = fw.from_bits(w)
    for pass_values in (fw.PASS_VALUES, 32 * 192):  # one pass, and blocks of 32 rows (the last one 16)
        monkeypatch.setattr(fw, "PASS_VALUES", pass_values)
        a = fw.from_resident(resident.from_bf16(w))
        assert a.lo == b.lo and torch.equal(a.data, b.data) and torch.equal(a.esc, b.esc)
        assert torch.equal(a.rowptr, b.rowptr) and torch.equal(a.colptr, b.colptr)


@pytest.mark.parametrize(("n", "k"), [(32, 64), (48, 1088), (16, 2048)])
def test_column_index_counts_each_rows_escapes_below_each_group_boundary(n: int, k: int):
    """colptr[q][n]: row n's escapes in columns below 512 (q + 1), stored as uint16 (a row with over 2^15 escapes
    included); the split matmul starts each row's walk there."""
    w = model_like(n, k, seed=n + k, outliers=0.03, zeros=0.02)
    w[5, :] = 0.0  # every value of a row escapes
    f = fw.from_bits(w)
    assert f.colptr.dtype == torch.int16 and f.colptr.shape == (-(-k // fw.GROUP_COLS) - 1, n)
    entry = f.esc.to(torch.int64) & 0xFFFFFFFF
    got = f.colptr.to(torch.int64) & 0xFFFF
    for row in range(n):
        cols = entry[int(f.rowptr[row]): int(f.rowptr[row + 1])] >> 16
        want = torch.tensor([int((cols < fw.GROUP_COLS * (q + 1)).sum()) for q in range(got.shape[0])],
                            dtype=torch.int64)
        assert torch.equal(got[:, row], want), row
    wide = torch.zeros(16, 65472, dtype=torch.bfloat16)  # 65,472 escapes in one row: past int16, within uint16
    far = fw.from_bits(wide)
    assert int(far.colptr[-1, 0]) & 0xFFFF == 65024
    assert f.nbytes == f.data.numel() + 4 * (f.rowptr.numel() + f.esc.numel()) + 2 * f.colptr.numel()


@pytest.mark.parametrize(("shape", "reason"), [((15, 64), "multiple of 16"), ((16, 96), "columns of 64"),
                                               ((16, 1 << 16), "16-bit column"), ((4, 4, 64), "2-D")])
def test_unsupported_shapes_say_why(shape: tuple[int, ...], reason: str):
    assert reason in fw.unsupported(shape)
    if len(shape) == 2 and shape[1] < 1 << 16:
        with pytest.raises(ValueError, match=reason):
            fw.from_bits(torch.zeros(shape, dtype=torch.bfloat16))
