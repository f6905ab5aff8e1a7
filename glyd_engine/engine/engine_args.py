"""vLLM's engine keyword arguments from a model directory and Glyd's engine settings.

One function for glyd-chat's engine runner and the benches, so a bench measures the engine the app runs,
and the KV mode reaches vLLM one way: `additional_config {"glyd": {"kv": ...}}` (glyd_engine.kv_mode).
Plain data only: it imports neither torch nor vLLM (callers pass the result to `EngineArgs` or `LLM`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glyd_engine import kv_mode
from glyd_engine.engine.protocol import EngineSettings

MIB = 1 << 20


def kv_cache_bytes(mib: int | None) -> int | None:
    """A KV budget given in MiB (`--kv-cache-mib`, config.toml's `kv_cache_mib`) in bytes; 0 or None:
    None, which lets vLLM size the cache (a GPU)."""
    if not mib:
        return None
    return int(mib) * MIB


def engine_args(model_dir: str | Path, settings: EngineSettings, *, cpu: bool,
                glyd: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """`EngineArgs`/`LLM` keywords for `settings` (`cpu`: vLLM's CPU build, where eager is the default).

    `glyd`: further Glyd settings for this engine (check, kernels, code); `extra`: vLLM arguments the
    settings do not cover (seed, prefix caching, quantization...), which win over the settings' own."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        enforce_eager=cpu if settings.enforce_eager is None else settings.enforce_eager,
        additional_config=kv_mode.additional_config(settings.kv, **(glyd or {})),
    )
    if settings.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.kv_cache_bytes:
        kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_bytes)
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    kwargs.update(extra)
    return kwargs
