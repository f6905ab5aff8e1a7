"""The two places Glyd enters vLLM: the platform's config check and its attention backend selector.

- `check_and_update_config` runs where the engine config is made (the user's process, first): a
  `lossless`/`exact` request that cannot hold is refused there, before any engine process starts, and
  `auto` logs why it keeps vLLM's own cache.
- `get_attn_backend_cls` runs for every attention layer in the worker: eligible decoder layers get GLYD.
  vLLM's CPU platform ignores `--attention-backend`, so wrapping the selector is the only way in. Its
  results are cached per selector config, so the decision depends only on process-constant settings.
"""

from __future__ import annotations

from typing import Any

from glyd_engine.errors import RefusedError
from glyd_engine.vllm_plugin import settings

BACKEND_PATH = "glyd_engine.vllm_plugin.backend.GlydAttentionBackend"  # torch path (CPU build)
GPU_BACKEND_PATH = "glyd_engine.vllm_plugin.gpu_backend.GlydGPUAttentionBackend"  # CUDA kernels (or their reference)


_MARK = "_glyd_wrapped"
ORIGINAL = "_glyd_original"  # on a wrapper: the class attribute it replaced (tests unwrap with it)


def backend_path(decision: settings.Decision) -> str:
    return BACKEND_PATH if decision.kernels == "torch" else GPU_BACKEND_PATH


def layer_refusal(sel: Any, backend: type | None = None) -> str | None:
    """Why one attention layer (vLLM's AttentionSelectorConfig) cannot use GLYD's `backend` (None: the CPU
    build's); None if it can. Derived from what the backend declares (capabilities.py)."""
    from glyd_engine.vllm_plugin import capabilities, page_facts

    return capabilities.layer_refusal(backend or page_facts.facts_for("torch"), sel)


def _wrap_selector(platform_cls: type) -> None:
    import inspect

    raw = inspect.getattr_static(platform_cls, "get_attn_backend_cls")
    original = platform_cls.get_attn_backend_cls  # bound to the class

    def get_attn_backend_cls(cls: type, selected_backend: Any, attn_selector_config: Any,
                             num_heads: int | None = None) -> str:
        from vllm.config import get_current_vllm_config_or_none
        from vllm.v1.attention.backend import AttentionType

        cfg = get_current_vllm_config_or_none()
        if cfg is None or getattr(attn_selector_config, "attn_type", None) != AttentionType.DECODER:
            return original(selected_backend, attn_selector_config, num_heads)
        decision = settings.decide(cfg)
        settings.log_decision(decision)
        if decision.active:
            from glyd_engine.vllm_plugin.page_facts import facts_for

            why = layer_refusal(attn_selector_config, facts_for(decision.kernels))
            if why is None:
                return backend_path(decision)
            raise RefusedError(f"Glyd KV cache (kv={decision.asked}) cannot hold this model: it has {why}",
                               settings.OFF_HINT)
        return original(selected_backend, attn_selector_config, num_heads)

    setattr(get_attn_backend_cls, _MARK, True)
    setattr(get_attn_backend_cls, ORIGINAL, raw)
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _wrap_config_check(platform_cls: type) -> None:
    import inspect

    raw = inspect.getattr_static(platform_cls, "check_and_update_config")
    original = platform_cls.check_and_update_config

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        original(vllm_config)
        if getattr(vllm_config, "model_config", None) is None:
            return
        from glyd_engine.vllm_plugin import weights

        weights.check(vllm_config)  # --quantization glyd on a model that is not a Glyd checkpoint, etc.
        decision = settings.decide(vllm_config)  # raises for lossless/exact where it cannot hold
        settings.log_decision(decision)
        if decision.active:
            from glyd_engine.vllm_plugin import scheduler

            why = scheduler.install(vllm_config)
            if why is not None:
                settings.log.info("Glyd KV cache: a request whose values find no overflow room stops the engine "
                                  "with an error instead of being refused alone: %s", why)

    setattr(check_and_update_config, _MARK, True)
    setattr(check_and_update_config, ORIGINAL, raw)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def install(platform_cls: type) -> bool:
    """Wrap the platform's hooks once a process; False when they were wrapped already."""
    if getattr(platform_cls.get_attn_backend_cls, _MARK, False):
        return False
    _wrap_selector(platform_cls)
    install_config_check(platform_cls)
    return True


def install_config_check(platform_cls: type) -> None:
    """Wrap only the config check (once): where vLLM lacks a hook, it still refuses lossless/exact asked
    through either setting, and the decision it caches says why the cache stays vLLM's own."""
    if not getattr(platform_cls.check_and_update_config, _MARK, False):
        _wrap_config_check(platform_cls)
