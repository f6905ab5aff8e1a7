"""KVTables: what the KV page code needs per model, and its file (safetensors, atomic, checksummed).

decode  uint8[L, 2, H, D, 7]   the 7 exponents codes 0..6 stand for, per layer, K/V, KV head, channel: a window,
                              code c = top - c (glyd_engine.format.kv_page)
floor   float32[L, 2, H, D]    order-0 exponent entropy per channel on the calibration text (bits)
k_escapes, v_escapes           escape bytes reserved per token (pooled per page), from calibration
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
    TABLE_SIZE,
    UNSEEN_TOP,
    KVPageCodec,
    KVPageLayout,
    default_escapes,
    window_bases,
    window_tables,
)

# Bumped when the tables' meaning changes, separately from FORMAT_VERSION (weights on disk stay valid):
# 2 = window tables for the word-wide page decode (1 held each channel's 7 most frequent exponents).
KV_TABLES_VERSION = 2


@dataclass
class KVTables:
    decode: torch.Tensor
    floor: torch.Tensor
    k_escapes: int
    v_escapes: int
    fingerprint: str
    window: int
    tokens: int  # calibration tokens seen
    build_seconds: float = 0.0

    @property
    def num_layers(self) -> int:
        return self.decode.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.decode.shape[2]

    @property
    def head_size(self) -> int:
        return self.decode.shape[3]

    def layout(self, block_size: int) -> KVPageLayout:
        return KVPageLayout(self.head_size, block_size, self.k_escapes, self.v_escapes)

    def codec(self, layer: int, block_size: int) -> KVPageCodec:
        return KVPageCodec(self.layout(block_size), self.decode[layer])

    def floor_bits(self, kv: int) -> float:
        """Order-0 exponent entropy per channel, averaged, plus the 8 sign/mantissa bits."""
        return 8.0 + float(self.floor[:, kv].mean())

    @property
    def nbytes(self) -> int:
        """Bytes the tables take in memory while serving (the decode tables)."""
        return self.decode.numel()

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_size: int, fingerprint: str = "uniform"
                ) -> KVTables:
        """Tables with no calibration (exponents 120..126 everywhere): lossless, just less compact."""
        dec = window_tables(torch.full((num_layers, 2, num_kv_heads, head_size), UNSEEN_TOP, dtype=torch.uint8))
        e = default_escapes(head_size)
        return cls(dec, torch.zeros(num_layers, 2, num_kv_heads, head_size), e, e, fingerprint, 0, 0)

    # -- file ------------------------------------------------------------------------------------
    def _checksum(self) -> str:
        h = hashlib.sha256()
        h.update(self.decode.contiguous().numpy().tobytes())
        h.update(self.floor.contiguous().numpy().tobytes())
        h.update(f"{self.k_escapes},{self.v_escapes},{self.fingerprint},{self.window}".encode())
        return h.hexdigest()

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        meta = {
            "format": "glyd-kv-tables", "format_version": str(FORMAT_VERSION),
            "tables_version": str(KV_TABLES_VERSION),
            "fingerprint": self.fingerprint, "window": str(self.window), "tokens": str(self.tokens),
            "k_escapes": str(self.k_escapes), "v_escapes": str(self.v_escapes),
            "build_seconds": f"{self.build_seconds:.1f}", "sha256": self._checksum(),
        }
        with atomic_path(path) as tmp:
            save_file({"decode": self.decode.contiguous(), "floor": self.floor.contiguous()}, str(tmp),
                      metadata=meta)

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
            raise CorruptFileError(f"{path} holds version-{meta.get('tables_version', '1')} KV tables (this Glyd "
                                   f"uses version {KV_TABLES_VERSION}); delete it to rebuild")
        try:
            t = cls(tensors["decode"], tensors["floor"], int(meta["k_escapes"]), int(meta["v_escapes"]),
                    meta["fingerprint"], int(meta["window"]), int(meta["tokens"]),
                    float(meta.get("build_seconds", 0)))
        except (KeyError, ValueError) as exc:
            raise CorruptFileError(f"{path} lacks {exc}; delete it to rebuild") from exc
        if t.decode.dtype != torch.uint8 or t.decode.dim() != 5 or t.decode.shape[-1] != TABLE_SIZE:
            raise CorruptFileError(f"{path}: decode table has the wrong shape or type")
        if t._checksum() != meta.get("sha256"):
            raise CorruptFileError(f"{path}: checksum mismatch (damaged file); delete it to rebuild")
        try:
            window_bases(t.decode)
        except ValueError as exc:
            raise CorruptFileError(f"{path}: {exc}") from exc
        if fingerprint is not None and t.fingerprint != fingerprint:
            raise CorruptFileError(f"{path} belongs to another model (fingerprint {t.fingerprint[:12]})")
        return t

    def describe(self) -> dict[str, object]:
        return {"layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_size": self.head_size,
                "k_escapes": self.k_escapes, "v_escapes": self.v_escapes, "window": self.window,
                "tokens": self.tokens, "k_floor_bits": round(self.floor_bits(0), 3),
                "v_floor_bits": round(self.floor_bits(1), 3)}
