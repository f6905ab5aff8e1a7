"""What the wheel holds: the folder kernels/ installs as `glyd_kernels` (pyproject's package-dir), never as a top-level
`kernels`, which Hugging Face's `kernels` distribution owns; every CUDA source ships with it; and both packages
install and import side by side. The wheels are built offline from a copy of the tree (a second or two each)."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
CUDA_FILES = sorted(p.name for p in (ROOT / "kernels" / "cuda").iterdir())


def test_the_kernels_folder_is_mapped_to_glyd_kernels() -> None:
    assert SETUPTOOLS["package-dir"] == {"glyd_kernels": "kernels"}
    assert "kernels" not in SETUPTOOLS["packages"] and "kernels" not in SETUPTOOLS["package-data"]


def test_the_package_list_is_the_trees() -> None:
    """The list is explicit (package-dir and `packages.find` do not mix): a new subpackage must be added to it."""
    tree = sorted(".".join(p.parent.relative_to(ROOT).parts) for top in ("glyd_engine", "glyd_app")
                  for p in (ROOT / top).rglob("__init__.py"))
    assert sorted(SETUPTOOLS["packages"]) == sorted([*tree, "glyd_kernels"])
    assert not [p for p in (ROOT / "kernels").rglob("__init__.py") if p.parent != ROOT / "kernels"]


def test_every_kernel_source_and_header_is_package_data() -> None:
    """A wheel holds kernels/cuda's files only where the package data names them: a header left out would make every
    first compile fail on a user's machine, not here (the tests run from the source tree)."""
    patterns = SETUPTOOLS["package-data"]["glyd_kernels"]
    assert CUDA_FILES and any(f.endswith(".cuh") for f in CUDA_FILES) and any(f.endswith(".cu") for f in CUDA_FILES)
    assert [f for f in CUDA_FILES if not any(fnmatch.fnmatch(f"cuda/{f}", pat) for pat in patterns)] == []


def _wheel(src: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    return next(out.glob("*.whl"))


@pytest.fixture(scope="module")
def our_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("glyd_engine", "glyd_app", "kernels", "assets/text"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return _wheel(src, tmp_path_factory.mktemp("wheel"))


def test_the_wheel_installs_glyd_kernels_with_its_cuda_sources_and_no_kernels(our_wheel: Path) -> None:
    with zipfile.ZipFile(our_wheel) as z:
        names = z.namelist()
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    tops = {line.split("/")[0] for line in record.splitlines() if line}
    assert {t for t in tops if not t.startswith("glyd-0")} == {"glyd_engine", "glyd_app", "glyd_kernels"}
    assert sorted(n.split("/")[-1] for n in names if n.startswith("glyd_kernels/cuda/")) == CUDA_FILES
    assert {"glyd_kernels/__init__.py", "glyd_kernels/kv_cuda.py", "glyd_kernels/nvrtc.py"} <= set(names)


def test_glyd_and_a_kernels_distribution_install_and_import_side_by_side(our_wheel: Path, tmp_path: Path) -> None:
    """A stand-in for Hugging Face's `kernels` (its top-level name, nothing else) and our wheel in one site: pip
    writes both, and each import finds its own package."""
    other = tmp_path / "hf-kernels"
    (other / "kernels").mkdir(parents=True)
    (other / "kernels" / "__init__.py").write_text("WHO = 'huggingface'\n")
    (other / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = '
                                          '"setuptools.build_meta"\n[project]\nname = "kernels"\nversion = "0.0.1"\n'
                                          '[tool.setuptools]\npackages = ["kernels"]\n')
    hf_wheel = _wheel(other, tmp_path / "hf-wheel")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), str(our_wheel), str(hf_wheel)], check=True, capture_output=True)
    code = ("import sys; sys.path[:0] = [sys.argv[1]]\n"
            "import kernels, glyd_kernels, glyd_kernels.nvrtc as n\n"
            "assert kernels.WHO == 'huggingface', kernels.__file__\n"
            "assert glyd_kernels.__file__.startswith(sys.argv[1]), glyd_kernels.__file__\n"
            "assert (n.SOURCES / 'kv_pages.cu').is_file()\n")
    run = subprocess.run([sys.executable, "-I", "-c", code, str(site)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
