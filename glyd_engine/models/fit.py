"""Whether a model fits this machine's memory, judged before it is downloaded.

What the engine will hold: the weights as bf16 (a model stored in fp32 is rounded to bf16 on load, so half
its file size), the KV cache budget, and an allowance for the engine process itself (vLLM, torch and the
Python runtime). It is measured against free GPU memory on a CUDA build (nvidia-smi) and free RAM elsewhere.
The probe is a parameter, so callers and tests can say what is free.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from glyd_engine.machine import available_memory, cpu_build

ENGINE_ALLOWANCE_BYTES = 1 << 30  # vLLM, torch and the runtime in the engine process, besides weights and KV
DEFAULT_KV_BYTES = 256 << 20  # the app's CPU KV budget (EngineSettings.kv_cache_bytes)

MemoryProbe = Callable[[], tuple[int | None, str]]  # (bytes free, what they are: "free RAM", ...)


@dataclass(frozen=True)
class Fit:
    need_bytes: int
    free_bytes: int | None  # None: the machine does not say
    where: str

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.need_bytes <= self.free_bytes

    def describe(self) -> str:
        need = f"needs about {gib(self.need_bytes)}"
        if self.free_bytes is None:
            return f"{need}; {self.where} is unknown here"
        verdict = "fits" if self.fits else "does not fit"
        return f"{need}, {gib(self.free_bytes)} {self.where}: {verdict}"


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def machine_memory() -> tuple[int | None, str]:
    """Free GPU memory on a CUDA build with a GPU, else free RAM."""
    if not cpu_build() and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            return int(out.split()[0]) << 20, "free GPU memory"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    return available_memory(), "free RAM"


def estimate_fit(weights_bytes: int, stored_dtype: str, probe: MemoryProbe = machine_memory,
                 kv_bytes: int = DEFAULT_KV_BYTES) -> Fit:
    """The memory a model of `weights_bytes` on disk needs to run, against what `probe` says is free."""
    resident = weights_bytes // 2 if stored_dtype == "float32" else weights_bytes
    free, where = probe()
    return Fit(resident + kv_bytes + ENGINE_ALLOWANCE_BYTES, free, where)
