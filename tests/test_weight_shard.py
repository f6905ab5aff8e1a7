"""A tensor-parallel shard of a packed weight: decoded from its own chunks only, bit for bit the slice of the whole,
and the shards' crc32 shares combine into the whole tensor's checksum."""

from __future__ import annotations

import pytest
import torch

from glyd_engine.format import bf16, huffman, weights
from glyd_engine.format import weight_shard as ws


def _tensor(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    t.view(torch.int16)[3, 5] = 0x7F80  # an infinity and a rare exponent: escapes of the code
    t.view(torch.int16)[rows - 1, cols - 2] = 0x0001
    return t


def _bits(exp: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    return bf16.join(exp, sm).view(torch.int16)


# (shape, the ranks' windows): column-parallel (row blocks, unaligned and aligned to the 512-value chunks),
# row-parallel (column windows: 96 of 192, unaligned; 1024 of 2048, aligned), fused q/k/v blocks with replicas.
CASES = {
    "rows": ((96, 192), [(((0, 48),), (0, 192)), (((48, 48),), (0, 192))]),
    "cols": ((40, 192), [(((0, 40),), (0, 96)), (((0, 40),), (96, 96))]),
    "cols_aligned": ((6, 2048), [(((0, 6),), (0, 1024)), (((0, 6),), (1024, 1024))]),
    "qkv_replicated": ((64, 64), [(((0, 16), (32, 16), (48, 16)), (0, 64)), (((16, 16), (32, 16), (48, 16)), (0, 64))]),
}


@pytest.mark.parametrize("case", CASES)
def test_shards_are_the_slices_and_their_crcs_combine(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shape, ranks = CASES[case]
    t = _tensor(*shape)
    p = weights.encode(t)
    decoded: list[int] = []
    real = huffman.decode_chunks
    monkeypatch.setattr(huffman, "decode_chunks", lambda *a, **k: decoded.append(a[3].numel()) or real(*a, **k))
    shares = []
    for rows, cols in ranks:
        w = ws.Window(rows, cols, shape)
        exp, sm = ws.decode_window(p, w)
        want = torch.cat([t[r0 : r0 + rc, cols[0] : cols[0] + cols[1]].reshape(-1) for r0, rc in rows])
        assert torch.equal(_bits(exp, sm), want.view(torch.int16))
        shares += ws.shares(exp, sm, w)
    assert ws.combine(shares, shape) == p.crc32  # replicated blocks (k, v of "qkv_replicated") count once
    assert ws.combine(shares[:1], shape) is None  # one block alone does not cover the tensor
    if case == "cols_aligned":  # the chunks of each rank's columns and no others
        assert decoded == [6 * 1024 // 512] * 2


def test_a_damaged_shard_changes_the_combined_crc() -> None:
    t = _tensor(96, 192)
    p = weights.encode(t)
    p.sm[100] ^= 1  # in rank 0's rows
    shares = []
    for rows in (((0, 48),), ((48, 48),)):
        w = ws.Window(rows, (0, 192), (96, 192))
        exp, sm = ws.decode_window(p, w)
        shares += ws.shares(exp, sm, w)
    assert ws.combine(shares, (96, 192)) != p.crc32
