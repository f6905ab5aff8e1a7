"""The engine suite (tests/vllm) fails, rather than skips, when vLLM does not import: CI must not pass with
the engine tests silently gone. Skipping takes GLYD_SKIP_ENGINE_TESTS=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _collect_with_a_broken_vllm(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    broken = tmp_path / "site" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("a broken vLLM install (test)")\n')
    environ = {k: v for k, v in os.environ.items() if k != "GLYD_SKIP_ENGINE_TESTS"}
    environ.update(PYTHONPATH=str(tmp_path / "site"), **env)
    # Collected as in a whole-suite run (tests/vllm found under tests/), the other directories left out for speed.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "tests",
                           "--ignore=tests/app", "--ignore=tests/kernels", "--ignore-glob=tests/test_*.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=environ)


def test_a_vllm_that_does_not_import_fails_the_engine_suite(tmp_path: Path) -> None:
    r = _collect_with_a_broken_vllm(tmp_path)
    assert r.returncode not in (0, 5), r.stdout  # 5: nothing collected, which is what a skip looked like
    assert "a broken vLLM install (test)" in r.stdout + r.stderr and "GLYD_SKIP_ENGINE_TESTS=1" in r.stdout + r.stderr


def test_skipping_the_engine_suite_takes_asking(tmp_path: Path) -> None:
    r = _collect_with_a_broken_vllm(tmp_path, GLYD_SKIP_ENGINE_TESTS="1")
    assert r.returncode in (0, 5), r.stdout + r.stderr  # 5: nothing collected
    assert "tests/vllm NOT RUN: vLLM does not import (a broken vLLM install (test))" in r.stdout, r.stdout
