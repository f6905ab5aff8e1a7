"""The read-only stream rate of the GPU, the yardstick of bench/gpu.py's bandwidth bar (issue 29).

Decode attention only reads its pages, so its ceiling is a kernel that only reads, not a copy (which also writes and
runs slower on Hopper: ~4.2 against ~4.55 TB/s on the H200). Readers over the same >= 4 GiB bf16 buffer of random
values: a Triton kernel in two sizes (16-byte loads, one fp32 sum a program) and torch's sum; each captured in a CUDA
graph, its best replay of several timed with CUDA events. The rate is the fastest reader's (the stricter yardstick).
The Triton kernel's sums are checked against torch's, so a reader that skipped bytes cannot set the rate.

Needs Triton and a GPU; bench/gpu.py imports it only when it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

CONFIGS = ((4096, 4), (16384, 8))  # (bf16 values a program, warps): 64 and 128 bytes a thread
READ_BYTES = 4 << 30


@triton.jit
def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202, N803
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + pid, tl.sum(x.to(tl.float32), axis=0))


def best_replay_ms(fn: Callable[[], object], replays: int = 20) -> float:
    """The fastest of `replays` timed replays of fn captured in a CUDA graph (fn run once before, to compile)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1))
    return min(times)


def read_only_rate(dev: str, nbytes: int = READ_BYTES) -> dict[str, object]:
    """TB/s of each reader and the best ("TBps"); raises if a Triton reader's sums are wrong or it fails (torch's
    sum failing is logged: the Triton readers alone set the rate then)."""
    n = nbytes // 2 // max(b for b, _ in CONFIGS) * max(b for b, _ in CONFIGS)
    result = _rates(torch.empty(n, dtype=torch.bfloat16, device=dev).normal_())  # random, never zeros (METHOD.md)
    torch.cuda.empty_cache()  # the buffer went with _rates
    return result


def _rates(x: torch.Tensor) -> dict[str, object]:
    n = x.numel()
    read = 2 * n
    result: dict[str, object] = {"bytes": read}
    rates = []
    for block, warps in CONFIGS:
        programs = n // block
        partial = torch.empty(programs, dtype=torch.float32, device=x.device)

        def triton_read(block: int = block, warps: int = warps, programs: int = programs,
                        partial: torch.Tensor = partial) -> None:
            _read_kernel[(programs,)](x, partial, BLOCK=block, num_warps=warps)

        ms = best_replay_ms(triton_read)
        partial.fill_(float("nan"))
        triton_read()
        rows = x.view(programs, block)
        for part in (slice(0, 2048), slice(programs - 2048, programs)):  # the first and last programs, checked
            if not torch.allclose(partial[part], rows[part].float().sum(1), rtol=1e-4, atol=2e-3):
                raise RuntimeError(f"the read-only Triton kernel ({block} values, {warps} warps) sums differ from "
                                   "torch's: it did not read every byte")
        result[f"triton_{block}_{warps}w_TBps"] = read / ms / 1e9
        rates.append(read / ms / 1e9)
    try:
        ms = best_replay_ms(lambda: torch.sum(x, dtype=torch.float32))
        result["torch_sum_TBps"] = read / ms / 1e9
        rates.append(read / ms / 1e9)
    except Exception as exc:  # the rate stands on the Triton readers
        result["torch_sum_failed"] = repr(exc)[:300]
    result["TBps"] = max(rates)
    return result
