"""A tensor-parallel rank's shard of a packed weight: some row blocks and a window of columns of the whole tensor,
decoded from the chunks that hold them only, and the shard's share of the whole tensor's crc32.

A packed tensor is one row-major stream cut into chunks of `chunk` values, each decodable alone (weights.py), and
its sign/mantissa plane is plain bytes. So a shard slices the byte plane and decodes only the chunks its values
fall in: a column-parallel shard (whole rows) is one run of chunks, a row-parallel one (a column window) a run a
row; where the shard's edges are chunk boundaries (a column window of a multiple of 512 values, as in every large
model's split), it is exactly a slice of the chunks. No rank decodes the whole tensor.

Integrity: the file's crc32 covers the whole tensor, which no rank holds. CRC-32 is affine over GF(2), so with every
byte outside a shard zeroed, the crcs of disjoint shards that cover the tensor combine into the whole one's
(`combine`): each rank computes its shard's (`masked_crc32`), and the ranks compare the combination.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from glyd_engine.format import bf16, huffman
from glyd_engine.format.weights import PackedTensor

BATCH_VALUES = 1 << 22  # values a step of a row-window decode gathers (bounded memory)
_ZEROS = bytes(1 << 20)


@dataclass(frozen=True)
class Window:
    """Row blocks (start, count), ascending and disjoint, and one column window (start, count) of a 2-D tensor."""

    rows: tuple[tuple[int, int], ...]
    cols: tuple[int, int]
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        return sum(c for _, c in self.rows) * self.cols[1]

    @property
    def is_whole(self) -> bool:
        return self.numel == self.shape[0] * self.shape[1]


def whole(shape: tuple[int, int]) -> Window:
    return Window(((0, shape[0]),), (0, shape[1]), shape)


def decode_window(p: PackedTensor, w: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard's exponent and sign/mantissa planes, uint8, row-major over the window (not checked: see
    `masked_crc32`)."""
    if tuple(p.shape) != tuple(w.shape):
        raise ValueError(f"a window of {w.shape} on a packed tensor of shape {tuple(p.shape)}")
    n_rows, n_cols = w.shape
    c0, cc = w.cols
    sm = p.sm.view(n_rows, n_cols)
    exps, sms = [], []
    for r0, rc in w.rows:
        sms.append(sm[r0 : r0 + rc, c0 : c0 + cc].reshape(-1))
        exps.append(_run(p, r0 * n_cols, rc * n_cols) if cc == n_cols else _row_windows(p, r0, rc, c0, cc))
    return torch.cat(exps), torch.cat(sms)


def _run(p: PackedTensor, start: int, count: int) -> torch.Tensor:
    """Exponents of values [start, start + count): the chunks that hold them, decoded."""
    first, last = start // p.chunk, (start + count - 1) // p.chunk
    buf = huffman.decode_chunks(p.words, p.offsets, p.lengths, torch.arange(first, last + 1), p.chunk)
    return buf[start - first * p.chunk : start - first * p.chunk + count]


def _row_windows(p: PackedTensor, r0: int, rc: int, c0: int, cc: int) -> torch.Tensor:
    """Exponents of columns [c0, c0 + cc) of rows [r0, r0 + rc): each row's run of chunks, decoded."""
    n_cols, chunk = p.shape[1], p.chunk
    n_chunks = p.offsets.numel() - 1
    step = max(1, BATCH_VALUES // max(1, cc))
    out = []
    for a in range(r0, r0 + rc, step):
        rows = torch.arange(a, min(r0 + rc, a + step), dtype=torch.int64)
        starts = rows * n_cols + c0
        first = starts // chunk
        off = starts - first * chunk
        k = (int(off.max()) + cc + chunk - 1) // chunk  # chunks a row spans (aligned windows: exactly cc / chunk)
        ids = (first.view(-1, 1) + torch.arange(k)).clamp(max=n_chunks - 1)
        buf = huffman.decode_chunks(p.words, p.offsets, p.lengths, ids.reshape(-1), chunk).view(rows.numel(), -1)
        out.append(buf.gather(1, off.view(-1, 1) + torch.arange(cc)).reshape(-1))
    return torch.cat(out)


def _zeros(crc: int, nbytes: int) -> int:
    while nbytes > 0:
        n = min(nbytes, len(_ZEROS))
        crc = zlib.crc32(memoryview(_ZEROS)[:n], crc)
        nbytes -= n
    return crc


def masked_crc32(exp: torch.Tensor, sm: torch.Tensor, w: Window) -> int:
    """crc32 of the whole tensor's bf16 bytes with every value outside the window zero (the shard's share)."""
    data = bf16.join(exp, sm).contiguous().view(torch.int16).numpy().view("uint8")
    n_rows, n_cols = w.shape
    c0, cc = w.cols
    crc, pos, at = 0, 0, 0  # pos: the tensor's value the stream has reached; at: the shard's
    for r0, rc in w.rows:
        if cc == n_cols:
            crc = _zeros(crc, 2 * (r0 * n_cols - pos))
            crc = zlib.crc32(data[2 * at : 2 * (at + rc * n_cols)], crc)
            at, pos = at + rc * n_cols, (r0 + rc) * n_cols
            continue
        for r in range(r0, r0 + rc):
            crc = _zeros(crc, 2 * (r * n_cols + c0 - pos))
            crc = zlib.crc32(data[2 * at : 2 * (at + cc)], crc)
            at, pos = at + cc, r * n_cols + c0 + cc
    return _zeros(crc, 2 * (n_rows * n_cols - pos))


Share = tuple[tuple[int, int, int, int], int]  # (row start, rows, column start, columns), masked crc32


def shares(exp: torch.Tensor, sm: torch.Tensor, w: Window) -> list[Share]:
    """The shard's crc32 shares, one a row block (ranks that replicate a block, as vLLM does with KV heads when
    there are fewer than ranks, hold equal blocks, which `combine` counts once)."""
    out, at = [], 0
    c0, cc = w.cols
    for r0, rc in w.rows:
        n = rc * cc
        block = Window(((r0, rc),), w.cols, w.shape)
        out.append(((r0, rc, c0, cc), masked_crc32(exp[at : at + n], sm[at : at + n], block)))
        at += n
    return out


def combine(all_shares: list[Share], shape: tuple[int, int]) -> int | None:
    """The whole tensor's crc32 from the ranks' shares; an equal block counts once. None when the distinct blocks do
    not tile the tensor (overlap, or leave values out): then the checksum cannot be told from them."""
    distinct = dict(all_shares)  # an equal block has an equal crc where its bytes agree; a damaged copy is caught below
    if len(distinct) != len(set(all_shares)):
        return -1  # two ranks read different bytes for one block: -1 is no crc32, so it matches none
    n = shape[0] * shape[1]
    blocks = list(distinct)
    if sum(rc * cc for _, rc, _, cc in blocks) != n or any(
            a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]
            for i, a in enumerate(blocks) for b in blocks[i + 1:]):
        return None
    out = 0
    for crc in distinct.values():
        out ^= crc
    if len(distinct) % 2 == 0:  # crc(a ^ b) = crc(a) ^ crc(b) ^ crc(0): one crc(0) a pair
        out ^= _zeros(0, 2 * n)
    return out
