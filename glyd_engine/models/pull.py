"""Pulling a model from the Hugging Face hub: look first (size, architecture, memory), then download, resumably.

`plan_pull` asks the hub for the file list and reads config.json (a few KiB) and says what the download is:
its files and size, whether the architecture can run and whether it fits this machine, before a weight is
fetched. `pull` downloads the plan's files into a hidden `.NAME.partial` directory, each file resumable
(`ranged_download`), and renames the directory into the models directory once every file is there and
checked. Routes used: GET /api/models/{id}[/revision/{rev}]?blobs=true (model_info with sizes and hashes),
GET /{id}/resolve/{sha}/{file} (with Range to resume). `HF_ENDPOINT` points them elsewhere.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from glyd_engine import paths
from glyd_engine.atomic import atomic_write_bytes
from glyd_engine.errors import OOM, GlydError, OfflineError, UnsupportedModelError
from glyd_engine.format.model_dir import validate_model_dir
from glyd_engine.models.fit import Fit, MemoryProbe, estimate_fit, gib
from glyd_engine.models.local import MARKER, build_lock
from glyd_engine.models.ranged_download import HubFile, fetch_file
from glyd_engine.models.support import check_config
from glyd_engine.progress import Cancelled, CancelToken, PhaseTimer, ProgressCallback, ProgressEvent, no_progress

# Cancelled, CancelToken and ProgressEvent are re-exported: the app's download screen drives a pull with them
__all__ = ["Cancelled", "CancelToken", "ModelTooLargeError", "ProgressEvent", "PullPlan", "hub_model_path",
           "offline_error", "plan_pull", "pull"]

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
HUB_TIMEOUT_S = 10.0
CONFIG_LIMIT = 1 << 20
PROGRESS_EVERY_S = 0.25


class ModelTooLargeError(GlydError):
    """The model would not fit this machine's memory; refused before downloading it."""

    kind = OOM


@dataclass(frozen=True)
class PullPlan:
    """What pulling `repo_id` means here: the files, their size, and whether the model can run."""

    repo_id: str
    revision: str
    files: tuple[HubFile, ...]
    architecture: str
    fit: Fit
    refusal: str | None  # why it is refused (unsupported architecture, no safetensors); None: it can run
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def target(self) -> Path:
        return hub_model_path(self.repo_id)

    def summary(self) -> str:
        """One line: what it is, how big, whether it fits."""
        arch = f"{self.architecture}, " if self.architecture else ""
        return f"{self.repo_id}: {arch}{gib(self.total_bytes)} in {len(self.files)} files; {self.fit.describe()}"

    def check(self, ignore_memory: bool = False) -> None:
        """Raise the refusal, if any: an unsupported model, or (unless ignored) one that does not fit."""
        if self.refusal:
            raise UnsupportedModelError(f"{self.repo_id} is not supported: {self.refusal}")
        if not ignore_memory and not self.fit.fits:
            raise ModelTooLargeError(f"{self.repo_id} does not fit this machine: it {self.fit.describe()}. "
                                     "Pick a smaller model (or pull it anyway with --ignore-memory)")


def hub_model_path(repo_id: str) -> Path:
    return paths.models_dir() / repo_id.replace("/", "--")


def hub_endpoint() -> str:
    """HF_ENDPOINT as set now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline_error(repo_id: str, why: str) -> OfflineError:
    return OfflineError(
        f"cannot download {repo_id}: {why}. Glyd is offline; download the model elsewhere and pass its "
        "directory (with config.json and *.safetensors) instead of the id, or use 'demo'.")


def plan_pull(repo_id: str, probe: MemoryProbe | None = None,
              architectures: frozenset[str] | None = None) -> PullPlan:
    """Ask the hub what `repo_id` is (files, sizes, config.json) and judge it; downloads no weights.
    `probe`: what memory is free (default `fit.machine_memory`); `architectures`: those accepted (default:
    the installed vLLM's text-generation registry)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    from glyd_engine.models import fit

    try:
        info = HfApi(endpoint=hub_endpoint()).model_info(repo_id, timeout=HUB_TIMEOUT_S, files_metadata=True)
        if not info.sha:
            raise GlydError(f"the hub gave no revision for {repo_id}")
        config = _get_json(repo_id, info.sha, "config.json")
    except GatedRepoError as exc:
        raise GlydError(f"{repo_id} is gated: accept its license on huggingface.co and log in "
                        "(hf auth login), then retry") from exc
    except RepositoryNotFoundError as exc:
        raise GlydError(f"no model named {repo_id} on the Hugging Face hub (or it is private)") from exc
    except HfHubHTTPError as exc:
        raise GlydError(f"the Hugging Face hub refused {repo_id}: {exc}") from exc
    except GlydError:
        raise
    except Exception as exc:  # connection, DNS, TLS, timeout: the hub is out of reach
        raise offline_error(repo_id, f"the Hugging Face hub is unreachable ({type(exc).__name__})") from exc
    files = tuple(
        HubFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0)), s.lfs.sha256 if s.lfs else None,
                None if s.lfs else s.blob_id)
        for s in info.siblings or []
        if "/" not in s.rfilename and any(fnmatch.fnmatch(s.rfilename, p) for p in HUB_PATTERNS))
    support = check_config(config, architectures)
    refusal = support.refusal
    if refusal is None and not any(f.name.endswith(".safetensors") for f in files):
        refusal = "it has no safetensors weights; Glyd reads only safetensors checkpoints"
    weights = sum(f.size for f in files if f.name.endswith(".safetensors"))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    memory = estimate_fit(weights, dtype, probe or fit.machine_memory)
    return PullPlan(repo_id, info.sha, files, support.architecture, memory, refusal, support.notes)


def _get_json(repo_id: str, revision: str, name: str) -> dict:
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    resp = get_session().get(_file_url(repo_id, revision, name), headers=build_hf_headers(),
                             follow_redirects=True, timeout=HUB_TIMEOUT_S)
    hf_raise_for_status(resp)
    if len(resp.content) > CONFIG_LIMIT:
        raise GlydError(f"{repo_id}'s {name} is over {CONFIG_LIMIT >> 20} MiB: not a model configuration")
    try:
        data = json.loads(resp.content)
    except ValueError as exc:
        raise UnsupportedModelError(f"{repo_id}'s {name} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{repo_id}'s {name} is not a JSON object")
    return data


def _file_url(repo_id: str, revision: str, name: str) -> str:
    from urllib.parse import quote

    return f"{hub_endpoint()}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(name)}"


def pull(plan: PullPlan, progress: ProgressCallback = no_progress, cancel: CancelToken | None = None,
         ignore_memory: bool = False) -> Path:
    """Download the plan's files (resuming what an earlier pull left) and publish the model directory."""
    plan.check(ignore_memory)
    target = plan.target
    if target.is_dir():  # published by a rename, so present means complete
        return validate_model_dir(target)
    with build_lock(target):
        if target.is_dir():
            return validate_model_dir(target)
        return _download(plan, target, progress, cancel)


def _download(plan: PullPlan, target: Path, progress: ProgressCallback, cancel: CancelToken | None) -> Path:
    from huggingface_hub.utils import build_hf_headers, get_session

    partial = target.with_name(f".{target.name}.partial")
    partial.mkdir(parents=True, exist_ok=True)
    done = [f for f in plan.files if (partial / f.name).is_file() and (partial / f.name).stat().st_size == f.size]
    have = sum(f.size for f in done) + sum(_part_size(partial / f.name) for f in plan.files if f not in done)
    resumed = " (resuming)" if have else ""
    timer = PhaseTimer("download", f"downloading {plan.repo_id}{resumed}", plan.total_bytes or None, progress,
                       cancel)
    got, last = [have], [0.0]
    if have:
        timer.update(have)

    def on_bytes(n: int) -> None:
        got[0] += n
        if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
            last[0] = time.monotonic()
            timer.update(got[0])

    session, headers = get_session(), build_hf_headers()
    for file in plan.files:
        if file in done:
            continue
        fetch_file(session, _file_url(plan.repo_id, plan.revision, file.name), headers, file,
                   partial / file.name, on_bytes, cancel)
    marker = {"kind": "downloaded", "repo_id": plan.repo_id, "revision": plan.revision, "files": len(plan.files)}
    atomic_write_bytes(partial / MARKER, (json.dumps(marker, indent=2) + "\n").encode())
    validate_model_dir(partial)
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)
    timer.update(plan.total_bytes or 1, f"downloaded {plan.repo_id}")
    return target


def _part_size(dest: Path) -> int:
    part = dest.with_name(dest.name + ".part")
    return part.stat().st_size if part.exists() else 0
