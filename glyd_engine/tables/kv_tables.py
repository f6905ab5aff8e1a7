"""KVTables: what the KV page code needs per model, and its file (safetensors, atomic, checksummed).

tops3, tops4  uint8[L, 2, H, D]  the top of each channel's window (8 exponents for the 3-bit code, 16 for the
                                4-bit one), per layer, K/V, KV head, channel (glyd_engine.format.kv_page)
floor         float32[L, 2, H, D] order-0 exponent entropy per channel on the calibration text (bits)
reserve3, reserve4               escape-list entries a 16-token tile (K and V together) of each code, from calibration
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from glyd_engine.atomic import atomic_path
from glyd_engine.errors import CorruptFileError
from glyd_engine.format import FORMAT_VERSION
from glyd_engine.format.kv_page import (
    CODE_BITS,
    KV_PAGE_VERSION,
    UNSEEN_TOP,
    KVPageCodec,
    KVPageLayout,
    check_head_size,
    check_tops,
    page_reserve,
    token_bytes,
    valid_reserve,
)

# Bumped when the tables' meaning changes, separately from FORMAT_VERSION (weights on disk stay valid):
# 3 = page code v3 (8-exponent window tops, an escape-list reserve a tile); 1 and 2 were page code v1/v2's
# 7-exponent tables and are rebuilt.
KV_TABLES_VERSION = 3
DEFAULT_ESCAPE_RATE = {3: 0.02, 4: 0.002}  # the reserve of tables with no calibration: this share of a tile's values


def default_reserve(head_size: int, code_bits: int) -> int:
    return valid_reserve(round(DEFAULT_ESCAPE_RATE[code_bits] * 32 * head_size))


@dataclass
class KVTables:
    tops: dict[int, torch.Tensor]  # code bits -> uint8 [L, 2, H, D]
    floor: torch.Tensor
    reserve: dict[int, int]  # code bits -> escape-list entries a tile
    fingerprint: str
    window: int
    tokens: int  # calibration tokens seen
    build_seconds: float = 0.0

    def __post_init__(self) -> None:
        # tables are a file's content: built on a GPU, they are still saved, checksummed and shared from host memory
        self.tops = {b: t.detach().cpu() for b, t in self.tops.items()}
        self.floor = self.floor.detach().cpu()

    @property
    def num_layers(self) -> int:
        return self.floor.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.floor.shape[2]

    @property
    def head_size(self) -> int:
        return self.floor.shape[3]

    def page_reserve(self, code_bits: int = 3) -> int:
        """Escape-list entries a tile of the pages: the calibrated reserve, made whole in bf16 elements."""
        return page_reserve(self.head_size, self.reserve[code_bits], code_bits)

    def token_bytes(self, code_bits: int = 3) -> int:
        """C: page bytes a token and KV head (what vLLM's allocator sees; independent of the block size)."""
        return token_bytes(self.head_size, self.page_reserve(code_bits), code_bits)

    def layout(self, block_size: int, code_bits: int = 3) -> KVPageLayout:
        return KVPageLayout(self.head_size, block_size, self.page_reserve(code_bits), code_bits)

    def codec(self, layer: int, block_size: int, code_bits: int = 3) -> KVPageCodec:
        return KVPageCodec(self.layout(block_size, code_bits), self.tops[code_bits][layer])

    def floor_bits(self, kv: int) -> float:
        """Order-0 exponent entropy per channel, averaged, plus the 8 sign/mantissa bits."""
        return 8.0 + float(self.floor[:, kv].mean())

    def select(self, layers: range, kv_heads: range) -> KVTables:
        """The tables of some layers and KV heads (a tensor/pipeline-parallel worker's share), copied so the rest
        can be freed. The escape reserve stays the whole model's, so every worker's page size is the same."""
        if layers.step != 1 or kv_heads.step != 1 or not (0 <= layers.start < layers.stop <= self.num_layers) or not (
                0 <= kv_heads.start < kv_heads.stop <= self.num_kv_heads):
            raise ValueError(f"layers {layers} and KV heads {kv_heads} are not a slice of tables for "
                             f"{self.num_layers} layers and {self.num_kv_heads} KV heads")
        cut = (slice(layers.start, layers.stop), slice(None), slice(kv_heads.start, kv_heads.stop))
        return KVTables({b: t[cut].clone() for b, t in self.tops.items()}, self.floor[cut].clone(), dict(self.reserve),
                        self.fingerprint, self.window, self.tokens, self.build_seconds)

    @property
    def nbytes(self) -> int:
        """Bytes one code's tables take in memory while serving (its window tops)."""
        return self.floor.numel()

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_size: int, fingerprint: str = "uniform"
                ) -> KVTables:
        """Tables with no calibration (exponents 120..127 everywhere): lossless, just less compact."""
        check_head_size(head_size)
        tops = torch.full((num_layers, 2, num_kv_heads, head_size), UNSEEN_TOP, dtype=torch.uint8)
        return cls({b: tops.clone() for b in CODE_BITS}, torch.zeros(num_layers, 2, num_kv_heads, head_size),
                   {b: default_reserve(head_size, b) for b in CODE_BITS}, fingerprint, 0, 0)

    # -- file ------------------------------------------------------------------------------------
    def _checksum(self) -> str:
        h = hashlib.sha256()
        for b in CODE_BITS:
            h.update(self.tops[b].contiguous().numpy().tobytes())
        h.update(self.floor.contiguous().numpy().tobytes())
        h.update(f"{sorted(self.reserve.items())},{self.fingerprint},{self.window}".encode())
        return h.hexdigest()

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        meta = {
            "format": "glyd-kv-tables", "format_version": str(FORMAT_VERSION),
            "tables_version": str(KV_TABLES_VERSION), "page_version": str(KV_PAGE_VERSION),
            "fingerprint": self.fingerprint, "window": str(self.window), "tokens": str(self.tokens),
            **{f"reserve{b}": str(self.reserve[b]) for b in CODE_BITS},
            "build_seconds": f"{self.build_seconds:.1f}", "sha256": self._checksum(),
        }
        tensors = {f"tops{b}": self.tops[b].contiguous() for b in CODE_BITS}
        with atomic_path(path) as tmp:
            save_file({**tensors, "floor": self.floor.contiguous()}, str(tmp), metadata=meta)

    @classmethod
    def load(cls, path: Path, fingerprint: str | None = None) -> KVTables:
        """Read and check a tables file; CorruptFileError says what is wrong."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        except FileNotFoundError:
            raise
        except Exception as exc:  # safetensors raises several types for damaged files
            raise CorruptFileError(f"KV tables {path} are unreadable ({exc}); delete the file to rebuild it") from exc
        if meta.get("format") != "glyd-kv-tables" or meta.get("format_version") != str(FORMAT_VERSION):
            raise CorruptFileError(f"{path} is not a version-{FORMAT_VERSION} Glyd KV tables file")
        if meta.get("tables_version", "1") != str(KV_TABLES_VERSION):
            raise CorruptFileError(f"{path} holds version-{meta.get('tables_version', '1')} KV tables for an older "
                                   f"page code (this Glyd writes page code v{KV_PAGE_VERSION}, tables version "
                                   f"{KV_TABLES_VERSION}); delete it to rebuild")
        try:
            t = cls({b: tensors[f"tops{b}"] for b in CODE_BITS}, tensors["floor"],
                    {b: int(meta[f"reserve{b}"]) for b in CODE_BITS}, meta["fingerprint"], int(meta["window"]),
                    int(meta["tokens"]), float(meta.get("build_seconds", 0)))
        except (KeyError, ValueError) as exc:
            raise CorruptFileError(f"{path} lacks {exc}; delete it to rebuild") from exc
        if any(x.dtype != torch.uint8 or x.shape != t.floor.shape or x.dim() != 4 for x in t.tops.values()):
            raise CorruptFileError(f"{path}: window tops have the wrong shape or type")
        if t._checksum() != meta.get("sha256"):
            raise CorruptFileError(f"{path}: checksum mismatch (damaged file); delete it to rebuild")
        try:
            for b in CODE_BITS:
                check_tops(t.tops[b], b)
                t.layout(16, b)
        except ValueError as exc:
            raise CorruptFileError(f"{path}: {exc}") from exc
        if fingerprint is not None and t.fingerprint != fingerprint:
            raise CorruptFileError(f"{path} belongs to another model (fingerprint {t.fingerprint[:12]})")
        return t

    def describe(self) -> dict[str, object]:
        return {"layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_size": self.head_size,
                **{f"token_bytes_{b}bit": self.token_bytes(b) for b in CODE_BITS}, "window": self.window,
                "tokens": self.tokens, "k_floor_bits": round(self.floor_bits(0), 3),
                "v_floor_bits": round(self.floor_bits(1), 3)}
