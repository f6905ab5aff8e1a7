"""bf16 as two byte planes: the exponent (entropy-coded) and sign+mantissa (stored as is).

bf16 bits: s eeeeeeee mmmmmmm. The sign/mantissa byte is `s << 7 | m`, so both planes are uint8 and the
split is a bijection on all 65,536 patterns (NaN payloads, -0.0, subnormals and inf included).
"""

from __future__ import annotations

import torch

from glyd_engine.errors import UnsupportedModelError


def require_bf16(t: torch.Tensor, name: str = "tensor") -> None:
    if t.dtype != torch.bfloat16:
        raise UnsupportedModelError(
            f"{name} is {str(t.dtype).removeprefix('torch.')}, not bfloat16: Glyd stores bf16 bit for bit and "
            "cannot make fp32/fp16 bf16 without rounding. Use a bf16 checkpoint."
        )


def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 tensor -> (exponent uint8, sign_mantissa uint8), same shape."""
    require_bf16(t)
    bits = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    exp = ((bits >> 7) & 0xFF).to(torch.uint8)
    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    return exp, sm


def join(exp: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """Inverse of `split`."""
    e = exp.to(torch.int32)
    s = sm.to(torch.int32)
    bits = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    # int32 values above 0x7FFF wrap into int16's negative half: that is the bit pattern we want.
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return bits.to(torch.int16).view(torch.bfloat16)


def exponent_histogram(exp: torch.Tensor) -> torch.Tensor:
    """Counts of each of the 256 exponents, int64."""
    return torch.bincount(exp.reshape(-1).to(torch.int64), minlength=256)


def entropy_bits(counts: torch.Tensor) -> float:
    """Order-0 entropy in bits per symbol of a histogram (0 for an empty one)."""
    c = counts.to(torch.float64)
    total = c.sum()
    if total <= 0:
        return 0.0
    p = c[c > 0] / total
    return float(-(p * torch.log2(p)).sum())
