"""The weight tensor code: a bf16 tensor as sign/mantissa bytes plus a prefix-coded exponent stream.

A packed tensor named X is five tensors in a safetensors file (names keep X's module path, so vLLM's
loader maps them like the original, q_proj -> qkv_proj included):
  X_glyd_sm    uint8[n]       sign << 7 | mantissa, row-major
  X_glyd_exp   int32[m]       exponent codes, MSB-first in 32-bit words
  X_glyd_off   int32[c + 1]   bit offset of each chunk of CHUNK values, the last the total bits
                              (int64 when the stream reaches 2**31 bits)
  X_glyd_len   uint8[256]     code length of each exponent (canonical prefix code, <= 12 bits)
  X_glyd_meta  int64[5 + nd]  FORMAT_VERSION, chunk, n, crc32 of the bf16 bytes, ndim, *shape
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from glyd_engine.errors import CorruptFileError, UnsupportedModelError
from glyd_engine.format import FORMAT_VERSION, bf16, huffman

CHUNK = 512
PARTS = ("sm", "exp", "off", "len", "meta")
SUFFIX = "_glyd_"


def part_name(name: str, part: str) -> str:
    return f"{name}{SUFFIX}{part}"


def split_part_name(key: str) -> tuple[str, str] | None:
    """'X_glyd_sm' -> ('X', 'sm'); None for a plain tensor name."""
    base, sep, part = key.rpartition(SUFFIX)
    if not sep or part not in PARTS:
        return None
    return base, part


def crc32_bf16(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.int16).numpy().view(np.uint8).data) & 0xFFFFFFFF


@dataclass
class PackedTensor:
    shape: tuple[int, ...]
    sm: torch.Tensor
    words: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    chunk: int
    crc32: int

    @property
    def numel(self) -> int:
        return self.sm.numel()

    @property
    def nbytes(self) -> int:
        """Every byte stored for this tensor, table and metadata included."""
        meta = 8 * (5 + len(self.shape))
        return (self.sm.numel() + 4 * self.words.numel() + self.offsets.element_size() * self.offsets.numel()
                + 256 + meta)

    @property
    def bits_per_value(self) -> float:
        return 8 * self.nbytes / max(1, self.numel)

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        meta = torch.tensor([FORMAT_VERSION, self.chunk, self.numel, self.crc32, len(self.shape), *self.shape],
                            dtype=torch.int64)
        return {part_name(name, "sm"): self.sm, part_name(name, "exp"): self.words,
                part_name(name, "off"): self.offsets, part_name(name, "len"): self.lengths,
                part_name(name, "meta"): meta}

    @classmethod
    def from_parts(cls, name: str, parts: dict[str, torch.Tensor]) -> PackedTensor:
        """Rebuild from the five stored tensors, checking they are consistent (not their content)."""
        missing = [p for p in PARTS if part_name(name, p) not in parts]
        if missing:
            raise CorruptFileError(f"packed tensor {name}: missing part(s) {', '.join(missing)}")
        get = {p: parts[part_name(name, p)] for p in PARTS}
        meta = get["meta"].tolist()
        if len(meta) < 5 or meta[0] != FORMAT_VERSION:
            raise CorruptFileError(f"packed tensor {name}: unknown format version {meta[:1]} "
                                   f"(this Glyd reads version {FORMAT_VERSION})")
        _, chunk, n, crc, ndim, *shape = meta
        if len(shape) != ndim or int(np.prod(shape)) != n or chunk <= 0:
            raise CorruptFileError(f"packed tensor {name}: inconsistent shape metadata")
        sm, words, offsets, lengths = get["sm"], get["exp"], get["off"], get["len"]
        if sm.dtype != torch.uint8 or sm.numel() != n:
            raise CorruptFileError(f"packed tensor {name}: sign/mantissa plane has the wrong size")
        if (offsets.numel() != (n + chunk - 1) // chunk + 1 or words.dtype != torch.int32
                or offsets.dtype not in (torch.int32, torch.int64)):
            raise CorruptFileError(f"packed tensor {name}: chunk offsets do not match its size")
        offs = offsets.to(torch.int64)
        if bool((offs[1:] < offs[:-1]).any()) or int(offs[0]) != 0 or int(offs[-1]) > 32 * words.numel():
            raise CorruptFileError(f"packed tensor {name}: chunk offsets out of order or past the stream")
        try:
            huffman.check_lengths(lengths)
        except ValueError as exc:
            raise CorruptFileError(f"packed tensor {name}: bad code table ({exc})") from exc
        return cls(tuple(shape), sm, words, offsets, lengths, chunk, crc)


def encode(t: torch.Tensor, name: str = "tensor", chunk: int = CHUNK) -> PackedTensor:
    bf16.require_bf16(t, name)
    if t.numel() == 0:
        raise UnsupportedModelError(f"{name} is empty (shape {tuple(t.shape)}): there is nothing to pack")
    t = t.contiguous()
    exp, sm = bf16.split(t.reshape(-1))
    lengths = huffman.code_lengths(bf16.exponent_histogram(exp))
    words, offsets = huffman.encode(exp, lengths, chunk)
    if int(offsets[-1]) < (1 << 31):
        offsets = offsets.to(torch.int32)  # half the index bytes; streams of 2**31 bits or more keep int64
    return PackedTensor(tuple(t.shape), sm, words, offsets, lengths, chunk, crc32_bf16(t))


def decode(p: PackedTensor, name: str = "tensor", check: bool = True) -> torch.Tensor:
    exp = huffman.decode(p.words, p.offsets, p.lengths, p.numel, p.chunk)
    out = bf16.join(exp, p.sm).reshape(p.shape)
    if check and crc32_bf16(out) != p.crc32:
        raise CorruptFileError(f"{name}: decoded data does not match its checksum (the file is damaged)")
    return out
