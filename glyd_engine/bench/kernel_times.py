"""Where a workload's device time goes: the kernels torch's profiler saw, largest total first.

The engine bench profiles a decode cell with it, so a gap between the kernels timed alone and the engine's tokens a
second (docs/benchmarks.md, "Inside vLLM on a GPU") can be traced to the kernels that make it up. Kernels replayed
from a CUDA graph are counted one by one (CUPTI reports a graph's kernel nodes). Where no CUDA device runs the
work (vLLM's CPU build), the operators' own CPU time stands in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def kernel_times(work: Callable[[], Any], top: int = 25) -> dict[str, Any]:
    """Runs `work` once under torch's profiler: {"device": "cuda"|"cpu", "total_ms", "kernels": [{"name", "calls",
    "ms", "share"}]} with the `top` largest by total time, their share of the total, the rest summed as one row."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        work()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us > 0 and (not cuda or ev.device_type == torch.autograd.DeviceType.CUDA):
            rows.append({"name": ev.key[:160], "calls": int(ev.count), "ms": us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    kept, rest = rows[:top], rows[top:]
    if rest:
        kept.append({"name": f"({len(rest)} others)", "calls": sum(r["calls"] for r in rest),
                     "ms": sum(r["ms"] for r in rest)})
    for r in kept:
        r["ms"] = round(r["ms"], 3)
        r["share"] = round(r["ms"] / total, 4) if total else 0.0
    return {"device": "cuda" if cuda else "cpu", "total_ms": round(total, 3), "kernels": kept}


def format_kernel_times(label: str, prof: dict[str, Any], rows: int = 12) -> str:
    """A few lines for a terminal: the largest kernels, their calls, time and share."""
    lines = [f"{label}: {prof['total_ms']:.1f} ms of {prof['device']} time"]
    for r in prof["kernels"][:rows]:
        lines.append(f"  {r['ms']:9.3f} ms {r['share']:6.1%} {r['calls']:6d}x  {r['name'][:90]}")
    return "\n".join(lines)
