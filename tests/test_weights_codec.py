"""The weight tensor code: bit-for-bit round trips, corruption detection, the prefix code itself."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glyd_engine.errors import CorruptFileError, UnsupportedModelError
from glyd_engine.format import huffman, weights
from tests.test_bf16_planes import all_patterns


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def test_all_patterns_round_trip():
    x = all_patterns()
    assert same_bits(weights.decode(weights.encode(x)), x)


@pytest.mark.parametrize("chunk", [1, 7, 512])
def test_chunk_sizes_and_partial_last_chunk(chunk):
    x = (torch.randn(3, 333) * 0.05).to(torch.bfloat16)
    assert same_bits(weights.decode(weights.encode(x, chunk=chunk)), x)


@st.composite
def bf16_tensors(draw):
    """Shapes from hypothesis; values from a drawn seed (lists this long are past hypothesis's sizes)."""
    shape = draw(st.lists(st.integers(1, 24), min_size=1, max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["random", "gauss", "constant", "rare", "specials"]))
    if kind == "random":
        return torch.randint(-32768, 32768, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
    if kind == "gauss":
        scale = draw(st.floats(1e-30, 1e30))
        return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
    if kind == "constant":
        v = draw(st.integers(-32768, 32767))
        return torch.full(shape, v, dtype=torch.int16).view(torch.bfloat16)
    if kind == "rare":  # one repeated rare exponent, any sign and mantissa
        e = draw(st.sampled_from([0, 1, 254, 255]))
        sm = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
        bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
        return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)
    # +-0, +-inf, NaNs with several payloads, the smallest subnormals
    specials = torch.tensor([0x0000, -0x8000, 0x7F80, -0x0080, 0x7FC0, 0x7F81, -0x0001, 0x0001, -0x7FFF],
                            dtype=torch.int16)
    return specials[torch.randint(0, len(specials), shape, generator=g)].view(torch.bfloat16)


@settings(max_examples=150, deadline=None)
@given(bf16_tensors(), st.sampled_from([1, 3, 64, 512]))
def test_hypothesis_round_trip(x, chunk):
    p = weights.encode(x, chunk=chunk)
    assert same_bits(weights.decode(p), x)
    # And through the stored parts, as a file would hand them back.
    q = weights.PackedTensor.from_parts("t", p.parts("t"))
    assert same_bits(weights.decode(q), x)


def test_empty_tensor_is_refused():
    with pytest.raises(UnsupportedModelError, match="empty"):
        weights.encode(torch.zeros(0, 4, dtype=torch.bfloat16), "w")


def test_fp32_is_refused():
    with pytest.raises(UnsupportedModelError, match="bf16"):
        weights.encode(torch.zeros(4, 4), "w")


def test_flipped_byte_is_caught():
    x = (torch.randn(64, 64) * 0.02).to(torch.bfloat16)
    p = weights.encode(x)
    for part in ("sm", "exp"):
        q = weights.encode(x)
        t = q.sm if part == "sm" else q.words
        t.view(torch.uint8)[5] ^= 0x10
        with pytest.raises(CorruptFileError, match="checksum"):
            weights.decode(q, "w")
    parts = p.parts("w")
    parts["w_glyd_meta"] = parts["w_glyd_meta"].clone()
    parts["w_glyd_meta"][0] = 99
    with pytest.raises(CorruptFileError, match="version"):
        weights.PackedTensor.from_parts("w", parts)
    parts = p.parts("w")
    del parts["w_glyd_off"]
    with pytest.raises(CorruptFileError, match="missing"):
        weights.PackedTensor.from_parts("w", parts)


def test_code_lengths_respect_the_limit_and_kraft():
    counts = torch.zeros(256, dtype=torch.int64)
    counts[:60] = torch.tensor([2 ** min(i, 50) for i in range(60)])
    lengths = huffman.code_lengths(counts)
    assert int(lengths.max()) <= huffman.MAX_CODE_LEN
    huffman.check_lengths(lengths)
    assert int((lengths > 0).sum()) == 60


def test_gaussian_weights_are_near_the_floor():
    from glyd_engine.format import bf16

    x = (torch.randn(512, 1024) * 0.02).to(torch.bfloat16)
    p = weights.encode(x)
    exp, _ = bf16.split(x)
    floor = 8 + bf16.entropy_bits(bf16.exponent_histogram(exp))
    assert p.bits_per_value < floor + 0.15
