"""The resident weight code (what `--quantization glyd` holds in memory): bit for bit, whole and by rows."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glyd_engine.errors import CorruptFileError
from glyd_engine.format import resident, weights
from tests.test_bf16_planes import all_patterns
from tests.test_weights_codec import bf16_tensors, same_bits


def test_all_patterns_round_trip_whole_and_by_rows():
    x = all_patterns().reshape(256, 256)
    r = resident.from_bf16(x)
    assert same_bits(resident.decode(r), x)
    rows = torch.tensor([0, 255, 7, 7, 128, 0])  # repeats, as token ids repeat in a batch
    assert same_bits(resident.decode_rows(r, rows), x[rows])


@settings(max_examples=150, deadline=None)
@given(bf16_tensors())
def test_hypothesis_round_trip(x):
    r = resident.from_bf16(x)
    assert same_bits(resident.decode(r), x)
    if x.dim() == 2:
        g = torch.Generator().manual_seed(x.numel())
        rows = torch.randint(0, x.shape[0], (5,), generator=g)
        assert same_bits(resident.decode_rows(r, rows), x[rows])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**31), st.floats(0.0, 0.2))
def test_escapes_in_any_row_and_column(n_rows, cols, seed, p_outlier):
    """Outliers (exponents far outside the window) land anywhere, odd widths included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, cols, generator=g) * 0.02
    out = torch.rand(n_rows, cols, generator=g) < p_outlier
    x = torch.where(out, torch.randn(n_rows, cols, generator=g) * 1e20, x).to(torch.bfloat16)
    x.view(-1)[0] = 0.0  # zeros (exponent 0) escape unless the window reaches down to them
    r = resident.from_bf16(x)
    exp = (x.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    assert r.esc_pos.numel() == int(((exp > r.base) | (exp < r.base - 14)).sum())
    assert same_bits(resident.decode(r), x)
    rows = torch.arange(n_rows).flip(0).repeat(2)
    assert same_bits(resident.decode_rows(r, rows), x[rows])


def test_window_is_where_the_values_are():
    hist = torch.zeros(256, dtype=torch.int64)
    hist[100:130] = 1
    hist[110:125] = 1000
    assert resident.choose_base(hist) == 124
    x = (torch.randn(512, 512) * 0.02).to(torch.bfloat16)
    r = resident.from_bf16(x)
    assert r.esc_pos.numel() < 0.001 * x.numel()
    assert 12.0 <= r.bits_per_value < 12.05


def test_from_packed_matches_and_checks_the_checksum():
    x = (torch.randn(64, 96) * 0.02).to(torch.bfloat16)
    p = weights.encode(x)
    exp, sm = resident.planes_from_packed(p, "w")
    assert same_bits(resident.decode(resident.from_planes(exp, sm, tuple(x.shape))), x)
    p.sm[3] ^= 0x01
    with pytest.raises(CorruptFileError, match="w: decoded data does not match its checksum"):
        resident.planes_from_packed(p, "w")
