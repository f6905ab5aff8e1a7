"""Every CUDA source (KV pages, the matmul) compiles with NVRTC for the architectures Glyd ships to (no GPU
needed), and the cache works.

A syntax or API slip in kernels/cuda fails here, in CI, rather than on a user's first start.
"""

from __future__ import annotations

import pytest

nvrtc = pytest.importorskip("kernels.nvrtc")
pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (the test extra installs it)")

CONFIGS = [  # (head size, query heads a KV head, reserve, tiles a page): the demo model, the largest group
    (64, 3, 36, 1), (128, 8, 68, 2)]


@pytest.mark.parametrize("arch,code_bits,pipeline", [("sm_80", 3, "ring"), ("sm_90", 3, "ring"), ("sm_90", 4, "ring"),
                                                    ("sm_90", 4, "registers")])
@pytest.mark.parametrize("d,g,reserve,tiles", CONFIGS)
def test_kv_kernels_compile_without_spills(arch: str, code_bits: int, pipeline: str, d: int, g: int, reserve: int,
                                           tiles: int) -> None:
    from glyd_engine.format.kv_page import KVPageLayout
    from kernels import kv_cuda

    shipped = kv_cuda.defines(KVPageLayout(d, 16 * tiles, reserve, code_bits), g)  # what a user's first start builds
    defines = shipped if pipeline == "ring" else {**shipped, "RING": 0, "MIN_BLOCKS": 2}
    cubin, log = nvrtc.compile_cubin("kv_pages.cu", arch, defines, log_ptxas=True)
    assert cubin[:4] == b"\x7fELF"
    for kernel in ("kv_decode_attention", "kv_merge", "kv_read_tiles", "kv_write"):
        assert f"Compiling entry function '{kernel}'" in log, kernel
    assert "0 bytes spill stores" in log and "bytes spill stores" in log
    assert all(" 0 bytes spill" in line for line in log.splitlines() if "spill stores" in line), log
    assert "warning" not in log.lower(), log


def test_the_kv_build_switches_are_the_launchers_and_give_correct_results() -> None:
    """Every default a KV source sets (#ifndef X / #define X) is a switch `kv_cuda.SWITCHES` names, each a build that
    gives correct results (bench/gpu.py --variants times them): no benchmark-only switch in the product kernel."""
    import re

    from glyd_engine.format.kv_page import KVPageLayout
    from kernels import kv_cuda

    text = "".join(p.read_text() for p in nvrtc.SOURCES.glob("kv_*"))
    defaults = set(re.findall(r"#ifndef (\w+)\n(?://.*\n)*#define \1\b", text))
    shipped = kv_cuda.defines(KVPageLayout(64, 16, 36, 4), 3)
    assert defaults <= {*kv_cuda.SWITCHES, "CODE_BITS"}, defaults - set(kv_cuda.SWITCHES)
    assert set(kv_cuda.SWITCHES) <= defaults | set(shipped)
    with pytest.raises(ValueError, match="no build switch SKIP_ESCAPES"):
        kv_cuda.defines(KVPageLayout(64, 16, 36, 4), 3, (("SKIP_ESCAPES", 3),))


def test_a_build_error_names_the_source_and_the_compiler_message() -> None:
    with pytest.raises(nvrtc.KernelBuildError, match="kv_pages.cu.*sm_90"):
        nvrtc.compile_cubin("kv_pages.cu", "sm_90", {"HEAD": 96, "GQ": 4, "RESERVE": 68, "TPP": 1, "WARPS": 4})


def test_cubins_are_cached_by_source_defines_and_arch(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLYD_HOME", str(tmp_path))
    calls = []
    real = nvrtc.compile_cubin
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    defines = {"HEAD": 64, "GQ": 3, "RESERVE": 36, "TPP": 1, "WARPS": 4}
    first = nvrtc.cached_cubin("kv_pages.cu", "sm_90", defines)
    assert nvrtc.cached_cubin("kv_pages.cu", "sm_90", defines) == first and len(calls) == 1
    nvrtc.cached_cubin("kv_pages.cu", "sm_80", defines)
    nvrtc.cached_cubin("kv_pages.cu", "sm_90", {**defines, "GQ": 4})
    assert len(calls) == 3
    assert len(list((tmp_path / "cache" / "kernels").glob("*.cubin"))) == 3


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
@pytest.mark.parametrize("rows", [1, 16, 32, 64, 128])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)])  # Qwen3-8B's
def test_matmul_kernels_compile_without_spills(arch: str, rows: int, n: int, k: int) -> None:
    """What a user's first start builds: on sm_90 (H100, H200) past 32 rows and for large W the warpgroup-MMA kernel,
    for sm_90a."""
    from kernels import matmul_cuda

    cfg = matmul_cuda.default_config(rows, n, 132, k, wgmma=arch == "sm_90a")
    if arch == "sm_90a" and not isinstance(cfg, matmul_cuda.WgmmaConfig):
        pytest.skip("Hopper runs the sm_90 builds for this shape and row count")
    if isinstance(cfg, matmul_cuda.WgmmaConfig):
        name, defines, kernels = matmul_cuda.WGMMA_SOURCE, matmul_cuda.wgmma_defines(rows, cfg), ("glyd_mm_wgmma",
                                                                                             "glyd_mm_x_image")
    elif isinstance(cfg, matmul_cuda.WideConfig):
        name, defines, kernels = matmul_cuda.WIDE_SOURCE, matmul_cuda.wide_defines(rows, cfg), ("glyd_mm_wide",)
    else:
        name, defines, kernels = matmul_cuda.SOURCE, matmul_cuda.defines(rows, cfg), matmul_cuda.KERNELS
    cubin, log = nvrtc.compile_cubin(name, arch, defines, log_ptxas=True)
    assert cubin[:4] == b"\x7fELF"
    for kernel in kernels:
        assert f"Compiling entry function '{kernel}'" in log, kernel
    assert all(" 0 bytes spill" in line for line in log.splitlines() if "spill stores" in line), log
    assert "warning" not in log.lower(), log


def test_every_kernel_source_and_header_ships_in_the_package() -> None:
    """A wheel holds kernels/cuda's files only where pyproject's package data names them: a header left out would
    make every first compile fail on a user's machine, not here (the tests run from the source tree)."""
    import ast
    import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "pyproject.toml").read_text()
    section = text[text.index("[tool.setuptools.package-data]"):]
    line = next(ln for ln in section.splitlines() if ln.startswith("kernels = "))
    patterns = ast.literal_eval(line.split("=", 1)[1].strip())
    files = [p.relative_to(root / "kernels").as_posix() for p in (root / "kernels" / "cuda").iterdir()]
    assert files and any(f.endswith(".cuh") for f in files)
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []
