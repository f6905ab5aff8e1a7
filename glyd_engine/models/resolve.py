"""What a model spec ("demo", a local directory, a Hugging Face id) names: its directory and its display name.

`resolve_model` builds or downloads what is missing; `resolve_local` never does, for code that runs where the
files must already be (the vLLM plugin inside a started engine).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from glyd_engine.errors import GlydError
from glyd_engine.format.model_dir import validate_model_dir
from glyd_engine.models.demo import DEMO_MODEL_ID, DEMO_NAME, demo_model_path, ensure_demo_model
from glyd_engine.models.hub import hub_model, local_hub_model
from glyd_engine.models.known import remember
from glyd_engine.progress import CancelToken, ProgressCallback, no_progress

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")


def resolve_model(id_or_dir: str, progress: ProgressCallback = no_progress,
                  cancel: CancelToken | None = None) -> Path:
    """A ready model directory for "demo", a local directory, or a Hugging Face id (fetched once)."""
    if id_or_dir == DEMO_MODEL_ID:
        return validate_model_dir(ensure_demo_model(progress, cancel))
    path = _existing_dir_or_hub_id(id_or_dir)
    if isinstance(path, Path):
        found = validate_model_dir(path)
        remember(found)  # `glyd models list` and the picker show models opened by path
        return found
    return hub_model(id_or_dir, progress, cancel)


def resolve_local(id_or_dir: str) -> Path:
    """`resolve_model` without building or downloading: a GlydError where the files are not here."""
    if id_or_dir == DEMO_MODEL_ID:
        return validate_model_dir(demo_model_path())
    path = _existing_dir_or_hub_id(id_or_dir)
    return validate_model_dir(path if isinstance(path, Path) else local_hub_model(id_or_dir))


def _existing_dir_or_hub_id(id_or_dir: str) -> Path | str:
    """The path where it exists, else the hub id it must then be (a GlydError if it is neither)."""
    path = Path(id_or_dir).expanduser()
    if path.exists():
        return path
    if _looks_like_path(id_or_dir):
        raise GlydError(f"model directory {path} does not exist")
    if not _HUB_ID.fullmatch(id_or_dir):
        raise GlydError(f"{id_or_dir!r} is neither a local directory nor a Hugging Face model id "
                        "(like HuggingFaceTB/SmolLM2-135M-Instruct), nor 'demo'")
    return id_or_dir


def looks_like_hub_id(text: str) -> bool:
    """org/name (or name) as the hub spells ids, and not a path."""
    return bool(_HUB_ID.fullmatch(text)) and not _looks_like_path(text)


def _looks_like_path(text: str) -> bool:
    return (os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text
            or text.count("/") > 1 or text.endswith("/"))


def display_name(spec: str, model_dir: Path | None = None) -> str:
    """What the app and the engine call a model: the demo by its name, any other by its directory."""
    if spec in ("", DEMO_MODEL_ID):
        return f"{DEMO_NAME} (demo)"
    return (Path(model_dir).name if model_dir is not None else "") or spec
