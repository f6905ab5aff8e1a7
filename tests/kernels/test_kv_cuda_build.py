"""Every CUDA source (KV pages, the matmuls) compiles with NVRTC for the architectures Glyd ships to, sm_80 to sm_120,
as a user's first start builds it there (no GPU needed), and the cache works.

A syntax or API slip in kernels/cuda fails here, in CI, rather than on a user's first start.
"""

from __future__ import annotations

import pytest

nvrtc = pytest.importorskip("glyd_kernels.nvrtc")
pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (the test extra installs it)")

CONFIGS = [  # (head size, query heads a KV head, reserve, tiles a page): the demo model, the largest group
    (64, 3, 36, 1), (128, 8, 68, 2)]
# Ampere (A100), Ampere and Ada desktop cards (RTX 30, 40), Hopper (H100, H200), Blackwell desktop cards (RTX 50)
ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"]
KV_KERNELS = ("kv_decode_attention", "kv_merge", "kv_read_tiles", "kv_write")
MM_SHAPES = [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)]  # Qwen3-8B's linear layers (n, k)


def first_start_builds(arch: str) -> list[tuple[str, str, dict[str, int], tuple[str, ...]]]:
    """(source, compile target, defines, kernels) of every build a user's first start makes on a GPU of `arch`: the
    KV kernels of both configs and codes, and the matmul kernel `default_config` picks for each row count and shape,
    the warpgroup-MMA one (for sm_90a) where `matmul_cuda.has_wgmma` holds: Hopper only."""
    from glyd_engine.format.kv_page import KVPageLayout
    from glyd_kernels import kv_cuda, matmul_cuda

    out = [("kv_pages.cu", arch, kv_cuda.defines(KVPageLayout(d, 16 * tiles, reserve, bits), g), KV_KERNELS)
           for d, g, reserve, tiles in CONFIGS for bits in (3, 4)]
    for rows in (1, 16, 32, 64, 128):
        for n, k in MM_SHAPES:
            cfg = matmul_cuda.default_config(rows, n, 132, k, wgmma=arch == "sm_90")
            if isinstance(cfg, matmul_cuda.WgmmaConfig):
                build = (matmul_cuda.WGMMA_SOURCE, "sm_90a", matmul_cuda.wgmma_defines(rows, cfg),
                         ("glyd_mm_wgmma", "glyd_mm_x_image"))
            elif isinstance(cfg, matmul_cuda.WideConfig):
                build = (matmul_cuda.WIDE_SOURCE, arch, matmul_cuda.wide_defines(rows, cfg), ("glyd_mm_wide",))
            else:
                build = (matmul_cuda.SOURCE, arch, matmul_cuda.defines(rows, cfg), matmul_cuda.KERNELS)
            if build not in out:
                out.append(build)
    return out


def _build_id(build: tuple[str, str, dict[str, int], tuple[str, ...]]) -> str:
    name, target, defines, _ = build
    return f"{target}-{name.split('.')[0]}-" + ",".join(f"{k}{v}" for k, v in defines.items())


BUILDS = [b for arch in ARCHS for b in first_start_builds(arch)]
# the KV decode's register pipeline (RING=0): a build bench/gpu.py times, kept compiling without spills
BUILDS += [("kv_pages.cu", "sm_90", {**b[2], "RING": 0, "MIN_BLOCKS": 2}, KV_KERNELS)
           for b in first_start_builds("sm_90") if b[0] == "kv_pages.cu" and b[2]["CODE_BITS"] == 4]


@pytest.mark.parametrize("build", BUILDS, ids=_build_id)
def test_every_source_compiles_without_spills_for_each_architecture(build: tuple) -> None:
    """Each kernels/cuda source as a user's first start builds it on sm_80, sm_86, sm_89, sm_90 (and sm_90a) and
    sm_120: it compiles, every kernel is there, nothing spills, no warning."""
    name, target, defines, kernels = build
    cubin, log = nvrtc.compile_cubin(name, target, defines, log_ptxas=True)
    assert cubin[:4] == b"\x7fELF"
    for kernel in kernels:
        assert f"Compiling entry function '{kernel}'" in log, kernel
    assert "bytes spill stores" in log
    assert all(" 0 bytes spill" in line for line in log.splitlines() if "spill stores" in line), log
    assert "warning" not in log.lower(), log


def test_every_kernel_source_is_in_the_matrix() -> None:
    built = {name for name, *_ in BUILDS}
    assert built == {p.name for p in nvrtc.SOURCES.glob("*.cu")}
    assert {target for _, target, *_ in BUILDS} == {*ARCHS, "sm_90a"}


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_the_warpgroup_mma_source_refuses_other_targets_by_name(arch: str) -> None:
    from glyd_kernels import matmul_cuda

    with pytest.raises(nvrtc.KernelBuildError, match="needs Hopper's sm_90a target"):
        nvrtc.compile_cubin(matmul_cuda.WGMMA_SOURCE, arch, matmul_cuda.wgmma_defines(64, matmul_cuda.WgmmaConfig()))


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)])
def test_gpus_other_than_hopper_take_the_portable_matmuls(capability: tuple[int, int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Only sm_90 runs the warpgroup-MMA kernel; elsewhere the mma.sync kernels, compiled for the device's own
    architecture, and layers past FUSED_ROWS rows decode W for vLLM's GEMM."""
    import torch

    from glyd_kernels import matmul_cuda

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    matmul_cuda.has_wgmma.cache_clear()
    try:
        assert not matmul_cuda.has_wgmma(0)
        assert matmul_cuda.fused_rows(24576, 4096, 0) == matmul_cuda.FUSED_ROWS
    finally:
        matmul_cuda.has_wgmma.cache_clear()
    assert nvrtc.device_arch(0) == f"sm_{capability[0]}{capability[1]}"
    for rows in (1, 16, 32, 64, 128):
        for n, k in MM_SHAPES:
            assert not isinstance(matmul_cuda.default_config(rows, n, 132, k, wgmma=False), matmul_cuda.WgmmaConfig)


def test_the_kv_build_switches_are_the_launchers_and_give_correct_results() -> None:
    """Every default a KV source sets (#ifndef X / #define X) is a switch `kv_cuda.SWITCHES` names, each a build that
    gives correct results (bench/gpu.py --variants times them): no benchmark-only switch in the product kernel."""
    import re

    from glyd_engine.format.kv_page import KVPageLayout
    from glyd_kernels import kv_cuda

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


def test_a_compile_with_an_empty_log_leaves_the_interpreters_bytes_alone() -> None:
    """NVRTC writes its log into the buffer it is handed; a shared one-byte bytes object there turned every b" " of
    the process into b"\\x00" (a later safetensors header padded with spaces then failed to parse)."""
    defines = {"HEAD": 64, "GQ": 3, "RESERVE": 36, "TPP": 1, "WARPS": 4}
    cubin, log = nvrtc.compile_cubin("kv_pages.cu", "sm_90", defines)
    assert log == "" and cubin[:4] == b"\x7fELF"
    assert b" " * 3 == b"   " and b" ".decode() == chr(32)  # b"   " is an object of its own; b" " is the shared one


def test_the_portable_build_is_ptx_for_sm_80_with_every_kernel() -> None:
    """`PORTABLE=1` (bench/gpu.py times it on the H200: the path of GPUs before Hopper) is sm_80 PTX, NUL-terminated
    as the driver loads it, with every KV kernel."""
    from glyd_engine.format.kv_page import KVPageLayout
    from glyd_kernels import kv_cuda

    build = kv_cuda.defines(KVPageLayout(128, 32, 68, 4), 4, (("PORTABLE", 1),))
    ptx, _ = nvrtc.compile_cubin("kv_pages.cu", "compute_80", build)
    text = ptx.decode()
    assert ptx.endswith(b"\x00") and ".target sm_80" in text
    assert all(f".entry {k}(" in text for k in KV_KERNELS), [k for k in KV_KERNELS if f".entry {k}(" not in text]
