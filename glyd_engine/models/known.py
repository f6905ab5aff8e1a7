"""Model directories outside Glyd's models directory that Glyd has used: ones opened by path (glyd-chat DIR,
glyd serve DIR, glyd pack DIR ...) and Glyd checkpoints `glyd pack` wrote. `glyd models list` and the app's
picker list them beside the models directory, which holds only what Glyd built or downloaded.

Kept as a JSON list of absolute paths in the data dir (`known-models.json`), newest last. Remembering is
best effort: a read-only home never stops a model from loading. A path that no longer holds a model is
left out of listings (and dropped at the next write).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from glyd_engine import paths
from glyd_engine.atomic import atomic_write_bytes

FILE = "known-models.json"
KEEP = 200  # the newest paths kept


def known_file() -> Path:
    return paths.data_dir() / FILE


def known_dirs() -> list[Path]:
    """The remembered directories that still hold a model (config.json), oldest first."""
    try:
        data = json.loads(known_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    found = [Path(p) for p in data.get("paths", []) if isinstance(p, str)] if isinstance(data, dict) else []
    return [p for p in found if (p / "config.json").is_file()]


def remember(path: Path) -> None:
    """Add a model directory (moved to newest); directories under the models directory need no record."""
    path = Path(path).expanduser().absolute()
    with contextlib.suppress(ValueError):
        path.relative_to(paths.models_dir().absolute())
        return
    kept = [p for p in known_dirs() if p != path][-(KEEP - 1):] + [path]
    with contextlib.suppress(OSError):
        atomic_write_bytes(known_file(), json.dumps({"paths": [str(p) for p in kept]}, indent=1).encode())
