"""The Glyd matmul kernels (kernels/resident_linear.py) against torch: compiled on a GPU, under TRITON_INTERPRET=1
without one (CI).

Decoded weights equal the resident code's torch decode bit for bit (all 65,536 patterns); the fused
matmul is within bf16 tolerance of an fp32 reference, output poisoned first, escapes (outliers, zeros,
an infinity) in any row, several widths and batch sizes; an infinite weight touches only its column.
"""

from __future__ import annotations

import os

import pytest
import torch

# tests/conftest.py decides the interpreter (on where there is no GPU); the tensors follow it, as the interpreter runs
# on host memory and compiled kernels on the GPU's
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

from glyd_engine.format import resident  # noqa: E402
from glyd_kernels import resident_linear as rl  # noqa: E402
from tests.test_bf16_planes import all_patterns  # noqa: E402


def _weight(n: int, k: int, seed: int, p_outlier: float = 0.01) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    out = torch.rand(n, k, generator=g) < p_outlier
    w = torch.where(out, torch.randn(n, k, generator=g) * 30.0, w)
    w[torch.rand(n, k, generator=g) < p_outlier] = 0.0
    return w.to(torch.bfloat16).to(DEV)


def test_decode_kernel_is_bit_exact_on_every_pattern():
    x = all_patterns().reshape(256, 256).to(DEV)
    got = rl.resident_decode(resident.from_bf16(x))
    assert torch.equal(got.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize(("m", "n", "k", "block_n", "block_kh", "p_outlier"), [
    (1, 48, 96, 16, 32, 0.01), (5, 70, 64, 32, 16, 0.01), (17, 33, 130, 16, 64, 0.01), (64, 16, 32, 16, 16, 0.01),
    (3, 20, 96, 16, 32, 0.2), (1, 20, 96, 16, 32, 0.2)])  # ~40 escapes a row: several correction chunks
def test_fused_matmul_matches_fp32_reference(m, n, k, block_n, block_kh, p_outlier):
    w = _weight(n, k, seed=m * 1000 + n, p_outlier=p_outlier)
    r = resident.from_bf16(w)
    assert r.esc_pos.numel() > 0
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 0.5).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n).to(torch.bfloat16).to(DEV)
    ref = x.float() @ w.float().T + bias.float()
    got = rl.resident_linear(x, r, rl.escape_plan(r), bias, block_n=block_n, block_kh=block_kh, gemv=False)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    again = rl.resident_linear(x, r, rl.escape_plan(r), bias, block_n=block_n, block_kh=block_kh, gemv=False)
    assert torch.equal(got.view(torch.int16), again.view(torch.int16))  # same inputs, same bits
    one = rl.resident_linear(x, r, rl.escape_plan(r), bias, block_n=block_n, block_kh=block_kh, gemv=False, splits=1)
    torch.testing.assert_close(one.float(), ref, rtol=2e-2, atol=2e-2)  # one K split: y written by the split
    if m == 1:  # the CUDA-core kernel for one row, escapes corrected in the split-sum launch or the first split
        for fold, splits, prefetch in ((False, 1, True), (False, 2, False), (True, 1, False), (True, 2, True)):
            gemv = rl.resident_linear(x, r, rl.escape_plan(r), bias, block_n=block_n, block_kh=block_kh,
                                      gemv=True, fold=fold, splits=splits, prefetch=prefetch)
            torch.testing.assert_close(gemv.float(), ref, rtol=2e-2, atol=2e-2)


def test_output_is_written_everywhere_and_an_infinity_stays_in_its_column(monkeypatch):
    n, k, m = 32, 64, 3
    w = _weight(n, k, seed=7, p_outlier=0.0)
    w[5, 9] = float("inf")
    r = resident.from_bf16(w)
    x = torch.ones(m, k, dtype=torch.bfloat16, device=DEV)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):  # NaN-filled outputs: any element the kernel skips shows up
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(rl.torch, "empty", poisoned)
    got = rl.resident_linear(x, r, rl.escape_plan(r), block_n=16, block_kh=16)
    assert torch.isinf(got[:, 5]).all()
    others = torch.cat([got[:, :5], got[:, 6:]], dim=1)
    assert torch.isfinite(others).all()
    ref = x.float() @ torch.where(torch.isinf(w), 0, w).float().T
    torch.testing.assert_close(others.float(), torch.cat([ref[:, :5], ref[:, 6:]], 1), rtol=2e-2, atol=2e-2)


def test_padding_lanes_stay_finite_when_the_window_tops_at_inf():
    """Huge weights (2**120) put the window's top at exponent 255 (inf/NaN): lanes past the end of the row must
    not decode to inf, or 0 * inf would poison the row."""
    w = torch.full((8, 20), 2.0**120, dtype=torch.bfloat16, device=DEV)
    r = resident.from_bf16(w)
    assert r.base == 255 and r.esc_pos.numel() == 0
    x = torch.full((1, 20), 2.0**-120, dtype=torch.bfloat16, device=DEV)
    # 10 pairs a row: the tensor-core tile of 16 pairs (tl.dot's least K) has 6 padding lanes; the CUDA-core
    # kernel's second tile of 8 is mostly padding
    for gemv, block_kh in ((False, 16), (True, 8)):
        y = rl.resident_linear(x, r, rl.escape_plan(r), block_n=16, block_kh=block_kh, gemv=gemv, fold=gemv)
        assert torch.equal(y, torch.full((1, 8), 20.0, dtype=torch.bfloat16, device=DEV)), y


def test_refuses_what_it_cannot_do():
    r = resident.from_bf16(_weight(8, 16, seed=1))
    with pytest.raises(ValueError, match="rows"):
        rl.resident_linear(torch.zeros(65, 16, dtype=torch.bfloat16, device=DEV), r, rl.escape_plan(r))
    with pytest.raises(ValueError, match="even width"):
        rl.resident_decode(resident.from_bf16(_weight(8, 15, seed=1)))
    with pytest.raises(ValueError, match="K >= 16"):  # a tile Triton's dot cannot compile on a GPU
        rl.resident_linear(torch.zeros(4, 16, dtype=torch.bfloat16, device=DEV), r, rl.escape_plan(r), block_kh=8)
