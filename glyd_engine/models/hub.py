"""Hugging Face models: downloaded once into the models directory, or found in the hub's own cache.

A download (`pull.py`) lands in a hidden, resumable directory and is renamed into place only when complete,
so a model directory that exists is whole. It is refused before any weight is fetched when the architecture
cannot run or the model does not fit this machine's memory.
"""

from __future__ import annotations

import os
from pathlib import Path

from glyd_engine.errors import GlydError
from glyd_engine.format.model_dir import validate_model_dir
from glyd_engine.models.pull import HUB_PATTERNS, hub_model_path, offline_error, plan_pull, pull
from glyd_engine.progress import CancelToken, PhaseTimer, ProgressCallback

__all__ = ["HUB_PATTERNS", "hub_model", "hub_model_path", "local_hub_model"]


def _hub_offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    if flag in {"1", "ON", "YES", "TRUE"}:
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def hub_model(repo_id: str, progress: ProgressCallback, cancel: CancelToken | None) -> Path:
    """The model's directory, downloaded on first use."""
    target = hub_model_path(repo_id)
    if target.is_dir():  # published by a rename, so present means complete
        return validate_model_dir(target)
    if _hub_offline():
        raise offline_error(repo_id, "HF_HUB_OFFLINE is set")
    PhaseTimer("download", f"looking up {repo_id}", None, progress, cancel)
    return pull(plan_pull(repo_id), progress, cancel)


def local_hub_model(repo_id: str) -> Path:
    """The model's files without the network: Glyd's own download, else the hub's cache (where vLLM, given
    the id, put them)."""
    target = hub_model_path(repo_id)
    if target.is_dir():
        return target
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # not cached, or no huggingface_hub: either way nothing local to use
        raise GlydError(f"{repo_id} has not been downloaded ({type(exc).__name__}: {exc})") from exc
