"""The child process of `isolated.build_in_child`: builds a model's KV tables, prints each progress event as a JSON
line, and writes the tables to the file the parent loads (a module of its own, so that the parent's side imports
nothing of the build).

Use: python -m glyd_engine.tables.build_child MODEL_DIR WINDOW TOKENS OUT   (WINDOW 0: the model's)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from glyd_engine.progress import ProgressEvent
from glyd_engine.tables.build import build_tables


def main(argv: list[str]) -> int:
    model_dir, window, tokens, out = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])

    def emit(ev: ProgressEvent) -> None:
        print(json.dumps(dataclasses.asdict(ev)), flush=True)

    build_tables(model_dir, window or None, tokens, progress=emit).save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
