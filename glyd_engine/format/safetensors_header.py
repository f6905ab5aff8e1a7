"""Reading a safetensors file's header without torch: the one reader, and the one dtype table.

Everything that looks at a checkpoint's tensors before loading them (validation, the fingerprint, packing,
the engine's memory report) reads headers here, so a damaged file fails the same way everywhere: a
`CorruptFileError` naming the file, never a `struct.error` or an `OverflowError` deep in a loader.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from glyd_engine.errors import CorruptFileError

MAX_HEADER_BYTES = 100 * 2**20  # a larger length field is damage, not a header


@dataclass(frozen=True)
class Dtype:
    item_bytes: int
    torch_name: str  # `getattr(torch, torch_name)`; also what the engine reports as a checkpoint's dtype


DTYPES: dict[str, Dtype] = {
    "BF16": Dtype(2, "bfloat16"), "F16": Dtype(2, "float16"), "F32": Dtype(4, "float32"),
    "F64": Dtype(8, "float64"), "F8_E4M3": Dtype(1, "float8_e4m3fn"), "F8_E5M2": Dtype(1, "float8_e5m2"),
    "I64": Dtype(8, "int64"), "I32": Dtype(4, "int32"), "I16": Dtype(2, "int16"), "I8": Dtype(1, "int8"),
    "U64": Dtype(8, "uint64"), "U32": Dtype(4, "uint32"), "U16": Dtype(2, "uint16"), "U8": Dtype(1, "uint8"),
    "BOOL": Dtype(1, "bool"),
}
# The float dtypes an engine casts to its run dtype; fp8 weights are a quantization, held as stored.
FLOATS = frozenset({"BF16", "F16", "F32", "F64"})


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The parsed JSON header (with "__metadata__" if present) and the byte offset where tensor data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CorruptFileError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CorruptFileError(f"{path} has an implausible safetensors header size ({n} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CorruptFileError(f"{path} has a damaged safetensors header: {exc}") from exc
    if len(raw) != n or not isinstance(header, dict):
        raise CorruptFileError(f"{path} has a truncated safetensors header")
    return header, 8 + n


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets), its metadata left out."""
    header, _ = read_safetensors_header(path)
    header.pop("__metadata__", None)
    return header


def check_safetensors(path: Path) -> None:
    """A damaged weight file named as such (from its header alone, no tensor read), rather than an error deep
    in a loader (a huge offset surfaces as `OverflowError: cannot fit 'int' into an index-sized integer`)."""
    header, data_start = read_safetensors_header(path)
    size = path.stat().st_size
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            dtype = DTYPES.get(info["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptFileError(f"{path} is damaged: the entry for {name} is unreadable ({exc}); "
                                   "download or copy the file again") from exc
        if not 0 <= begin <= end or data_start + end > size or (dtype and (end - begin) != numel * dtype.item_bytes):
            raise CorruptFileError(f"{path} is damaged: {name} claims bytes {begin}..{end} "
                                   f"(shape {info['shape']}, {info['dtype']}) of a {size:,}-byte file; "
                                   "download or copy the file again")
