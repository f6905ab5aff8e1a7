"""The texts Glyd runs models over: calibration texts (for per-model KV exponent tables) and held-out
texts (for benchmarks), never the same text.

They live in the repository at `assets/text/` and, in an installed wheel, at
`<prefix>/share/glyd/assets/text/` (installed there as data files). `assets/text/manifest.json` lists
every file with its kind, language, source and licence; `assets/text/README.md` is the readable table.

Standard library only: importing this module costs nothing.
"""

from __future__ import annotations

import json
import site
import sys
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from glyd_engine.errors import GlydError

MANIFEST = "manifest.json"
SPLITS = ("calibration", "heldout")
KINDS = ("prose", "code", "dialogue", "multilingual")


@dataclass(frozen=True)
class CorpusText:
    """One text file of the corpus.

    `kind` is one of KINDS. `language` is a natural-language code ("en", "fr", "zh", ...) for prose,
    dialogue and multilingual texts, and the programming language ("python", "c", ...) for code.
    """

    name: str
    kind: str
    language: str
    text: str


def candidate_dirs() -> list[Path]:
    """Where the corpus may be, in the order searched: the source tree, then installed data files."""
    dirs = [Path(__file__).resolve().parent.parent / "assets" / "text"]
    prefixes = [sys.prefix, sysconfig.get_path("data"), getattr(site, "USER_BASE", None)]
    for prefix in prefixes:
        if prefix:
            d = Path(prefix) / "share" / "glyd" / "assets" / "text"
            if d not in dirs:
                dirs.append(d)
    return dirs


def assets_dir() -> Path:
    """The first candidate directory that holds the corpus manifest."""
    for d in candidate_dirs():
        if (d / MANIFEST).is_file():
            return d
    searched = ", ".join(str(d) for d in candidate_dirs())
    raise GlydError(
        f"Glyd's text corpus ({MANIFEST}) was not found (looked in {searched}). "
        "Reinstall glyd, or run from a checkout of its repository."
    )


@cache
def _load(split: str) -> tuple[CorpusText, ...]:
    root = assets_dir()
    manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    texts = []
    for entry in manifest["files"]:
        if entry["split"] != split:
            continue
        path = root / entry["path"]
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise GlydError(
                f"Corpus file {path} is listed in {MANIFEST} but missing; reinstall glyd."
            ) from None
        name = Path(entry["path"]).stem
        texts.append(CorpusText(name=name, kind=entry["kind"], language=entry["language"], text=text))
    if not texts:
        raise GlydError(f"{root / MANIFEST} lists no {split} texts; reinstall glyd.")
    return tuple(texts)


def calibration_texts() -> list[CorpusText]:
    """Texts to build per-model exponent tables from (about 94k SmolLM2 tokens, each file under 7.2k)."""
    return list(_load("calibration"))


def heldout_texts() -> list[CorpusText]:
    """Texts for benchmarks, disjoint from the calibration texts (about 28k SmolLM2 tokens)."""
    return list(_load("heldout"))
