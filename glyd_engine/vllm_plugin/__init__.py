"""The `glyd` vLLM plugin: lossless KV pages and Glyd-packed weights (`--quantization glyd`) inside vLLM.

`register()` is vLLM's `vllm.general_plugins` entry point: it runs once in every vLLM process (API
server, engine core, workers) before models are built. It is idempotent, touches no accelerator, and
does nothing for a model the settings do not put under Glyd (GLYD_KV=off, or auto where the lossless
cache is not the faster choice). It checks that the vLLM hooks it relies on exist and names the vLLM
range it supports when they do not.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm.glyd")

_registered = False


class UnsupportedVLLMError(RuntimeError):
    """vLLM lacks a hook the plugin needs (a version outside the supported range)."""


def missing_hooks() -> list[str]:
    """The vLLM APIs the plugin needs and this vLLM lacks (empty: all present)."""
    missing: list[str] = []
    try:
        from vllm.v1.attention.backend import AttentionBackend

        if not hasattr(AttentionBackend, "customize_spec"):
            missing.append("AttentionBackend.customize_spec (vLLM issue #42449)")
        if not hasattr(AttentionBackend, "forward_includes_kv_cache_update"):
            missing.append("AttentionBackend.forward_includes_kv_cache_update")
    except ImportError as exc:
        missing.append(f"vllm.v1.attention.backend ({exc})")
    try:
        import dataclasses

        from vllm.v1.kv_cache_interface import AttentionSpec

        if "state_content_bytes" not in {f.name for f in dataclasses.fields(AttentionSpec)}:
            missing.append("AttentionSpec.state_content_bytes")
    except ImportError as exc:
        missing.append(f"vllm.v1.kv_cache_interface ({exc})")
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        if not hasattr(CPUAttentionBackendImpl, "do_kv_cache_update"):
            missing.append("CPUAttentionBackendImpl.do_kv_cache_update")
    except ImportError as exc:
        missing.append(f"vllm.v1.attention.backends.cpu_attn ({exc})")
    try:
        from vllm.platforms import current_platform

        for name in ("get_attn_backend_cls", "check_and_update_config"):
            if not hasattr(type(current_platform), name):
                missing.append(f"Platform.{name}")
    except ImportError as exc:
        missing.append(f"vllm.platforms ({exc})")
    return missing


def register() -> None:
    """vLLM's general-plugin entry point (see the module docstring)."""
    global _registered
    if _registered:
        return
    from glyd_engine.vllm_plugin import settings

    asked = settings.asked_mode()  # raises ValueError for a misspelt GLYD_KV: better now than silently off
    from glyd_engine.vllm_plugin import weights  # noqa: F401  (registers the "glyd" quantization config)

    missing = missing_hooks()
    if missing:
        import vllm

        msg = (f"the Glyd plugin supports vLLM {settings.SUPPORTED_VLLM}; this is vLLM {vllm.__version__}, "
               f"which lacks: {', '.join(missing)}")
        if asked in ("lossless", "exact"):
            raise UnsupportedVLLMError(f"{msg}. Install a supported vLLM or {settings.OFF_HINT}.")
        log.warning("%s; Glyd stays off", msg)
        _registered = True
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from glyd_engine.vllm_plugin import hooks

    for name, path in (("GLYD", hooks.BACKEND_PATH), ("GLYD_TRITON", hooks.TRITON_BACKEND_PATH)):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
    hooks.install(type(current_platform))
    _registered = True


def kv_status(vllm_config: Any) -> dict[str, Any]:
    """The KV mode in force for an engine, why, and its bytes a token (all layers, K and V): for the app."""
    from glyd_engine.vllm_plugin import settings, state

    d = settings.decide(vllm_config)
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    layers, heads = mc.get_num_layers(pc), mc.get_num_kv_heads(pc)
    bf16 = 2 * layers * heads * mc.get_head_size() * 2
    if not d.active:
        reason = d.reason or ("KV compression is off (setting)" if d.asked == "off" else "")
        return {"mode": "vllm", "reason": reason, "bytes_per_token": float(bf16)}
    tables = state.load_tables(mc.model)
    per_token = layers * heads * tables.layout(1).token_bytes
    return {"mode": d.mode, "reason": f"every value exact, {bf16 / per_token:.2f}x the tokens of bf16",
            "bytes_per_token": float(per_token)}
