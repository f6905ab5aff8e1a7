"""A torchvision whose native code does not load with this torch (what pip installs beside vLLM's CPU build)
must not stop the engine, and `glyd doctor` must run the engine's own import and tell the truth about it.

The stand-in torchvision fails exactly as the real mismatched one does: its `__init__` raises torch's
"operator torchvision::nms does not exist", and its `_C.so` does not load (garbage here, a missing
libc10_cuda.so there). A stand-in whose `_C.so` does load (torch's own libc10) is a working add-on that the
guard leaves alone, so its import failure is a real one that doctor must report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NMS = "operator torchvision::nms does not exist"


def fake_torchvision(root: Path, loadable: bool) -> Path:
    pkg = root / "torchvision"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise RuntimeError({NMS!r})\n")
    lib = pkg / "_C.so"
    if loadable:
        torch_dir = Path(importlib.util.find_spec("torch").origin).parent  # type: ignore[union-attr]
        lib.symlink_to(torch_dir / "lib" / "libc10.so")
    else:
        lib.write_bytes(b"not an ELF file")
    return root


def env_with(root: Path, home: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)]), "GLYD_HOME": str(home)}


def run_py(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def broken_addon(tmp_path: Path) -> dict[str, str]:
    return env_with(fake_torchvision(tmp_path / "site", loadable=False), tmp_path / "home")


def test_unloadable_torchvision_breaks_the_import_unless_guarded(broken_addon: dict[str, str]) -> None:
    bare = run_py("import transformers.image_utils", broken_addon)
    assert bare.returncode != 0 and NMS in bare.stderr  # the stand-in reproduces the install's crash
    guarded = run_py(
        "import importlib.util, json\n"
        "from glyd_engine import torch_extras\n"
        "kept = torch_extras.guard()\n"
        "import transformers.image_utils\n"
        "print(json.dumps({'kept': sorted(kept), 'spec': importlib.util.find_spec('torchvision') is None}))",
        broken_addon,
    )
    assert guarded.returncode == 0, guarded.stderr[-2000:]
    out = json.loads(guarded.stdout.strip().splitlines()[-1])
    assert "torchvision" in out["kept"] and out["spec"] is True


def test_a_process_vllms_server_spawns_is_guarded_before_it_imports_vllm(broken_addon: dict[str, str]) -> None:
    """`glyd serve` runs `python -m glyd_engine.vllm_cli`; vLLM's server spawns its engine core, which prepares
    itself from that main module (multiprocessing's own `prepare`, as here) before it unpickles what imports vLLM.
    The pipx install's `glyd serve` failed there while its parent was guarded."""
    child = run_py(
        "import multiprocessing.spawn as spawn\n"
        "spawn.prepare({'init_main_from_name': 'glyd_engine.vllm_cli'})\n"
        "import transformers.image_utils\n"
        "from glyd_engine import torch_extras\n"
        "print(sorted(torch_extras.blocked()))",
        broken_addon,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "torchvision" in child.stdout.strip().splitlines()[-1]


def test_doctor_runs_the_engines_import(broken_addon: dict[str, str], tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "glyd_engine.cli", "doctor", "--json"], capture_output=True,
                        text=True, env=broken_addon, timeout=300)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    start = json.loads(ok.stdout)["engine"]["engine_import"]
    assert start["ok"] is True and "torchvision" in start["kept_out"]

    # A torchvision whose library loads is not kept out: its import failure is real, and doctor says so.
    loads = env_with(fake_torchvision(tmp_path / "loads", loadable=True), tmp_path / "home2")
    bad = subprocess.run([sys.executable, "-m", "glyd_engine.cli", "doctor"], capture_output=True, text=True,
                         env=loads, timeout=300)
    assert bad.returncode == 1
    assert "Engine start fails at vLLM's import" in bad.stdout and NMS in bad.stdout
    assert "=> nothing: the engine's import fails" in bad.stdout
