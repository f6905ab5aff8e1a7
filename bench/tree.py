"""Bind `glyd_kernels` to this tree's kernels/ folder for the GPU benchmarks run as scripts.

pyproject installs the folder kernels/ under the name glyd_kernels. On the device the tree travels uninstalled, and an
install from an earlier call (in /tmp/site, say) may hold other code: a benchmark must time the kernels of the tree it
was run from, so the scripts bind the name here (as tests/conftest.py does for the tests) and refuse a glyd_kernels
already imported from elsewhere.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def bind_kernels() -> None:
    mod = sys.modules.get("glyd_kernels")
    if mod is None:
        spec = importlib.util.spec_from_file_location("glyd_kernels", KERNELS / "__init__.py",
                                                      submodule_search_locations=[str(KERNELS)])
        if spec is None or spec.loader is None:
            raise ImportError(f"no package at {KERNELS}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["glyd_kernels"] = mod
        spec.loader.exec_module(mod)
    if Path(mod.__file__ or "").resolve().parent != KERNELS:
        raise ImportError(f"glyd_kernels was imported from {mod.__file__}, not from this tree's {KERNELS}")
