"""The resident weight code: how a Glyd-packed weight is held in memory while a model serves.

The file's prefix code (format/weights.py) is the densest form but decodes serially, too slow to run
before every matmul. In memory a weight keeps its sign/mantissa byte and a 4-bit exponent *offset* below
a per-tensor base exponent: offset = base - exponent for the 15 exponents base-14..base, 15 = escape.
An escaped value (an exponent outside that window: zeros, tiny values, outliers) is kept whole in a
sorted patch list. Decoding is a few byte operations a value and no table, the same arithmetic in torch
(CPU) and inside a GPU kernel: 12 bits a weight plus 48 bits an escape (docs/format.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glyd_engine.errors import CorruptFileError
from glyd_engine.format import bf16, huffman, weights

WINDOW = 15  # exponents base-14..base have offsets 0..14
ESCAPE = 15


@dataclass
class ResidentWeight:
    shape: tuple[int, ...]
    sm: torch.Tensor  # uint8[n]: sign << 7 | mantissa
    offs: torch.Tensor  # uint8[ceil(n/2)]: value 2i in the low nibble, 2i+1 in the high one
    base: int  # the window's top exponent
    esc_pos: torch.Tensor  # int32[e] (int64 past 2**31 values): flat positions of escaped values, ascending
    esc_bits: torch.Tensor  # int16[e]: their bf16 bit patterns

    @property
    def numel(self) -> int:
        return self.sm.numel()

    @property
    def nbytes(self) -> int:
        """Bytes held in memory for this weight."""
        return self.sm.numel() + self.offs.numel() + (self.esc_pos.element_size() + 2) * self.esc_pos.numel()

    @property
    def bits_per_value(self) -> float:
        return 8 * self.nbytes / max(1, self.numel)

    def to(self, device: torch.device | str) -> ResidentWeight:
        return ResidentWeight(self.shape, self.sm.to(device), self.offs.to(device), self.base,
                              self.esc_pos.to(device), self.esc_bits.to(device))


def choose_base(exp_hist: torch.Tensor) -> int:
    """The top exponent of the 15-wide window holding the most values (ties: the higher window)."""
    h = exp_hist.to(torch.int64).cpu()
    padded = torch.cat([torch.zeros(WINDOW - 1, dtype=torch.int64), h])
    window_sums = padded.unfold(0, WINDOW, 1).sum(1)  # [256]: sum of h[b-14..b]
    best = int(window_sums.max())
    return int((window_sums == best).nonzero().max())


def from_planes(exp: torch.Tensor, sm: torch.Tensor, shape: tuple[int, ...]) -> ResidentWeight:
    """Exponent and sign/mantissa planes (uint8, flat) -> the resident code."""
    exp, sm = exp.reshape(-1), sm.reshape(-1).contiguous()
    base = choose_base(bf16.exponent_histogram(exp))
    off = base - exp.to(torch.int16)
    escaped = (off < 0) | (off >= WINDOW)
    off = torch.where(escaped, torch.full_like(off, ESCAPE), off).to(torch.uint8)
    if off.numel() % 2:
        off = torch.cat([off, off.new_zeros(1)])
    offs = off[0::2] | (off[1::2] << 4)
    esc_pos = escaped.nonzero().reshape(-1)
    if exp.numel() < (1 << 31):
        esc_pos = esc_pos.to(torch.int32)
    esc_bits = bf16.join(exp[esc_pos], sm[esc_pos]).view(torch.int16)
    return ResidentWeight(tuple(shape), sm, offs, base, esc_pos, esc_bits)


def from_bf16(t: torch.Tensor, name: str = "tensor") -> ResidentWeight:
    bf16.require_bf16(t, name)
    exp, sm = bf16.split(t.contiguous().reshape(-1))
    return from_planes(exp, sm, tuple(t.shape))


def planes_from_packed(p: weights.PackedTensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed tensor's exponent and sign/mantissa planes, checked against its crc32."""
    exp = huffman.decode(p.words, p.offsets, p.lengths, p.numel, p.chunk)
    if weights.crc32_bf16(bf16.join(exp, p.sm)) != p.crc32:
        raise CorruptFileError(f"{name}: decoded data does not match its checksum (the file is damaged)")
    return exp, p.sm


def _bits(offs: torch.Tensor, sm: torch.Tensor, base: int) -> torch.Tensor:
    """bf16 bits (int16) from offset bytes [..., k] and sign/mantissa bytes [..., <= 2k]; escapes unpatched."""
    off = torch.stack([offs & 0xF, offs >> 4], -1).reshape(*sm.shape[:-1], -1)[..., : sm.shape[-1]]
    e = base - off  # uint8 arithmetic wraps: escapes come out as garbage and are patched after
    hi = (sm & 0x80) | (e >> 1)
    lo = (e << 7) | (sm & 0x7F)
    return torch.stack([lo, hi], -1).view(torch.int16).reshape(sm.shape)  # little-endian: low byte first


def decode(r: ResidentWeight) -> torch.Tensor:
    """The whole weight, bf16, bit for bit."""
    bits = _bits(r.offs, r.sm, r.base)
    if r.esc_pos.numel():
        bits[r.esc_pos] = r.esc_bits
    return bits.view(torch.bfloat16).reshape(r.shape)


def decode_rows(r: ResidentWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a 2-D weight (an embedding lookup), bf16 [len(rows), cols], without decoding the rest."""
    n_rows, cols = r.shape
    if cols % 2:  # rows do not start on a byte of offsets
        return decode(r)[rows]
    rows = rows.reshape(-1).to(torch.int64)
    bits = _bits(r.offs.view(n_rows, cols // 2)[rows], r.sm.view(n_rows, cols)[rows], r.base)
    if r.esc_pos.numel():
        esc_row = torch.div(r.esc_pos, cols, rounding_mode="floor")  # ascending, like esc_pos
        first = torch.searchsorted(esc_row, rows)
        count = torch.searchsorted(esc_row, rows, right=True) - first
        total = int(count.sum())
        if total:  # (output row j, escape k) for every escape of a requested row; rows may repeat
            j = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), count)
            k = first[j] + torch.arange(total, device=rows.device) - (torch.cumsum(count, 0) - count)[j]
            bits[j, r.esc_pos[k] - esc_row[k] * cols] = r.esc_bits[k]
    return bits.view(torch.bfloat16)
