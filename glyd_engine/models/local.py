"""The models directory (GLYD_HOME's models/): what is listed there, the marker a finished model carries, and
the lock that keeps two processes from building one model at once.

A model there is assembled under a hidden name and renamed into place, so a visible directory is complete.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from glyd_engine import paths

MARKER = "glyd-model.json"  # written into a model Glyd built or downloaded: what it is and where it came from


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size_bytes: int
    kind: str  # "demo" | "downloaded" | "glyd-packed" | "local" (a directory opened by path)


def list_local_models() -> list[LocalModel]:
    """Finished model directories under models_dir() (hidden, in-progress ones skipped), then the directories
    elsewhere that Glyd opened or packed (glyd_engine.models.known), newest last."""
    from glyd_engine.models.known import known_dirs

    root = paths.models_dir().absolute()
    found = []
    if root.is_dir():
        for child in sorted(root.iterdir(), key=lambda p: p.name.lower()):
            if child.name.startswith(".") or not (child / "config.json").is_file():
                continue
            found.append(LocalModel(child.name, child, dir_size(child), _kind(child)))
    for path in known_dirs():
        found.append(LocalModel(path.name, path, dir_size(path), _kind(path, elsewhere=True)))
    return found


def _kind(path: Path, elsewhere: bool = False) -> str:
    config = read_json(path / "config.json") or {}
    quant = config.get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "glyd":
        return "glyd-packed"
    if elsewhere:
        return "local"
    marker = read_json(path / MARKER) or {}
    return "demo" if marker.get("kind") == "demo" else "downloaded"


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def read_json(path: Path) -> dict | None:
    """A JSON object from a file, or None where it is missing or not one (a listing never fails on it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Serialize builders of one target across processes (the app and the CLI may race)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename alone keeps readers safe
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
