"""Keep torch add-ons whose native code cannot load out of the engine's imports.

vLLM's CPU build pins torch `2.13.0+cpu` but asks for torchvision, torchaudio and torchcodec unpinned; pip
(and pipx) take them from PyPI, built against the CUDA torch, so their libraries need `libc10_cuda.so`.
transformers imports torchvision whenever it is installed (its image utilities, on every `import vllm`), and
that import fails: `operator torchvision::nms does not exist`. A text model needs none of them.

`guard()` loads each installed add-on's native library the way `torch.ops.load_library` would; an add-on
none of whose libraries load is marked absent (`sys.modules[name] = None`): `import` then raises
ImportError and `importlib.util.find_spec` answers None, so transformers and vLLM take their paths for a
machine without it. An add-on that loads (vLLM's CUDA install, a matching CPU build) is left alone. Every
process that imports vLLM calls it first: the engine child, `glyd_engine.vllm_cli` (`glyd serve`,
`glyd doctor`), the benches.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

# add-on -> the native libraries (globs under the package) of which at least one must load
NATIVE: dict[str, tuple[str, ...]] = {
    "torchvision": ("_C*.so", "_C*.pyd", "_C*.dylib"),
    "torchaudio": ("lib/libtorchaudio*.so", "lib/libtorchaudio*.dylib"),
    "torchcodec": ("libtorchcodec_core*.so", "libtorchcodec_core*.dylib"),
}

_blocked: dict[str, str] = {}


def _package_dir(name: str) -> Path | None:
    """The add-on's folder, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def load_error(name: str) -> str | None:
    """Why the installed add-on `name` cannot load its native code (None: it can, or it is not installed).
    Imports torch first, as the add-on's own import would, so its libraries resolve against this torch."""
    folder = _package_dir(name)
    if folder is None:
        return None
    libraries = sorted(p for pattern in NATIVE[name] for p in folder.glob(pattern))
    if not libraries:
        return None  # a pure-Python build: nothing to mismatch
    import torch  # noqa: F401 - the add-on's libraries link against the torch this process loads

    first_error = ""
    for lib in libraries:
        try:
            ctypes.CDLL(str(lib))
            return None
        except OSError as exc:
            first_error = first_error or str(exc)
    return first_error


def guard() -> dict[str, str]:
    """Mark every installed add-on that cannot load as absent; returns {name: why} for those (idempotent)."""
    for name in NATIVE:
        if name in _blocked or sys.modules.get(name) is not None:
            continue  # already decided, or already imported (then it loaded)
        why = load_error(name)
        if why is not None:
            sys.modules[name] = None  # type: ignore[assignment] - the import system's "not installed" marker
            _blocked[name] = why
    return dict(_blocked)


def blocked() -> dict[str, str]:
    """The add-ons `guard()` marked absent in this process, with the loader's reason."""
    return dict(_blocked)
