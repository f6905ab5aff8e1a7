"""`glyd paths`: every place Glyd reads or writes, one `name  path` line each (or JSON)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def all_places() -> dict[str, Path]:
    from glyd_engine import paths
    from glyd_engine.engine.client import log_path
    from glyd_engine.engine.install import engine_venv

    places = dict(paths.all_paths())
    places.update(
        {
            "chats": paths.data_dir() / "chats.sqlite3",  # glyd_app.store.db_path, without importing the app
            "engine_venv": engine_venv(),
            "engine_log": log_path(),
            "config_file": paths.config_dir() / "config.toml",
            "keymap_file": paths.config_dir() / "keymap.toml",
        }
    )
    return places


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "paths",
        help="print where Glyd keeps models, tables, chats and logs",
        description="Where Glyd keeps things (GLYD_HOME overrides the root).",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    places = all_places()
    if args.json:
        print(json.dumps({k: str(v) for k, v in places.items()}, indent=2))
        return 0
    width = max(map(len, places))
    for name, path in places.items():
        print(f"{name:<{width}}  {path}")
    return 0
