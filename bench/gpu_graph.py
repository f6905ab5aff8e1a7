"""A decode step's attention layers launched from Python against replayed from one CUDA graph (bench/gpu.py).

What the GPU backend's full-graph support buys: vLLM runs a decode batch either as one captured graph (the backend
declares UNIFORM_SINGLE_TOKEN_DECODE) or with attention launched from Python between its piecewise graphs. Here,
36 layers of Qwen3-8B's shapes at 8k tokens, each a page write (one token a sequence, into its own store) and a
decode attention over the shared pool (each layer on its own random blocks); the graph step includes the host work
the metadata builder does before a replay (room reserved in each layer's overflow arena) and splits the context for
the longest one a graph may replay (`GRAPH_SPLIT_LEN`). Linears and the rest of the model are left out: both modes
run them in graphs. Per mode: wall ms a step over `STEPS` steps, the host issuing a step ahead of the GPU (it waits
for step n before issuing step n + 2, as vLLM's async scheduling does), the host's ms to issue a step, and the
writes or reservations that waited for the device.
"""

from __future__ import annotations

import time

import torch

from bench.gpu_pools import CONTEXT, LAYERS, Code
from glyd_engine.format import kv_page as kp
from glyd_kernels import kv_cuda, kv_overflow

STEPS = 30
GRAPH_SPLIT_LEN = 32768  # a server's max_model_len: the context a captured decode graph sizes its split for


def step_times(code: Code, batch: int, heads: int, q_heads: int, scale: float, nblocks: int, gen: torch.Generator,
               dev: str) -> dict[str, float]:
    lay, d = code.lay, code.lay.head_size
    nbs = CONTEXT // lay.block_size
    tables = [torch.randint(0, nblocks, (batch, nbs), generator=gen).to(torch.int32).to(dev) for _ in range(LAYERS)]
    lens = torch.full((batch,), CONTEXT, dtype=torch.int32, device=dev)
    q = torch.randn(batch, q_heads, d, generator=gen).to(torch.bfloat16).to(dev)
    out = torch.empty_like(q)
    k = torch.randn(batch, heads, d, generator=gen).to(torch.bfloat16).to(dev)
    v = torch.randn_like(k)
    slots = torch.arange(batch, device=dev) * kp.TILE  # a tile's first token: every step writes the same bytes
    stores = [(torch.zeros(batch, heads, lay.page_bytes, dtype=torch.uint8, device=dev),
               kp.OverflowStore(batch, heads, device=dev)) for _ in range(LAYERS)]
    runs = [kv_overflow.device_runs(o, d) for _, o in stores]

    def layers(split_len: int) -> None:
        for (cache, ovf), bt in zip(stores, tables, strict=True):
            kv_cuda.write(cache, lay, code.tops, ovf, k, v, slots)
            kv_cuda.decode_attention(q, code.cache, lay, code.tops, bt, lens, split_len, scale, code.ovf, out=out)

    def reserve() -> None:
        for r in runs:
            r.reserve(batch)

    layers(CONTEXT)  # compiled, loaded, arenas sized
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    reserve()
    with torch.cuda.graph(graph):
        layers(GRAPH_SPLIT_LEN)

    def graph_step() -> None:
        reserve()
        graph.replay()

    result: dict[str, float] = {"batch": batch, "splits_eager": kv_cuda.num_splits_for(batch, heads, CONTEXT),
                                "splits_graph": kv_cuda.num_splits_for(batch, heads, GRAPH_SPLIT_LEN)}
    for name, fn in (("eager", lambda: layers(CONTEXT)), ("graph", graph_step)):
        for _ in range(10):  # arenas grown to the steps' needs: the timed steps are the steady state
            fn()
        torch.cuda.synchronize()
        issue: list[float] = []
        done: list[torch.cuda.Event] = []
        waited = sum(r.checked for r in runs)
        t0 = time.perf_counter()
        for i in range(STEPS):
            if i >= 2:
                done[i - 2].synchronize()
            t = time.perf_counter()
            fn()
            issue.append(time.perf_counter() - t)
            done.append(torch.cuda.Event())
            done[-1].record()
        torch.cuda.synchronize()
        result[f"{name}_ms"] = (time.perf_counter() - t0) * 1e3 / STEPS
        result[f"{name}_issue_ms"] = sorted(issue)[len(issue) // 2] * 1e3
        result[f"{name}_waits"] = sum(r.checked for r in runs) - waited
    gpu0, gpu1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    gpu0.record()
    for _ in range(STEPS):
        graph.replay()
    gpu1.record()
    torch.cuda.synchronize()
    result["graph_gpu_ms"] = gpu0.elapsed_time(gpu1) / STEPS
    result["eager_vs_graph"] = result["eager_ms"] / result["graph_ms"]
    return result


def print_steps(rows: list[dict[str, float]]) -> None:
    print(f"\ndecode step, {LAYERS} layers of page write + decode attention at {CONTEXT} tokens (4-bit code): "
          "launched from Python vs one CUDA graph\n| batch | splits (eager / graph) | eager ms a step "
          "| graph ms a step | graph GPU ms | host ms to issue (eager / graph) | waits (eager / graph) "
          f"of {LAYERS * STEPS} | eager / graph |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['splits_eager']} / {r['splits_graph']} | {r['eager_ms']:.3f} | {r['graph_ms']:.3f} "
              f"| {r['graph_gpu_ms']:.3f} | {r['eager_issue_ms']:.3f} / {r['graph_issue_ms']:.3f} | "
              f"{r['eager_waits']} / {r['graph_waits']} | {r['eager_vs_graph']:.2f}x |")
