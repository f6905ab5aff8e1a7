"""Hugging Face models: downloaded once into the models directory, or found in the hub's own cache.

A download lands in a hidden, resumable directory and is renamed into place only when complete, so a
model directory that exists is whole.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

from glyd_engine import paths
from glyd_engine.errors import GlydError, OfflineError
from glyd_engine.format.model_dir import validate_model_dir
from glyd_engine.models.local import MARKER, build_lock, dir_size
from glyd_engine.progress import Cancelled, CancelToken, PhaseTimer, ProgressCallback

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
HUB_TIMEOUT_S = 10.0


def hub_model_path(repo_id: str) -> Path:
    return paths.models_dir() / repo_id.replace("/", "--")


def _hub_offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    if flag in {"1", "ON", "YES", "TRUE"}:
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _offline_error(repo_id: str, why: str) -> OfflineError:
    return OfflineError(
        f"cannot download {repo_id}: {why}. Glyd is offline; download the model elsewhere and pass its "
        "directory (with config.json and *.safetensors) instead of the id, or use 'demo'.")


def hub_model(repo_id: str, progress: ProgressCallback, cancel: CancelToken | None) -> Path:
    """The model's directory, downloaded on first use."""
    target = hub_model_path(repo_id)
    if target.is_dir():  # published by a rename, so present means complete
        return validate_model_dir(target)
    if _hub_offline():
        raise _offline_error(repo_id, "HF_HUB_OFFLINE is set")
    with build_lock(target):
        if target.is_dir():
            return validate_model_dir(target)
        return _download(repo_id, target, progress, cancel)


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


def _download(repo_id: str, target: Path, progress: ProgressCallback, cancel: CancelToken | None) -> Path:
    """Download into a hidden, resumable directory, then rename it into place once complete."""
    import fnmatch

    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    timer = PhaseTimer("download", f"looking up {repo_id}", None, progress, cancel)
    try:
        info = HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S, files_metadata=True)
    except GatedRepoError as exc:
        raise GlydError(f"{repo_id} is gated: accept its license on huggingface.co and log in "
                        "(hf auth login), then retry") from exc
    except RepositoryNotFoundError as exc:
        raise GlydError(f"no model named {repo_id} on the Hugging Face hub (or it is private)") from exc
    except HfHubHTTPError as exc:
        raise GlydError(f"the Hugging Face hub refused {repo_id}: {exc}") from exc
    except Exception as exc:  # connection, DNS, TLS, timeout: the hub is out of reach
        raise _offline_error(repo_id, f"the Hugging Face hub is unreachable ({type(exc).__name__})") from exc
    wanted = [s for s in info.siblings or []
              if any(fnmatch.fnmatch(s.rfilename, p) for p in HUB_PATTERNS) and "/" not in s.rfilename]
    if not any(s.rfilename.endswith(".safetensors") for s in wanted):
        raise GlydError(f"{repo_id} has no safetensors weights; Glyd reads only safetensors checkpoints")
    total = sum(s.size or 0 for s in wanted) or None
    partial = target.with_name(f".{target.name}.partial")
    timer = PhaseTimer("download", f"downloading {repo_id}", total, progress, cancel)
    result: dict[str, BaseException] = {}

    def work() -> None:
        try:
            snapshot_download(repo_id, revision=info.sha, local_dir=partial, allow_patterns=HUB_PATTERNS,
                              etag_timeout=HUB_TIMEOUT_S, tqdm_class=_silent_tqdm(cancel))
        except BaseException as exc:  # re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, name=f"glyd-download-{repo_id}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        timer.update(dir_size(partial) if partial.exists() else 0)
    error = result.get("error")
    if error is not None:
        if isinstance(error, HfHubHTTPError):
            raise GlydError(f"downloading {repo_id} failed: {error}") from error
        if isinstance(error, (GlydError, Cancelled, KeyboardInterrupt)):
            raise error
        raise _offline_error(repo_id, f"the download broke off ({type(error).__name__}: {error}); "
                                      "rerun to resume") from error
    marker = {"kind": "downloaded", "repo_id": repo_id, "revision": info.sha, "files": len(wanted)}
    (partial / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(partial / ".cache", ignore_errors=True)
    validate_model_dir(partial)
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)
    timer.update(total or 1, f"downloaded {repo_id}")
    return target


def _silent_tqdm(cancel: CancelToken | None) -> type:
    """hub's progress bars, muted (we report bytes ourselves) and turned into cancellation points."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Silent(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if cancel is not None:
                cancel.check()
            return super().update(n)

    return Silent
