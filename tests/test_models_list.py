"""`glyd models list` lists what is here: Glyd's models directory, the Glyd checkpoints `glyd pack` wrote
anywhere, and model directories opened by path; a directory that is gone drops out of the list."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.tiny_models import make_tiny_llama

REPO = Path(__file__).resolve().parent.parent


def glyd(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GLYD_HOME": str(home), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "glyd_engine.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


def test_packed_checkpoints_and_opened_directories_are_listed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    src = make_tiny_llama(tmp_path / "work" / "tiny-src")
    assert "no models" in glyd(home, "models", "list").stdout
    packed = tmp_path / "elsewhere" / "tiny-glyd"
    assert glyd(home, "pack", str(src), str(packed)).returncode == 0
    opened = make_tiny_llama(tmp_path / "mine" / "my-llama", seed=2)
    shown = glyd(home, "models", "path", str(opened))  # what glyd-chat DIR and glyd serve DIR resolve through
    assert shown.returncode == 0 and shown.stdout.strip() == str(opened)

    rows = {line.split()[0]: line.split() for line in glyd(home, "models", "list").stdout.splitlines()[1:]}
    assert rows["tiny-glyd"][1] == "glyd-packed" and rows["tiny-glyd"][-1] == str(packed.absolute())
    assert rows["my-llama"][1] == "local" and rows["my-llama"][-1] == str(opened)
    assert rows["tiny-src"][1] == "local"  # pack's source was opened by path too

    shutil.rmtree(opened)
    listing = glyd(home, "models", "list").stdout
    assert "my-llama" not in listing and "tiny-glyd" in listing
