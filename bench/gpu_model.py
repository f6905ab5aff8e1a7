"""The throughput model of bench/gpu.py: decode tokens a second of a Qwen3-8B-shaped model on an H200 with each KV
cache at the largest batch of 8k-token sequences its memory holds (docs/gpu.md, "Throughput model").

step = 36 x (attention + page write + qkv + o + gate_up + down) + lm_head, every part timed in the same run at the
batch its cache holds: attention is bench/gpu.py's decode-attention row at that batch (FlashAttention 3 on bf16 pages
for the bf16 cache, the faster of its two calls; vLLM's Triton kernel where FlashAttention 3 was not run), the page
write is one decode token a sequence, the linears are cuBLAS on bf16 weights (the same weights for every cache: the
model compares caches). Norms, rotary, activation, sampling and vLLM's own
bf16 cache write are left out, which favours bf16. tokens/s = batch / step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from bench.gpu_bars import bf16_attention_ms
from bench.gpu_linear import SHAPES
from bench.gpu_pools import CONTEXT, LAYERS, Code, Pools, bench_fn
from glyd_engine.format.kv_page import TILE

LM_HEAD = (4096, 151936)  # K -> N
ROTATE_BYTES = 320 << 20  # weights timed in turn past the L2


def batches(kv_gib: float, pools: Pools | None, heads: int, head_size: int) -> dict[str, int]:
    """Sequences of CONTEXT tokens that kv_gib of KV memory holds across the model's layers, for each cache (bf16
    alone without pools). A page code's token costs its page bytes and its share of the overflow run pointers (8 bytes
    a tile and head)."""
    per_token = {"bf16": 4 * heads * head_size}
    if pools is not None:
        per_token |= {f"code{cb}": heads * (code.lay.token_bytes + 8 / TILE) for cb, code in pools.codes.items()}
    return {name: int(kv_gib * 2**30 // (b * LAYERS * CONTEXT)) for name, b in per_token.items()}


def linear_ms(rows: int, dev: str, gen: torch.Generator) -> dict[str, float]:
    """cuBLAS time of each linear of a layer and of lm_head at `rows` rows (weights rotated past the L2)."""
    out = {}
    for name, (k, n) in {**SHAPES, "lm_head": LM_HEAD}.items():
        copies = max(1, math.ceil(ROTATE_BYTES / (2 * n * k)))
        ws = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
        out[name] = bench_fn(lambda ws=ws, x=x: [torch.matmul(x, w.T) for w in ws]) / copies
        del ws
    torch.cuda.empty_cache()
    return out


def write_ms(code: Code, rows: int, dev: str) -> dict[str, float]:
    """One decode token for each of `rows` sequences, the first of its tile (so that every replay writes the same
    bytes): the kernel alone (replayed from a CUDA graph), which is what a step's GPU time holds when the call does not
    wait; whether it waits, counted over modelled steps (a store a layer, each write followed by GPU work of about a
    layer's attention and linears, a sleep kernel, one sync at the step's end: the host runs ahead as in serving); and
    the host time of a call (Python and launch, overlapped with the GPU's work in a step)."""
    import triton.testing as tt

    from glyd_kernels import kv_cuda, kv_overflow

    lay, h = code.lay, code.cache.shape[1]
    k = torch.randn(rows, h, lay.head_size, device=dev).to(torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(rows, device=dev) * TILE
    layers = [(torch.zeros(rows, h, lay.page_bytes, dtype=torch.uint8, device=dev),
               type(code.ovf)(rows, h, device=dev)) for _ in range(LAYERS)]
    for cache, ovf in layers:
        kv_cuda.write(cache, lay, code.tops, ovf, k, v, slots)  # each arena sized by its first write
    cache, ovf = layers[0]
    need = kv_overflow.device_runs(ovf, lay.head_size).need_for(rows)
    kernel = bench_fn(lambda: kv_cuda.launch_write(cache, lay, code.tops, ovf, k, v, slots, need))
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda._sleep(1 << 20)
    t1.record()
    torch.cuda.synchronize()
    cycles = int((1 << 20) * 0.8 / t0.elapsed_time(t1))  # ~0.8 ms a layer

    def waits(steps: int, ahead: int) -> int:
        """Checked calls in `steps` steps, the host syncing every `ahead` steps (2: a step ahead, as with vLLM's
        async scheduling)."""
        before = sum(kv_overflow.device_runs(o, lay.head_size).checked for _, o in layers)
        for s in range(steps):
            for c, o in layers:
                kv_cuda.write(c, lay, code.tops, o, k, v, slots)
                torch.cuda._sleep(cycles)
            if (s + 1) % ahead == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return sum(kv_overflow.device_runs(o, lay.head_size).checked for _, o in layers) - before

    steps = 12
    host = float(tt.do_bench(lambda: kv_cuda.write(cache, lay, code.tops, ovf, k, v, slots), warmup=5, rep=50,
                             return_mode="median"))
    return {"kernel": kernel, "waits": waits(steps, 1), "waits_a_step_ahead": waits(steps, 2), "writes": steps * LAYERS,
            "call_host_ms": host}


def throughput_model(pools: Pools, attention_row: Callable[[int, int], dict[str, object]], dev: str, kv_gib: float,
                     heads: int, head_size: int) -> dict[str, object]:
    """Each cache's batch, per-layer times, step and tokens a second; ratios against the bf16 cache (FlashAttention 3),
    with the page write as its kernel alone, and whether the backend's call waits (`write_ms`). `attention_row`
    (batch, context) is bench/gpu.py's timed row: every kernel at that shape, side by side."""
    sizes = batches(kv_gib, pools, heads, head_size)
    tgen = torch.Generator(device=dev).manual_seed(7)
    attn_rows = {s: attention_row(s, CONTEXT) for s in sorted(set(sizes.values()))}
    result: dict[str, object] = {"kv_gib": kv_gib, "context": CONTEXT, "layers": LAYERS, "caches": {}}
    for name, s in sizes.items():
        row = attn_rows[s]
        attn = (bf16_attention_ms(row) or math.nan) if name == "bf16" else row[f"{name}_ms"]
        lin = linear_ms(s, dev, tgen)
        write = {"kernel": 0.0} if name == "bf16" else write_ms(
            pools.codes[int(name[4:])], s, dev)
        layer_lin = sum(v for k, v in lin.items() if k != "lm_head")
        entry: dict[str, object] = {"batch": s, "attention_ms": attn, "write_ms": write, "linears_ms": lin}
        step = LAYERS * (attn + write["kernel"] + layer_lin) + lin["lm_head"]
        entry["step_ms"] = step
        entry["tokens_per_s"] = s / (step / 1e3)
        result["caches"][name] = entry
    ref = result["caches"]["bf16"]["tokens_per_s"]
    for entry in result["caches"].values():
        entry["vs_bf16"] = entry["tokens_per_s"] / ref
    return result


def print_model(model: dict[str, object]) -> None:
    print(f"\nthroughput model: {model['kv_gib']} GiB of KV, {model['context']}-token sequences, {model['layers']} "
          "layers\n| cache | batch | attention ms | write ms (kernel; waits, a step ahead / writes; host ms a call)"
          " | linears ms | step ms | tokens/s | vs bf16 |\n|---|---|---|---|---|---|---|---|")
    for name, e in model["caches"].items():
        lin = sum(v for k, v in e["linears_ms"].items() if k != "lm_head")
        w = e["write_ms"]
        wt = "-" if name == "bf16" else (f"{w['kernel']:.4f}; {w['waits']}, {w['waits_a_step_ahead']} / {w['writes']}; "
                                          f"{w['call_host_ms']:.3f}")
        print(f"| {name} | {e['batch']} | {e['attention_ms']:.3f} | {wt} | {lin:.3f} | {e['step_ms']:.2f} | "
              f"{e['tokens_per_s']:.0f} | {e['vs_bf16']:.2f}x |")
