"""What the plugin does for one engine: the KV mode asked for, and the mode that holds after the checks.

Every vLLM process (API server, engine core, workers) resolves the same decision from the same inputs
(`GLYD_KV`, `vllm_config.additional_config["glyd"]`, which wins, the model and parallel config, and the vLLM
hooks `register()` found missing), so nothing has to be passed between them. Within a process the decision
is made once for the engine's config and cached (`decide`): the config check, the backend selector, the
attention layers and the app's status all read that one decision. `lossless`/`exact` refuse what the page
code cannot hold, with a message that says why and what to do; `auto` keeps vLLM's own cache and logs why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from glyd_engine import kv_mode
from glyd_engine.kv_mode import PAGE_MODES, KVMode

# Under "vllm" so the lines go where vLLM's own log goes (its logger has the handler).
log = logging.getLogger("vllm.glyd")

ENV_CHECK = "GLYD_KV_CHECK"  # debug: keep a bf16 shadow of every page and compare each value read
ENV_KERNELS = "GLYD_KV_KERNELS"
# What runs the pages: torch (the CPU build: pages decoded, then vLLM's own CPU kernel), cuda (the GPU backend:
# the CUDA kernels in kernels/cuda read compressed pages), or reference (the GPU backend's wiring on the torch
# reference of those kernels: how the tests run it on the CPU build). auto: by platform.
KERNELS = ("auto", "torch", "cuda", "reference")
ENV_CODE = "GLYD_KV_CODE"
# The page code's width: 3 bits (the most tokens: ~11.3 bits a value) or 4 (~12.1 bits, about a tenth of the
# escapes, which decode attention pays for). auto: 3 on the CPU build; GPU_CODE_BITS where the CUDA kernels run,
# the faster of the two on the H200 (docs/gpu.md).
CODES = ("auto", "3", "4")
GPU_CODE_BITS = 4
SUPPORTED_VLLM = ">=0.32,<0.34"
ENV_WEIGHT_LAYOUT = "GLYD_WEIGHT_LAYOUT"
# How `--quantization glyd` holds a weight in memory: resident (row-major; torch decode on the CPU, the Triton
# kernels on CUDA) or fragment (the CUDA matmul's layout, docs/format.md section 4.1; on the CPU its torch
# reference, which is how the tests run it in the real engine). auto: fragment on CUDA where the weight's shape
# allows it and the CUDA matmul builds, resident elsewhere.
WEIGHT_LAYOUTS = ("auto", "resident", "fragment")
ENV_WEIGHTS = "GLYD_WEIGHTS"
# What a Glyd checkpoint's matmuls compute: lossless (auto; the weights decoded inside the CUDA matmul for small
# batches: every weight exact, the products summed in the kernel's order, so outputs may differ from the bf16
# model's in the last bits) or exact (each weight decoded to bf16 and multiplied by the bf16 model's own GEMM: its
# outputs bit for bit, slower). On the CPU build both decode and run vLLM's GEMM: exact either way.
WEIGHT_MODES = ("auto", "lossless", "exact")

# Platforms where the lossless cache is measured at least as fast as vLLM's own (docs/vllm.md, "auto").
# The CPU path decodes pages in plain torch and is slower than vLLM's C++ kernel: not listed.
AUTO_FAST_PLATFORMS: frozenset[str] = frozenset()

OFF_HINT = "run with GLYD_KV=off (or --additional-config '{\"glyd\": {\"kv\": \"off\"}}') to use vLLM's own cache"


@dataclass(frozen=True)
class Decision:
    asked: KVMode  # the mode the user set (auto when unset)
    mode: KVMode  # lossless | exact | off: what runs
    reason: str = ""  # why `auto` kept vLLM's own cache
    kernels: str = ""  # torch | cuda | reference: what runs the pages (active modes)

    @property
    def active(self) -> bool:
        return self.mode in PAGE_MODES


def glyd_section(vllm_config: Any) -> dict[str, Any]:
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get(kv_mode.SECTION), dict):
        return extra[kv_mode.SECTION]
    return {}


def _choice(vllm_config: Any, key: str, env: str, choices: tuple[str, ...], what: str) -> str:
    """A plugin setting by the KV mode's precedence (kv_mode.choose): the engine's own setting wins."""
    return kv_mode.choose(glyd_section(vllm_config), key, env, choices, what)


def asked_mode(vllm_config: Any = None) -> KVMode:
    """The KV mode asked for an engine (None: before any engine config, from GLYD_KV alone)."""
    return kv_mode.asked(glyd_section(vllm_config))


def weights_mode(vllm_config: Any = None) -> str:
    """lossless or exact: how this engine's Glyd matmuls run (GLYD_WEIGHTS, or additional_config glyd.weights)."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    asked = _choice(vllm_config, "weights", ENV_WEIGHTS, WEIGHT_MODES, "Glyd weights mode")
    return "lossless" if asked == "auto" else asked


def check_enabled(vllm_config: Any = None) -> bool:
    value = glyd_section(vllm_config).get("check") if vllm_config is not None else None
    if value is None:
        value = os.environ.get(ENV_CHECK, "")
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def asked_kernels(vllm_config: Any = None) -> str:
    return _choice(vllm_config, "kernels", ENV_KERNELS, KERNELS, "Glyd kernel choice")


def kernels(vllm_config: Any = None) -> str:
    """torch, cuda or reference: what runs the pages on this platform (auto: cuda on CUDA, torch on the CPU)."""
    asked = asked_kernels(vllm_config)
    if asked != "auto":
        return asked
    return "cuda" if platform_name() == "cuda" else "torch"


def code_bits(vllm_config: Any = None) -> int:
    """3 or 4: the page code's width for this engine (every process decides the same from the same inputs)."""
    asked = _choice(vllm_config, "code", ENV_CODE, CODES, "Glyd KV code width")
    if asked != "auto":
        return int(asked)
    return 3 if kernels(vllm_config) == "torch" else GPU_CODE_BITS


def _platform_refusal(vllm_config: Any, mode: str) -> str | None:
    plat = platform_name()
    if plat not in ("cpu", "cuda"):
        return f"the lossless cache runs on vLLM's CPU build and on NVIDIA GPUs (CUDA), not on {plat}"
    use = kernels(vllm_config)
    if plat == "cuda" and use == "torch":
        return f"{ENV_KERNELS}=torch is the CPU build's path; on CUDA the CUDA kernels run (unset it)"
    if plat == "cpu" and use == "cuda":
        return f"{ENV_KERNELS}=cuda needs an NVIDIA GPU; on the CPU build unset {ENV_KERNELS}"
    if mode == "exact" and use == "reference":
        return ("exact runs vLLM's own attention on decoded pages: on the CPU build its torch path "
                f"(unset {ENV_KERNELS}), on CUDA its FlashAttention; use lossless (every stored value is still exact)")
    return None


def unsupported(vllm_config: Any, mode: str = "lossless") -> list[str]:
    """Why the lossless cache cannot hold this engine's KV (empty: it can). Each item says what to change."""
    why: list[str] = []
    refusal = _platform_refusal(vllm_config, mode)
    if refusal:
        why.append(refusal)
    par = getattr(vllm_config, "parallel_config", None)
    if par is not None:
        for attr, name in (("tensor_parallel_size", "tensor"), ("pipeline_parallel_size", "pipeline"),
                           ("prefill_context_parallel_size", "prefill context"),
                           ("decode_context_parallel_size", "decode context")):
            if int(getattr(par, attr, 1) or 1) > 1:
                why.append(f"{name} parallel size {getattr(par, attr)} > 1 (run on one device)")
        if getattr(par, "enable_dbo", False) or int(getattr(par, "ubatch_size", 1) or 1) > 1:
            # the GPU page writer's overflow room is reserved once a step, for one batch
            why.append("micro-batching is on (drop --enable-dbo / --ubatch-size)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        why.append("speculative decoding is on (drop --speculative-config)")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        why.append("a KV transfer/connector is configured (connectors copy raw pages and cannot see overflow)")
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None:
        if str(getattr(cache, "cache_dtype", "auto")) not in ("auto", "bfloat16"):
            why.append(f"kv_cache_dtype is {cache.cache_dtype} (the page code holds bf16 values; use auto)")
        if getattr(cache, "kv_offloading_size", None):
            why.append("KV offloading is on (offload copies raw pages and cannot see overflow)")
    model = getattr(vllm_config, "model_config", None)
    if model is not None:
        import torch

        if getattr(model, "dtype", torch.bfloat16) != torch.bfloat16:
            why.append(f"the model runs in {model.dtype} (the page code is for bf16; use --dtype bfloat16)")
        if _flag(model, "use_mla"):
            why.append("the model uses MLA attention")
        if _flag(model, "is_hybrid") or _flag(model, "is_attention_free"):
            why.append("the model is hybrid or attention-free (mamba/linear-attention state)")
        hf = getattr(model, "hf_text_config", None)
        window = getattr(hf, "sliding_window", None)
        layer_types = list(getattr(hf, "layer_types", None) or [])
        if (window and getattr(hf, "use_sliding_window", True) is not False) or any(
                "sliding" in str(t) for t in layer_types):
            why.append("the model has sliding-window attention layers")
        if getattr(hf, "attention_chunk_size", None):
            why.append("the model has chunked local attention layers")
    return why


def _flag(obj: Any, name: str) -> bool:
    try:
        return bool(getattr(obj, name, False))
    except Exception:  # some model-config properties need registry lookups that may fail for odd models
        return False


def platform_name() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_name", "unknown"))


class UnsupportedVLLMError(ValueError):
    """vLLM lacks a hook the plugin needs (a version outside the supported range)."""


_missing_hooks: list[str] = []  # why this process's vLLM cannot hold Glyd pages (register() records it)


def set_missing_hooks(missing: list[str], vllm_version: str) -> None:
    """register(): what this vLLM lacks. No engine of this process can then hold Glyd pages."""
    _missing_hooks[:] = [f"this is vLLM {vllm_version}, which lacks {', '.join(missing)}; the Glyd plugin "
                         f"supports vLLM {SUPPORTED_VLLM}"] if missing else []


def missing_hooks() -> str:
    """Why this vLLM cannot hold Glyd pages ('' when it can)."""
    return "; ".join(_missing_hooks)


_decided: tuple[Any, Decision] | None = None  # (the engine config it was made for, the decision)


def decided_config() -> Any:
    """The engine config this process decided for (None before its first decision): for hooks vLLM calls with
    no current config (customize_spec, when the worker sizes pages), so they read the same settings."""
    return _decided[0] if _decided is not None else None


def decide(vllm_config: Any) -> Decision:
    """This process's decision for its engine (one engine a process): made once from both settings, then the
    same object for every caller that passes the same config. Raises ValueError for lossless/exact where it
    cannot hold."""
    global _decided
    if _decided is not None and _decided[0] is vllm_config:
        return _decided[1]
    d = resolve(vllm_config)
    _decided = (vllm_config, d)
    return d


def resolve(vllm_config: Any) -> Decision:
    """The mode that runs for an engine config, worked out afresh (`decide` caches it)."""
    asked = asked_mode(vllm_config)
    if asked == "off":
        return Decision(asked, "off")
    if _missing_hooks:
        if asked in PAGE_MODES:
            raise UnsupportedVLLMError(f"Glyd KV cache (kv={asked}) cannot run: {missing_hooks()}. Install a "
                                       f"supported vLLM, or {OFF_HINT}.")
        return Decision(asked, "off", missing_hooks())
    why = unsupported(vllm_config, asked)
    if asked in PAGE_MODES:
        if why:
            raise ValueError(f"Glyd KV cache (kv={asked}) cannot run this engine: " + "; ".join(why)
                             + f". Change that, or {OFF_HINT}.")
        return Decision(asked, asked, kernels=kernels(vllm_config))
    if why:
        return Decision(asked, "off", "; ".join(why))
    if not auto_holds_pages():
        return Decision(asked, "off", f"the lossless cache is not measured as fast as vLLM's own on "
                                      f"{platform_name()} (set {kv_mode.ENV}=lossless to hold ~1.4x the tokens "
                                      f"anyway)")
    return Decision(asked, "lossless", kernels=kernels(vllm_config))


def auto_holds_pages() -> bool:
    """Whether `auto` runs Glyd's pages on this platform, where the engine allows them (one rule for
    `resolve` and `holds_pages`)."""
    return platform_name() in AUTO_FAST_PLATFORMS


_logged: set[tuple[str, str]] = set()


def log_decision(d: Decision) -> None:
    """One line a process: what runs and, for auto, why vLLM's own cache was kept."""
    key = (d.mode, d.reason)
    if key in _logged:
        return
    _logged.add(key)
    if d.active:
        log.info("Glyd KV cache: %s (lossless pages, every value exact; %s kernels)", d.mode, d.kernels)
    elif d.asked == "auto":
        log.info("Glyd KV cache: auto keeps vLLM's own KV cache: %s", d.reason)


def holds_pages(asked: str) -> bool:
    """Whether a mode will run Glyd's pages on this platform, before any engine config exists (so before
    `decide`): the engine runner uses it to build the KV tables (with progress) only when they will be used;
    `resolve` then decides with the same rule and the engine's checks."""
    if asked == "off":
        return False
    return asked in PAGE_MODES or auto_holds_pages()
