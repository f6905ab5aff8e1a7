"""What the plugin does for one engine: the KV mode asked for, and the mode that holds after the checks.

Every vLLM process (API server, engine core, workers) resolves the same decision from the same inputs
(`GLYD_KV`, `vllm_config.additional_config["glyd"]`, which wins, the model and parallel config, and the vLLM
hooks `register()` found missing), so nothing has to be passed between them. Within a process the decision
is made once for the engine's config and cached (`decide`): the config check, the backend selector, the
attention layers and the app's status all read that one decision. `lossless`/`exact` refuse what the page
code cannot hold, with a RefusedError that says why and what to do; `auto` keeps vLLM's own cache and logs why.
Every Glyd setting of the engine is parsed at one edge (`options`, from options.py's declarations); what the
backends can hold is declared on them and the refusals derived from it (capabilities.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, cast

from glyd_engine import kv_mode
from glyd_engine import options as opt
from glyd_engine.errors import RefusedError, SettingError
from glyd_engine.kv_mode import PAGE_MODES, KVMode

# Under "vllm" so the lines go where vLLM's own log goes (its logger has the handler).
log = logging.getLogger("vllm.glyd")

ENV_CHECK, ENV_KERNELS, ENV_CODE = opt.CHECK.env, opt.KERNELS.env, opt.CODE.env
ENV_WEIGHTS, ENV_WEIGHT_LAYOUT = opt.WEIGHTS.env, opt.WEIGHT_LAYOUT.env
GPU_CODE_BITS = 4  # the page code's width where the CUDA kernels run: the faster of the two on the H200 (docs/gpu.md)
SUPPORTED_VLLM = ">=0.32,<0.34"

# Platforms where the lossless cache is measured at least as fast as vLLM's own (docs/vllm.md, "auto").
# The CPU path decodes pages in plain torch and is slower than vLLM's C++ kernel: not listed.
AUTO_FAST_PLATFORMS: frozenset[str] = frozenset()

OFF_HINT = "run with GLYD_KV=off (or --additional-config '{\"glyd\": {\"kv\": \"off\"}}') to use vLLM's own cache"


@dataclass(frozen=True)
class Options:
    """Every Glyd setting of one engine, parsed (options.py declares them): what the rest of the plugin reads."""

    kv: KVMode = "auto"
    kernels: Literal["auto", "torch", "cuda", "reference"] = "auto"
    code: Literal["auto", "3", "4"] = "auto"
    check: bool = False
    weights: Literal["auto", "lossless", "exact"] = "auto"
    weight_layout: Literal["auto", "resident", "fragment"] = "auto"
    arena_mb: float | None = None  # a layer's overflow arena limit (None: the device's memory)


SETTINGS: tuple[opt.Choice, ...] = (kv_mode.SETTING, *opt.PLUGIN)


def options(vllm_config: Any = None, environ: dict[str, str] | None = None) -> Options:
    """The engine's Glyd settings from its additional_config["glyd"] (which wins) and the environment, parsed at
    this one edge: a bad value, an unknown key or a section that is not a table is a SettingError naming it."""
    section = glyd_section(vllm_config)
    known = {s.key for s in SETTINGS}
    for key in section:
        if key not in known:
            raise SettingError(f"additional_config {opt.SECTION}.{key} is not a Glyd setting",
                               f"use {', '.join(sorted(known))}")
    v = {s.key: s.read(section, environ) for s in SETTINGS}
    return Options(kv=cast(KVMode, v["kv"]), kernels=cast(Any, v["kernels"]), code=cast(Any, v["code"]),
                   check=opt.is_on(v["check"]), weights=cast(Any, v["weights"]),
                   weight_layout=cast(Any, v["weight_layout"]),
                   arena_mb=None if v["arena_mb"] == "auto" else float(v["arena_mb"]))


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
    if not isinstance(extra, dict) or extra.get(opt.SECTION) is None:
        return {}
    section = extra[opt.SECTION]
    if not isinstance(section, dict):
        raise SettingError(f"additional_config {opt.SECTION}={section!r} is not a table of Glyd settings",
                           f'give it as {{"{opt.SECTION}": {{"kv": "lossless"}}}}')
    return section


def asked_mode(vllm_config: Any = None) -> KVMode:
    """The KV mode asked for an engine (None: before any engine config, from GLYD_KV alone)."""
    return options(vllm_config).kv


def weights_mode(vllm_config: Any = None) -> str:
    """lossless or exact: how this engine's Glyd matmuls run (GLYD_WEIGHTS, or additional_config glyd.weights)."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    asked = options(vllm_config).weights
    return "lossless" if asked == "auto" else asked


def check_enabled(vllm_config: Any = None) -> bool:
    return options(vllm_config).check


def arena_limit_entries(vllm_config: Any = None) -> int | None:
    """A layer's overflow arena limit in int16 entries (None: no limit but the device's memory)."""
    mb = options(vllm_config).arena_mb
    return None if mb is None else max(1, int(mb * 1_000_000 / 2))


def asked_kernels(vllm_config: Any = None) -> str:
    return options(vllm_config).kernels


def kernels(vllm_config: Any = None) -> str:
    """torch, cuda or reference: what runs the pages on this platform (auto: cuda on CUDA, torch on the CPU)."""
    asked = asked_kernels(vllm_config)
    if asked != "auto":
        return asked
    return "cuda" if platform_name() == "cuda" else "torch"


def code_bits(vllm_config: Any = None) -> int:
    """3 or 4: the page code's width for this engine (every process decides the same from the same inputs)."""
    asked = options(vllm_config).code
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
    """Why the lossless cache cannot hold this engine's KV (empty: it can). Each item says what to change: the
    platform's rule, then what the backend that would run declares it does not support (capabilities.py)."""
    from glyd_engine.vllm_plugin import capabilities, page_facts

    refusal = _platform_refusal(vllm_config, mode)
    use = kernels(vllm_config)
    backend = page_facts.facts_for("torch" if use == "torch" and platform_name() == "cpu" else "cuda")
    return ([refusal] if refusal else []) + capabilities.engine_refusals(backend, vllm_config)


def platform_name() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_name", "unknown"))


class UnsupportedVLLMError(RefusedError):
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
    same object for every caller that passes the same config. Raises RefusedError for lossless/exact where it
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
            raise UnsupportedVLLMError(f"Glyd KV cache (kv={asked}) cannot run: {missing_hooks()}",
                                       f"install a supported vLLM, or {OFF_HINT}")
        return Decision(asked, "off", missing_hooks())
    why = unsupported(vllm_config, asked)
    if asked in PAGE_MODES:
        if why:
            raise RefusedError(f"Glyd KV cache (kv={asked}) cannot run this engine: " + "; ".join(why),
                               f"change that, or {OFF_HINT}")
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
