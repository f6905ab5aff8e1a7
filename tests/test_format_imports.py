"""glyd_engine.format is the codec: it imports nothing above it (not the downloader, the engine or the app).

Allowed: the standard library, torch, numpy, safetensors, glyd_engine.format itself, and three leaf modules
that import nothing of glyd_engine but errors (checked below too, so the rule cannot leak through them).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMAT = ROOT / "glyd_engine" / "format"
THIRD_PARTY = {"torch", "numpy", "safetensors"}
LEAVES = {"glyd_engine.errors", "glyd_engine.atomic", "glyd_engine.progress"}


def _imported(path: Path) -> set[str]:
    """Every absolute module a file imports, at its top or inside a function; relative ones as glyd_engine.format."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("glyd_engine.format" if node.level else str(node.module))
    return found


def _outside(modules: set[str], allowed_glyd: set[str]) -> list[str]:
    bad = []
    for name in modules:
        top = name.split(".")[0]
        if top == "glyd_engine":
            if name != "glyd_engine.format" and not name.startswith("glyd_engine.format.") and name not in allowed_glyd:
                bad.append(name)
        elif top not in THIRD_PARTY and top not in sys.stdlib_module_names and top != "__future__":
            bad.append(name)
    return sorted(bad)


def test_format_imports_nothing_above_it() -> None:
    files = sorted(FORMAT.rglob("*.py"))
    assert len(files) >= 8  # the walk found the package
    offenders = {str(p.relative_to(ROOT)): _outside(_imported(p), LEAVES) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_leaves_format_may_import_are_leaves() -> None:
    for leaf in sorted(LEAVES):
        path = ROOT / Path(*leaf.split(".")).with_suffix(".py")
        assert _outside(_imported(path), {"glyd_engine.errors"}) == [], leaf


def test_the_check_catches_an_import_of_the_downloader() -> None:
    assert _outside({"glyd_engine.models", "glyd_engine.format.bf16", "torch", "json"}, LEAVES) == [
        "glyd_engine.models"]
    assert _outside({"transformers"}, LEAVES) == ["transformers"]
