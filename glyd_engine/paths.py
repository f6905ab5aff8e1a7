"""Where Glyd keeps things: the one place that knows the platformdirs layout.

`GLYD_HOME` overrides the root (tests and CI use it to isolate themselves from the user's files).
"""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "glyd"


def _root(kind: str) -> Path:
    home = os.environ.get("GLYD_HOME")
    if home:
        return Path(home) / kind
    import platformdirs

    if kind == "cache":
        return Path(platformdirs.user_cache_dir(APP_NAME))
    if kind == "data":
        return Path(platformdirs.user_data_dir(APP_NAME))
    if kind == "config":
        return Path(platformdirs.user_config_dir(APP_NAME))
    raise ValueError(kind)


def cache_dir() -> Path:
    return _root("cache")


def data_dir() -> Path:
    return _root("data")


def config_dir() -> Path:
    return _root("config")


def models_dir() -> Path:
    """Model directories Glyd made or downloaded (the demo model among them)."""
    return cache_dir() / "models"


def kv_tables_dir() -> Path:
    """Per-model KV exponent tables, one file per model fingerprint."""
    return cache_dir() / "kv"


def all_paths() -> dict[str, Path]:
    return {
        "cache": cache_dir(),
        "data": data_dir(),
        "config": config_dir(),
        "models": models_dir(),
        "kv_tables": kv_tables_dir(),
    }
