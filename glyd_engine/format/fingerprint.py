"""The model fingerprint: the identity of a model's values, keying per-model caches (the KV tables).

It lives with the format because a Glyd checkpoint records its source's fingerprint (`pack_model` writes
it, this reads it back), so a packed model shares the caches of the bf16 model it holds bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from glyd_engine.format.model_dir import validate_model_dir
from glyd_engine.format.safetensors_header import read_safetensors_header


def model_fingerprint(model_dir: Path, sample_bytes: int = 64 * 1024) -> str:
    """A digest of the config, every header, and the ends of each file's tensor data.

    Headers pin names, dtypes, shapes and offsets; the sampled bytes catch a re-export with the same
    layout but different values. Reads well under a megabyte per file, so 16 GB models cost nothing.
    """
    model_dir = validate_model_dir(model_dir)
    quant = _quantization_config(model_dir / "config.json")
    if quant.get("quant_method") == "glyd" and isinstance(quant.get("source_fingerprint"), str):
        return quant["source_fingerprint"]
    h = hashlib.sha256(b"glyd-model-fingerprint-v1\0")
    h.update((model_dir / "config.json").read_bytes())
    for file in sorted(model_dir.glob("*.safetensors")):
        _, data_start = read_safetensors_header(file)
        size = file.stat().st_size
        h.update(f"\0{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            h.update(f.read(data_start))
            f.seek(data_start)
            h.update(f.read(sample_bytes))
            f.seek(max(data_start, size - sample_bytes))
            h.update(f.read(sample_bytes))
    return h.hexdigest()


def _quantization_config(config_path: Path) -> dict:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return quant if isinstance(quant, dict) else {}
