"""Whether a model's config.json describes something glyd-chat can run, decided before any weight is fetched.

A model must be a text-generation architecture in the installed vLLM's model registry (read from vLLM's source
with `ast`, so neither vLLM nor torch is imported: the app asks this too) and a decoder with standard attention
(the fields Glyd's KV tables read, `model_shape.AttentionShape`). What does not stop a model from running but
changes how it runs (fp32 weights rounded to bf16, a KV cache that Glyd's pages cannot hold) comes back as notes.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from glyd_engine.errors import UnsupportedModelError
from glyd_engine.model_shape import AttentionShape

TEXT_REGISTRY = "_TEXT_GENERATION_MODELS"
MULTIMODAL_REGISTRY = "_MULTIMODAL_MODELS"
PAGE_HEAD_SIZES = (64, 128)  # format.kv_page.HEAD_SIZES, which imports torch (tests/test_models.py checks they agree)


@dataclass(frozen=True)
class Support:
    """The verdict on one config.json: `refusal` is why it cannot run (None: it can); `notes` what to know."""

    architecture: str
    refusal: str | None
    notes: tuple[str, ...] = ()


@functools.cache
def vllm_registry(name: str = TEXT_REGISTRY) -> frozenset[str] | None:
    """Architecture names in one of the installed vLLM's registries; None where vLLM is not installed here
    (an app-only install: the engine then decides at load time)."""
    spec = importlib.util.find_spec("vllm")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models" / "registry.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):  # type: ignore[union-attr]
            keys = node.value.keys  # type: ignore[union-attr]
            return frozenset(k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None


def check_config(config: dict, architectures: frozenset[str] | None = None) -> Support:
    """Refuse what cannot run (why, in words), note what runs differently. `architectures`: the accepted
    names (default: the installed vLLM's text-generation registry, when there is one)."""
    names = config.get("architectures") or []
    arch = str(names[0]) if isinstance(names, list) and names else ""
    if not arch:
        return Support("", "its config.json names no architecture, so no engine knows how to run it")
    known = architectures if architectures is not None else vllm_registry(TEXT_REGISTRY)
    notes: list[str] = []
    if known is None:
        notes.append("vLLM is not installed here, so its list of architectures was not checked")
    elif arch not in known:
        if arch in (vllm_registry(MULTIMODAL_REGISTRY) or frozenset()):
            why = f"{arch} is a multimodal architecture; glyd-chat runs text-generation models only"
        else:
            why = f"{arch} is not a text-generation architecture vLLM runs (it knows {len(known)} of them)"
        return Support(arch, why)
    try:
        shape = AttentionShape.from_config(config)
    except UnsupportedModelError as exc:
        return Support(arch, str(exc))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    if dtype in ("float32", "float16"):
        notes.append(f"its weights are {dtype}: they run as bf16, rounded on load")
    text = config.get("text_config", config)
    if shape.head_size not in PAGE_HEAD_SIZES or text.get("sliding_window") or text.get("kv_lora_rank"):
        notes.append("Glyd's KV pages cannot hold its cache (head size, sliding window or MLA): it runs on "
                     "vLLM's own cache")
    return Support(arch, None, tuple(notes))
