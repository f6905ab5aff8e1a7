"""The engine started once from glyd installed the pipx way (CI: .ci/pipx-install makes a fresh venv with
`pip install '.[cpu]'`, non-editable, nothing uninstalled, and names its Python in GLYD_INSTALLED_PYTHON):
the start that crashed on "operator torchvision::nms does not exist" gets a reply from the demo model."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import TEST_HOME

INSTALLED = os.environ.get("GLYD_INSTALLED_PYTHON")
HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.skipif(not INSTALLED, reason="GLYD_INSTALLED_PYTHON not set (CI's .ci/pipx-install sets it)")
def test_an_installed_glyd_starts_the_engine_and_answers(demo_model_dir: Path, tmp_path: Path) -> None:
    assert INSTALLED is not None
    venv = Path(INSTALLED).parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GLYD_KV") and not k.startswith("VLLM_")}
    env["GLYD_HOME"] = str(TEST_HOME)
    run = subprocess.run([INSTALLED, str(HERE / "installed_engine_once.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"glyd_engine from {venv}" in run.stdout  # the installed package, not the clone
    assert "engine ready" in run.stdout and "Paris" in run.stdout, run.stdout
