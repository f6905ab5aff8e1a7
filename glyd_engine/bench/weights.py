"""`glyd bench weights`: the real vLLM engine on a bf16 model and on its Glyd checkpoint, same workload.

Both engines run vLLM's own KV cache (GLYD_KV=off), so the only difference is the weights: bf16
tensors against the resident Glyd code decoded for every matmul. Reports whether prompt logprobs and
greedy tokens are identical, the bytes the weights hold, and decode tokens a second at the same batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glyd_engine.bench.kv import DEFAULT_KV_BYTES, bits_equal, run_engine


def packed_copy(model: Path) -> Path:
    """The model's Glyd checkpoint in the cache, packed on first use (keyed by the source's fingerprint)."""
    from glyd_engine.format.checkpoint import is_glyd_checkpoint, pack_model
    from glyd_engine.format.fingerprint import model_fingerprint
    from glyd_engine.paths import cache_dir
    from glyd_engine.progress import print_progress

    if is_glyd_checkpoint(model):
        return model
    dst = cache_dir() / "packed" / f"{model.name}-{model_fingerprint(model)[:12]}"
    if not (dst / "config.json").exists():
        pack_model(model, dst, progress=print_progress)
    return dst


def safetensors_bytes(model_dir: Path) -> int:
    """What a model's weights take on disk: its safetensors files, headers included."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def run_weights_bench(model: Path, logprob_tokens: int = 2000, batch: int = 4, max_tokens: int = 16,
                      kv_bytes: int = DEFAULT_KV_BYTES) -> dict[str, Any]:
    packed = packed_copy(model)
    work = {"logprobs": [logprob_tokens], "greedy": {"prompts": [64, 300], "max_tokens": max_tokens},
            "speed": {"batch": batch, "prompt": 64, "max_tokens": max_tokens}}
    base = {"kv_bytes": kv_bytes, "mode": "off", "work": work, "max_model_len": max(4096, logprob_tokens + 16)}
    bf16 = run_engine({**base, "model": str(model)})
    glyd = run_engine({**base, "model": str(packed), "quantization": "glyd"})
    w = glyd["weights"]
    return {
        "model": str(model), "packed": str(packed),
        "prompt_logprob_tokens": logprob_tokens,
        "prompt_logprobs_identical": bits_equal(bf16, glyd),
        "greedy_tokens_identical": bf16["greedy"] == glyd["greedy"],
        "weight_values_packed": w["glyd_weight_values"],
        "weight_bytes_bf16": w["bf16_weight_bytes"], "weight_bytes_resident": w["glyd_weight_bytes"],
        "resident_bits_per_weight": round(8 * w["glyd_weight_bytes"] / max(1, w["glyd_weight_values"]), 4),
        "resident_escape_share": round(w["glyd_weight_escapes"] / max(1, w["glyd_weight_values"]), 5),
        "disk_bytes_bf16": safetensors_bytes(model), "disk_bytes_glyd": safetensors_bytes(packed),
        "decode_batch": batch,
        "decode_tokens_per_s_bf16": bf16["decode_tokens_per_s"],
        "decode_tokens_per_s_glyd": glyd["decode_tokens_per_s"],
        "start_s_bf16": bf16["start_s"], "start_s_glyd": glyd["start_s"],
        "vllm_version": bf16["vllm"], "device": "cpu",
    }
