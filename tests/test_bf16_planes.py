"""The plane split is a bijection on every bf16 bit pattern."""

import pytest
import torch

from glyd_engine.errors import UnsupportedModelError
from glyd_engine.format import bf16


def all_patterns() -> torch.Tensor:
    bits = torch.arange(65536, dtype=torch.int32)
    return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)


def test_every_pattern_splits_and_joins_back():
    x = all_patterns()
    exp, sm = bf16.split(x)
    assert exp.dtype == sm.dtype == torch.uint8
    assert torch.equal(bf16.join(exp, sm).view(torch.int16), x.view(torch.int16))
    # The planes are what the format says: exponent bits 14..7, sign at bit 7 of sm.
    raw = x.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(exp.to(torch.int32), (raw >> 7) & 0xFF)
    assert torch.equal(sm.to(torch.int32) >> 7, raw >> 15)


def test_other_dtypes_are_refused_with_a_reason():
    with pytest.raises(UnsupportedModelError, match="bfloat16"):
        bf16.split(torch.zeros(4, dtype=torch.float16))


def test_entropy_of_uniform_and_constant():
    assert bf16.entropy_bits(torch.ones(256)) == pytest.approx(8.0)
    c = torch.zeros(256)
    c[3] = 10
    assert bf16.entropy_bits(c) == 0.0
