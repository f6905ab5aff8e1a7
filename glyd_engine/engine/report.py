"""The memory numbers the engine reports: weights and KV cache, each against what bf16 would take.

Kept apart from the vLLM backend so the figures are computed one way for every engine; the KV mode is
the one Glyd's vLLM plugin decided for the engine (`glyd_engine.vllm_plugin.kv_status`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glyd_engine.format.safetensors_header import DTYPES, FLOATS, read_header

log = logging.getLogger("glyd.engine")


@dataclass(frozen=True)
class WeightsReport:
    bytes: int  # what the engine holds: float tensors at the run dtype, packed ones in their resident code
    bf16_bytes: int  # what the same weights take in bf16
    dtype: str = "bfloat16"  # what the checkpoint holds: its float tensors' dtype (most bytes), or "glyd"
    file_bytes: int = 0  # what the checkpoint's tensors take on disk


def weights_report(model_dir: Path, resident_bytes: int | None = None, run_bytes: int = 2) -> WeightsReport:
    """Sum tensor bytes from the safetensors headers (no tensor is read).

    A Glyd checkpoint's packed tensors count, against bf16, at 2 bytes for each value of their
    sign/mantissa part; what they hold is `resident_bytes` (the engine's resident code, measured in the
    worker) when given, else their bytes on disk. Plain float tensors are held at `run_bytes` a value (the
    engine's dtype: an fp32 checkpoint run as bf16 holds half its file), others at their own size.
    """
    plain = packed = bf16 = on_disk = 0
    by_dtype: dict[str, int] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, info in read_header(file).items():
            begin, end = info["data_offsets"]
            on_disk += end - begin
            numel = 1
            for d in info["shape"]:
                numel *= d
            if "_glyd_" in name:
                packed += end - begin
                bf16 += 2 * numel if name.endswith("_glyd_sm") else 0
                by_dtype["glyd"] = by_dtype.get("glyd", 0) + end - begin
            elif info["dtype"] in FLOATS:
                plain += numel * run_bytes
                bf16 += numel * 2
                by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + end - begin
            else:
                plain += end - begin
                bf16 += end - begin
    main = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "BF16"
    held = plain + (packed if resident_bytes is None else resident_bytes)
    return WeightsReport(held, bf16, DTYPES[main].torch_name if main in DTYPES else main, on_disk)


@dataclass(frozen=True)
class KVReport:
    mode: str  # "lossless" | "exact" | "off" (vLLM's own cache): what the engine was built with
    reason: str
    bytes_per_token: float
    bf16_bytes_per_token: float


def bf16_kv_bytes_per_token(vllm_config: Any) -> int:
    """K and V for every attention layer, at 2 bytes a value."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    layers = mc.get_num_layers(pc)
    heads = mc.get_num_kv_heads(pc)
    head = mc.get_head_size()
    return 2 * layers * heads * head * 2


def kv_report(vllm_config: Any) -> KVReport:
    """The KV mode the plugin decided for this engine (its cached decision, not a new one), and its size."""
    from glyd_engine.vllm_plugin import kv_status

    status = kv_status(vllm_config)
    bf16 = float(bf16_kv_bytes_per_token(vllm_config))
    return KVReport(status["mode"], status["reason"], float(status["bytes_per_token"]), bf16)


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident memory of a process (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
