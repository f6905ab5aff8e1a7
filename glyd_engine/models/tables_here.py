"""Which KV tables this machine holds, read without torch: what the app needs to say what a switch to Glyd's
KV pages costs here (a build once, or none) before it restarts the engine. The tables' file name is decided
here, once (`glyd_engine.tables.build` writes there); their build time is in the file's metadata.
"""

from __future__ import annotations

from pathlib import Path

from glyd_engine import paths
from glyd_engine.errors import GlydError
from glyd_engine.format.fingerprint import model_fingerprint
from glyd_engine.format.safetensors_header import read_safetensors_header


def tables_file(fingerprint: str) -> Path:
    return paths.kv_tables_dir() / f"{fingerprint}.safetensors"


def build_seconds(path: Path) -> float | None:
    """The build time a tables file records (None: unreadable, or not a tables file)."""
    try:
        header, _ = read_safetensors_header(path)
        return float(header["__metadata__"]["build_seconds"])
    except (OSError, GlydError, KeyError, TypeError, ValueError):
        return None


def model_tables_seconds(model_dir: Path) -> float | None:
    """How long this model's tables took to build here, where they are built (None: not built here)."""
    try:
        path = tables_file(model_fingerprint(Path(model_dir)))
    except (OSError, GlydError):
        return None
    return build_seconds(path) if path.is_file() else None


def last_build_seconds() -> float | None:
    """The build time of the newest tables on this machine, for any model (None: none built)."""
    root = paths.kv_tables_dir()
    files = sorted(root.glob("*.safetensors"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    for path in reversed(files):
        seconds = build_seconds(path)
        if seconds is not None:
            return seconds
    return None
