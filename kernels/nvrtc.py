"""CUDA C++ kernels shipped as source (kernels/cuda/*.cu), compiled on first use by NVRTC and cached.

NVRTC and the driver API come from `cuda-bindings` (installed with vLLM's CUDA build; NVRTC's library with
torch), so a user never needs nvcc. A compiled cubin is kept in the cache directory under a key of the source
hash, the compile-time constants, the GPU architecture and NVRTC's version, and rebuilt when any of them
changes; it is written atomically, so two processes starting at once at worst both compile. Kernels launch on
torch's current stream, so CUDA graphs capture them. `compile_cubin` needs no GPU (CI compiles every source
for sm_80, sm_86, sm_89, sm_90/sm_90a and sm_120 on a CPU machine).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).with_name("cuda")
log = logging.getLogger("vllm.glyd.kernels")  # inside an engine this goes where vLLM's log goes (and its phases)
_lock = threading.Lock()
_modules: dict[tuple[int, str], object] = {}
on_compile: list[Callable[[str], None]] = []  # told "name (arch)" before each compile (start-up progress)


class KernelBuildError(RuntimeError):
    """NVRTC refused a kernel source (the message carries its log) or the driver could not load it."""


def _nvrtc():  # noqa: ANN202
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise KernelBuildError("Glyd's CUDA kernels need the cuda-bindings package (installed with vLLM's CUDA "
                               "build): pip install cuda-bindings") from exc
    return nvrtc


def _check(result: tuple, what: str) -> tuple:
    err, *rest = result
    if int(err) != 0:
        raise KernelBuildError(f"{what} failed: {err}")
    return tuple(rest)


def nvrtc_version() -> str:
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def source(name: str) -> str:
    return (SOURCES / name).read_text()


def headers() -> list[tuple[str, str]]:
    """(name, text) of the shared headers in kernels/cuda, which any source may #include."""
    return [(p.name, p.read_text()) for p in sorted(SOURCES.glob("*.cuh"))]


def options(arch: str, defines: dict[str, int]) -> list[str]:
    return [f"--gpu-architecture={arch}", "-std=c++17", "--device-int128", "-lineinfo",
            *(f"-D{k}={v}" for k, v in sorted(defines.items()))]


def compile_cubin(name: str, arch: str, defines: dict[str, int], log_ptxas: bool = False) -> tuple[bytes, str]:
    """(cubin, compiler log) of kernels/cuda/<name> for `arch` (e.g. "sm_90"); KernelBuildError with the log.

    A virtual `arch` ("compute_80") gives PTX instead, which the driver compiles for the GPU it loads on: the portable
    path (the code for sm_80) timed on a newer GPU."""
    nvrtc = _nvrtc()
    src = source(name).encode()
    opts = [o.encode() for o in options(arch, defines)] + ([b"--ptxas-options=-v"] if log_ptxas else [])
    hdrs = headers()
    (prog,) = _check(nvrtc.nvrtcCreateProgram(src, name.encode(), len(hdrs), [t.encode() for _, t in hdrs],
                                              [n.encode() for n, _ in hdrs]), "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffer it is given: a bytearray of our own. (`b" " * 1` is CPython's shared one-byte
        # object; an empty log wrote NUL into it, and every b" " in the process became b"\x00".)
        buf = bytearray(size)
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        text = buf.decode(errors="replace").rstrip("\x00 \n")
        if int(err) != 0:
            raise KernelBuildError(f"NVRTC could not compile {name} for {arch} ({defines}):\n{text}")
        if arch.startswith("compute_"):
            (size,) = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            ptx = bytearray(size)  # NUL-terminated, as cuModuleLoadData takes PTX
            _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            return bytes(ptx), text
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin), text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cache_key(name: str, arch: str, defines: dict[str, int]) -> str:
    h = hashlib.sha256(source(name).encode())
    for hname, text in headers():
        h.update(hname.encode() + text.encode())
    h.update(repr(options(arch, defines)).encode())
    h.update(nvrtc_version().encode())
    return f"{Path(name).stem}-{arch}-{h.hexdigest()[:20]}"


def cached_cubin(name: str, arch: str, defines: dict[str, int]) -> bytes:
    """The cubin from the cache, compiled (and cached atomically) on a miss."""
    from glyd_engine import paths
    from glyd_engine.atomic import atomic_path

    path = paths.cache_dir() / "kernels" / f"{cache_key(name, arch, defines)}.cubin"
    if path.exists():
        return path.read_bytes()
    for hook in on_compile:
        hook(f"{name} ({arch})")
    log.info("compiling Glyd CUDA kernels %s for %s %s (first use; cached in %s)", name, arch, defines, path.parent)
    cubin, _ = compile_cubin(name, arch, defines)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_bytes(cubin)
    return cubin


# -- loading and launching -------------------------------------------------------------------------------------
class I64(int):
    """A 64-bit integer kernel argument (plain ints are passed as 32-bit)."""


class Ptr(int):
    """A device address kernel argument that is not a tensor's (Ptr(0): a null pointer)."""


@dataclass
class Kernel:
    function: object
    name: str

    def __call__(self, grid: Sequence[int], block: Sequence[int], args: Sequence[object], smem: int = 0) -> None:
        import torch
        from cuda.bindings import driver

        vals, types = [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                vals.append(a.data_ptr())
                types.append(ctypes.c_void_p)
            elif isinstance(a, Ptr):
                vals.append(int(a))
                types.append(ctypes.c_void_p)
            elif isinstance(a, I64):
                vals.append(int(a))
                types.append(ctypes.c_longlong)
            elif isinstance(a, bool | int):
                vals.append(int(a))
                types.append(ctypes.c_int)
            elif isinstance(a, float):
                vals.append(a)
                types.append(ctypes.c_float)
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}")
        g = (*grid, 1, 1)[:3]
        b = (*block, 1, 1)[:3]
        stream = driver.CUstream(_current_stream(torch))
        (err,) = driver.cuLaunchKernel(self.function, *g, *b, smem, stream, (tuple(vals), tuple(types)), 0)
        if int(err) != 0:
            raise KernelBuildError(f"launching {self.name} failed: {err}")


def _current_stream(torch: object) -> int:
    """The current device's current stream (a capture's stream inside a CUDA graph): torch's raw-stream call, as
    Triton's launcher uses, which skips `torch.cuda.current_stream`'s device resolution (half a launch's host time)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream().cuda_stream
    return raw(torch._C._cuda_getDevice())


def device_arch(device: int | None = None) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def load(name: str, defines: dict[str, int], kernels: Sequence[str], device: int | None = None,
         arch: str | None = None) -> dict[str, Kernel]:
    """The named kernels of kernels/cuda/<name> built with `defines`, loaded on the current CUDA device (compiled for
    its architecture, or `arch`: "sm_90a" for Hopper's architecture-specific instructions)."""
    import torch
    from cuda.bindings import driver

    dev = torch.cuda.current_device() if device is None else device
    arch = arch or device_arch(dev)
    key = (dev, cache_key(name, arch, defines))
    with _lock:
        module = _modules.get(key)
        if module is None:
            cubin = cached_cubin(name, arch, defines)
            torch.cuda.init()
            with torch.cuda.device(dev):
                torch.cuda.current_stream(dev).synchronize()  # makes torch's (primary) context current here
                (module,) = _check(driver.cuModuleLoadData(cubin), f"loading {name}")
            _modules[key] = module
    out = {}
    for k in kernels:
        (fn,) = _check(driver.cuModuleGetFunction(module, k.encode()), f"finding {k} in {name}")
        out[k] = Kernel(fn, k)
    return out


def set_max_smem(kernel: Kernel, nbytes: int) -> None:
    """Let a kernel take more than 48 KiB of dynamic shared memory."""
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check((driver.cuFuncSetAttribute(kernel.function, attr, nbytes)[0],), "cuFuncSetAttribute")
    # the whole L1/shared split as shared memory, so several such blocks fit a multiprocessor
    carve = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    _check((driver.cuFuncSetAttribute(kernel.function, carve, 100)[0],), "cuFuncSetAttribute")


__all__ = ["I64", "Kernel", "KernelBuildError", "Ptr", "cached_cubin", "compile_cubin", "load", "nvrtc_version",
           "on_compile"]
