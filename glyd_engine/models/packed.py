"""A Glyd checkpoint on a machine without the fast path: say so before it loads, and find its bf16 model.

On vLLM's CPU build a Glyd checkpoint's weights are decoded in plain torch before every matmul (the CUDA
kernels are the fast path), so glyd-chat replies at a fraction of a token a second. The app asks before it
loads one (offering the bf16 model it was packed from where that is here) and `glyd serve` prints a warning.
Torch-free: reads config.json and safetensors headers only.
"""

from __future__ import annotations

from pathlib import Path

from glyd_engine.errors import GlydError
from glyd_engine.format.fingerprint import model_fingerprint
from glyd_engine.models.local import LocalModel, list_local_models, read_json

SLOW_CPU = ("its weights are decoded in plain torch before every matmul on the CPU (the fast path is CUDA): "
            "replies come at about 0.1-0.4 tokens a second in glyd-chat, against 27-30 for the demo model "
            "in bf16 on 2 cores")


def source_fingerprint(model_dir: Path) -> str | None:
    """The fingerprint of the bf16 model a Glyd checkpoint was packed from (None: not a Glyd checkpoint)."""
    quant = (read_json(Path(model_dir) / "config.json") or {}).get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "glyd":
        fp = quant.get("source_fingerprint")
        return fp if isinstance(fp, str) else ""
    return None


def bf16_source(model_dir: Path) -> LocalModel | None:
    """The bf16 model this checkpoint was packed from, among the models here, the latest used first (None: not
    here)."""
    wanted = source_fingerprint(model_dir)
    if not wanted:
        return None
    for model in reversed(list_local_models()):
        if model.kind == "glyd-packed":
            continue
        try:
            if model_fingerprint(model.path) == wanted:
                return model
        except (OSError, GlydError):
            continue
    return None


def slow_here(model_dir: Path, gpu: bool) -> str | None:
    """Why this model will be slow here, where it is a Glyd checkpoint and no CUDA GPU runs it (else None)."""
    if gpu or source_fingerprint(model_dir) is None:
        return None
    return f"{Path(model_dir).name} is a Glyd checkpoint: {SLOW_CPU}"
