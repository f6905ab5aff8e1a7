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

from glyd_engine.vllm_plugin.settings import UnsupportedVLLMError

log = logging.getLogger("vllm.glyd")

_registered = False


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
    """vLLM's general-plugin entry point (see the module docstring).

    The KV mode is not decided here: `additional_config` (which wins over GLYD_KV) is not known until vLLM
    makes the engine config, where the wrapped config check decides once for both sources (settings.decide).
    Only GLYD_KV is read here, to refuse a misspelt value at once. When this vLLM lacks a hook, only that
    check is wrapped: it refuses lossless/exact from either source and tells auto why it stays off."""
    global _registered
    if _registered:
        return
    from glyd_engine import kv_mode
    from glyd_engine.vllm_plugin import settings

    asked = kv_mode.asked()  # a SettingError (a ValueError) for a misspelt GLYD_KV: better now than silently off
    from glyd_engine.vllm_plugin import (
        hooks,
        weights,  # noqa: F401  (registers the "glyd" quantization config)
    )

    missing = missing_hooks()
    platform_cls = _platform_cls()
    if missing:
        import vllm

        settings.set_missing_hooks(missing, vllm.__version__)
        if platform_cls is not None and hasattr(platform_cls, "check_and_update_config"):
            hooks.install_config_check(platform_cls)
        elif asked in kv_mode.PAGE_MODES:  # no later place sees the config: refuse now, on GLYD_KV alone
            raise UnsupportedVLLMError(f"Glyd KV cache ({kv_mode.ENV}={asked}) cannot run: {settings.missing_hooks()}",
                                       f"install a supported vLLM, or {settings.OFF_HINT}")
        log.warning("Glyd KV cache stays off, and lossless/exact are refused: %s", settings.missing_hooks())
        _registered = True
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in (("GLYD", hooks.BACKEND_PATH), ("GLYD_GPU", hooks.GPU_BACKEND_PATH)):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
    assert platform_cls is not None  # missing_hooks() names vllm.platforms when it cannot be imported
    hooks.install(platform_cls)
    from glyd_engine.vllm_plugin import server_errors

    server_errors.install()  # an API server's clients read why a request was refused
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from glyd_engine.vllm_plugin import cpu_pipeline

        cpu_pipeline.install()
    _registered = True


def _platform_cls() -> type | None:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return type(current_platform)


def kv_status(vllm_config: Any) -> dict[str, Any]:
    """The KV mode in force for an engine (lossless, exact, or off: vLLM's own cache), why, and its bytes a
    token (all layers, K and V): for the app. It reports the decision the engine was built with
    (settings.decide's cached one), not a new one."""
    from glyd_engine.vllm_plugin import settings, state

    d = settings.decide(vllm_config)
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    layers, heads = mc.get_num_layers(pc), mc.get_num_kv_heads(pc)
    bf16 = 2 * layers * heads * mc.get_head_size() * 2
    if not d.active:
        reason = d.reason or ("KV compression is off (setting)" if d.asked == "off" else "")
        return {"mode": d.mode, "reason": reason, "bytes_per_token": float(bf16)}
    tables = state.load_tables(mc.model)
    per_token = layers * heads * tables.token_bytes(settings.code_bits(vllm_config))
    return {"mode": d.mode, "reason": f"every value exact, {bf16 / per_token:.2f}x the tokens of bf16",
            "bytes_per_token": float(per_token)}
