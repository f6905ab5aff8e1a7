"""GPU benchmark of the compressed-KV kernels at Qwen3-8B shapes (one call of the device tool runs it all).

Shapes: 32 query heads, 8 KV heads, head 128, block 16 (one attention layer). K/V come from the demo
model's recordings (bench/kv_samples/smollm2_kv.safetensors, made by make_samples.py): token rows are
resampled per KV head and the 64 recorded channels tiled to 128, so every channel's exponent statistics are
the model's; the exponent tables (a 7-exponent window per channel) and the escape reserve come from the same
samples.

It measures, in one run: the copy bandwidth; correctness (decoded pages bit for bit against the bf16
source, attention against an fp32 reference, the same bits twice); then for batch x context, decode
attention of (a) our kernel on compressed pages (its default launch, and every config of a small sweep),
(b) vLLM 0.33's Triton unified attention on bf16 pages
(carried under .baseline/, see /work/shared/tools/vllm-triton-baseline), (c) torch SDPA on contiguous bf16,
each timed under CUDA graphs (median, inputs rotated when they would fit in L2); prefill and mixed batches
(`kv_prefill_attention` against vLLM's unified attention, `--only-prefill` stops there); the decode throughput
model of docs/gpu.md (`--no-model` skips it); and page-write throughput (a sweep of the writer's tiles).

Run (device):  PYTHONUNBUFFERED=1 python3 bench/gpu.py --out $OUT
Smoke (CPU):   TRITON_INTERPRET=1 .venv/bin/python bench/gpu.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / ".baseline"))

import torch  # noqa: E402

from glyd_engine.format import bf16  # noqa: E402
from glyd_engine.format.kv_page import ESCAPE, KVPageLayout, encode_table  # noqa: E402
from glyd_engine.tables.build import counts_to_tables  # noqa: E402
from kernels.kv_decode_attention import (  # noqa: E402
    decode_config,
    decode_pages,
    kv_decode_attention,
    num_splits_for,
    pack_bases,
)
from kernels.kv_layer import TritonKVLayer  # noqa: E402
from kernels.kv_page_write import DeviceOverflowStore, PageWriter  # noqa: E402
from kernels.kv_prefill_attention import kv_prefill_attention, reference_prefill_attention  # noqa: E402

HQ, H, D, B = 32, 8, 128, 16
SAMPLES = ROOT / "bench" / "kv_samples" / "smollm2_kv.safetensors"
LOG: dict[str, object] = {}


def log(key: str, value: object, out: Path | None) -> None:
    LOG[key] = value
    if out is not None:
        (out / "gpu_bench.json").write_text(json.dumps(LOG, indent=1, default=str))


class Source:
    """Resamples recorded K/V rows into [N, 8, 128] bf16 with the recorded per-channel statistics."""

    def __init__(self, layer: int, device: str, gen: torch.Generator) -> None:
        from safetensors.torch import load_file

        rec = load_file(str(SAMPLES))
        tiled = []
        for kv in ("k", "v"):
            x = rec[f"{kv}{layer}"]  # [T, 3, 64]
            heads = []
            for h in range(H):  # head h, channel c <- recorded head (h + c // 64) % 3, channel c % 64
                heads.append(torch.cat([x[:, h % 3], x[:, (h + 1) % 3]], dim=-1))
            tiled.append(torch.stack(heads, dim=1).to(device))  # [T, 8, 128]
        self.k, self.v = tiled
        self.n = self.k.shape[0]
        self.gen = gen
        self.device = device

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, self.n, (n, H), generator=self.gen, device="cpu").to(self.device)
        hh = torch.arange(H, device=self.device).view(1, H)
        return self.k[idx, hh], self.v[idx, hh]

    def tables(self, margin: float = 1.3) -> tuple[torch.Tensor, int, int]:
        counts = torch.zeros(1, 2, H, D, 256, dtype=torch.int64)
        for kv, x in enumerate((self.k, self.v)):
            e, _ = bf16.split(x.cpu())
            counts[0, kv] = torch.nn.functional.one_hot(e.to(torch.int64), 256).sum(0)
        decode, _, _ = counts_to_tables(counts)
        c = counts.to(torch.float64)
        held = torch.gather(c, -1, decode.to(torch.int64)).sum(-1)
        per_token = (1 - held / c.sum(-1)).sum(-1)  # [1, 2, H]: mean escapes a token
        res = [max(1, math.ceil(margin * float(per_token[0, kv].max()))) for kv in (0, 1)]
        return decode[0], res[0], res[1]


def _reserve_bytes_via_cpu(orig):  # noqa: ANN001, ANN202
    """Run the reference allocator (a host-side loop) on a CPU copy of `ptr` and write the copy back.

    The fallback for an allocator that fails on the device (it did before kv_page.py's fix of 2026-11-30): the
    bench tries the device path first and logs which one it used."""
    def reserve_bytes(self, blocks, heads, kv, need):  # noqa: ANN001, ANN202
        dev_ptr = self.ptr
        self.ptr = dev_ptr.cpu()
        try:
            off = orig(self, blocks.cpu(), heads.cpu(), kv, need.cpu())
        finally:
            dev_ptr.copy_(self.ptr)
            self.ptr = dev_ptr
        return off.to(blocks.device)
    return reserve_bytes


MODEL_CONTEXT = 8192
QWEN3_8B_LAYERS = 36
LM_HEAD = (4096, 151936)  # K -> N: Qwen3-8B's lm_head (not tied to the embedding)


def model_batch(kv_bytes: float, token_bytes_per_layer: int) -> int:
    """Sequences of MODEL_CONTEXT tokens a cache of kv_bytes holds across Qwen3-8B's layers."""
    return int(kv_bytes // (token_bytes_per_layer * QWEN3_8B_LAYERS * MODEL_CONTEXT))


def throughput_model(batches: dict[str, int], attn: dict[str, float], dev: str) -> dict[str, object]:
    """Decode tokens a second of a Qwen3-8B-shaped model from per-layer kernel timings (docs/gpu.md, "Throughput
    model"): step = 36 x (attention + page write + qkv + o + gate_up + down) + lm_head, each at the batch its
    cache holds; norms, rotary, activation and sampling are left out (the same work in both)."""
    from bench import gpu_linear
    from glyd_engine.format import resident
    from kernels import resident_linear as rl

    gen = torch.Generator(device=dev).manual_seed(1)
    shapes = {**gpu_linear.SHAPES, "lm_head": LM_HEAD}
    lin: dict[str, float] = {}
    for name, (k, n) in shapes.items():
        w = gpu_linear.weight(n, k, dev, gen)
        r = resident.from_bf16(w)
        plan = rl.escape_plan(r)
        copies = max(1, -(-gpu_linear.ROTATE_BYTES // (2 * n * k)))
        ws, rs = gpu_linear.rotated_copies(w, r, copies)
        for kind, S in batches.items():
            x = torch.randn(S, k, device=dev, generator=gen).to(torch.bfloat16)
            lin[f"bf16_{name}_b{S}"] = gpu_linear.timed([lambda ww=ww, x=x: torch.matmul(x, ww.T) for ww in ws], True)
            if kind == "glyd":  # what the glyd op runs at this many rows (weights.py)
                if S <= rl.FUSED_ROWS:
                    fns = [lambda rr=rr, x=x, p=plan: rl.resident_linear(x, rr, p) for rr in rs]
                else:
                    fns = [lambda rr=rr, x=x: torch.matmul(x, rl.resident_decode(rr).T) for rr in rs]
                lin[f"glyd_{name}_b{S}"] = gpu_linear.timed(fns, True)
        del ws, rs
        torch.cuda.empty_cache()
    bb, gb = batches["bf16"], batches["glyd"]
    layer = [n for n in shapes if n != "lm_head"]

    def step(b: int, attention: float, write: float, weights: str) -> float:
        per_layer = attention + write + sum(lin[f"{weights}_{n}_b{b}"] for n in layer)
        return QWEN3_8B_LAYERS * per_layer + lin[f"{weights}_lm_head_b{b}"]

    steps = {"bf16": step(bb, attn.get(f"vllm_b{bb}", float("nan")), 0.0, "bf16"),
             "glyd_kv_bf16_weights": step(gb, attn[f"glyd_b{gb}"], attn[f"write_b{gb}"], "bf16"),
             "glyd": step(gb, attn[f"glyd_b{gb}"], attn[f"write_b{gb}"], "glyd")}
    tok = {k: (bb if k == "bf16" else gb) / (v / 1e3) for k, v in steps.items()}
    return {"linear_ms": lin, "step_ms": steps, "tokens_per_s": tok,
            "ratio_vs_bf16": {k: v / tok["bf16"] for k, v in tok.items() if k != "bf16"}}


PREFILL_CASES = {  # name: (tokens in the pages per sequence, this step's queries per sequence)
    "prefill 4 x 2048": ([2048] * 4, [2048] * 4),
    "chunk 8 x 512 after 7680": ([8192] * 8, [512] * 8),
    "mixed 16 decodes at 4k + prefill 1024": ([4096] * 16 + [1024], [1] * 16 + [1024]),
}
SWEEP_PREFILL_CASES = ("prefill 4 x 2048", "chunk 8 x 512 after 7680")  # the launch sweep runs on these
SMOKE_PREFILL_CASES = {"mixed": ([33, 40, 37], [1, 40, 5])}  # a decode first: the routed path too


def prefill_section(pool, unified_attention, gen: torch.Generator, dev: str, smoke: bool) -> dict[str, object]:
    """Prefill / mixed-batch attention on compressed pages against fp32 (poisoned, twice) and, on the GPU, timed
    against vLLM's unified attention on bf16 pages with the same varlen batch."""
    cache, lay, tab, ovf, k_pool, v_pool, dec_dev = pool
    layer = TritonKVLayer(lay, dec_dev, cache)  # the backend's routing: decodes first to the decode kernel
    layer.overflow = ovf
    nblocks = cache.shape[0]
    scale = D ** -0.5
    res: dict[str, object] = {}
    for name, (lens, q_lens) in (SMOKE_PREFILL_CASES if smoke else PREFILL_CASES).items():
        row: dict[str, object] = {}
        try:
            nbs = [(n + B - 1) // B for n in lens]
            ids = torch.randperm(nblocks, generator=gen)[: sum(nbs)]
            bt = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
            used = 0
            for i, nb in enumerate(nbs):
                bt[i, :nb] = ids[used : used + nb].to(torch.int32)
                used += nb
            bt = bt.to(dev)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            start = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32, device=dev)
            q = torch.randn(sum(q_lens), HQ, D, generator=gen).to(torch.bfloat16).to(dev)
            spans = list(enumerate(zip(nbs, lens, strict=True)))
            ks = [k_pool[bt[i, :nb].long()].reshape(-1, H, D)[:n] for i, (nb, n) in spans]
            vs = [v_pool[bt[i, :nb].long()].reshape(-1, H, D)[:n] for i, (nb, n) in spans]
            ref = reference_prefill_attention(q, start.cpu(), ks, vs, scale)
            # the step's own K/V, row for row with the queries, as the backend passes them (the pages hold them too)
            own = {"key": torch.cat([k[n - m:] for k, n, m in zip(ks, lens, q_lens, strict=True)]),
                   "value": torch.cat([v[n - m:] for v, n, m in zip(vs, lens, q_lens, strict=True)])}

            def ours(out_t, kw, q=q, bt=bt, seq_lens=seq_lens, start=start, q_lens=q_lens, own=own):  # noqa: ANN001, ANN202
                return lambda: kv_prefill_attention(q, cache, lay, tab, bt, seq_lens, start, max(q_lens), scale, ovf,
                                                    out=out_t, **{**own, **kw})
            if not smoke and name in SWEEP_PREFILL_CASES:  # tokens a program x warps x pages x fresh keys a tile
                sweep = {}
                for bq, w, pg, bf in ((32, 8, 1, 32), (64, 8, 1, 32), (64, 8, 1, 64), (64, 16, 1, 32),
                                      (128, 16, 1, 32), (64, 8, 2, 32)):
                    kw_s = {"block_q": bq, "num_warps": w, "pages": pg, "block_f": bf}
                    try:
                        sweep[f"q{bq}w{w}p{pg}f{bf}"] = bench_fn(ours(torch.empty_like(q), kw_s), True)
                    except Exception as exc:  # noqa: BLE001
                        sweep[f"q{bq}w{w}p{pg}f{bf}"] = repr(exc)[:120]
                row["sweep_ms"] = sweep
            kw: dict[str, object] = {}  # the defaults: what the backend runs
            o1, o2 = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
            ours(o1, kw)()
            ours(o2, kw)()
            row["rel_err"] = float((o1.float() - ref).norm() / ref.norm())
            row["nan"] = bool(o1.isnan().any())
            row["deterministic"] = bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16)))
            o4 = torch.full_like(q, float("nan"))
            ours(o4, {**kw, "key": None, "value": None})()  # every key from the pages
            row["pages_only_rel_err"] = float((o4.float() - ref).norm() / ref.norm())
            if not smoke:
                row["ours_ms"] = bench_fn(ours(o1, kw), True)
                row["pages_only_ms"] = bench_fn(ours(o4, {**kw, "key": None, "value": None}), True)
                if unified_attention is not None:
                    n_q = q.shape[0]
                    sc = (torch.empty(n_q, HQ, 16, D, dtype=torch.float32, device=dev),
                          torch.empty(n_q, HQ, 16, dtype=torch.float32, device=dev),
                          torch.empty(n_q, HQ, 16, dtype=torch.float32, device=dev))
                    ov = torch.full_like(q, float("nan"))

                    def vllm(q=q, bt=bt, seq_lens=seq_lens, start=start, q_lens=q_lens, lens=lens, sc=sc, ov=ov):  # noqa: ANN001, ANN202
                        unified_attention(q, k_pool, v_pool, ov, start, max(q_lens), seq_lens, max(lens), scale, True,
                                          (-1, -1), bt, 0, None, None, None, seq_threshold_3D=128 // H,
                                          num_par_softmax_segments=16, softmax_segm_output=sc[0],
                                          softmax_segm_max=sc[1], softmax_segm_expsum=sc[2])
                    vllm()
                    row["vllm_rel_err"] = float((ov.float() - ref).norm() / ref.norm())
                    row["vllm_ms"] = bench_fn(vllm, True)
                    row["speedup_vs_vllm"] = row["vllm_ms"] / row["ours_ms"]
                    row["pages_only_speedup_vs_vllm"] = row["vllm_ms"] / row["pages_only_ms"]
            nd = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))  # leading decode tokens
            if 0 < nd < len(q_lens):  # as the backend runs it: decodes to the decode kernel, the rest to prefill
                def routed(out_t, q=q, bt=bt, seq_lens=seq_lens, start=start, q_lens=q_lens, lens=lens, nd=nd, own=own):  # noqa: ANN001, ANN202
                    return lambda: layer.attend(q, out_t, bt, seq_lens, start, max(q_lens), max(lens), scale, nd,
                                                **own)
                o3 = torch.full_like(q, float("nan"))
                routed(o3)()
                row["routed_rel_err"] = float((o3.float() - ref).norm() / ref.norm())
                row["routed_nan"] = bool(o3.isnan().any())
                if not smoke:
                    row["routed_ms"] = bench_fn(routed(o3), True)
                    if "vllm_ms" in row:
                        row["routed_speedup_vs_vllm"] = row["vllm_ms"] / row["routed_ms"]
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:300]
            traceback.print_exc()
        res[name] = row
        print("prefill", name, row, flush=True)
    return res


def bench_fn(fn, graphs: bool) -> float:  # noqa: ANN001
    """Median ms of fn, replayed from a CUDA graph when `graphs`."""
    import triton.testing as tt

    if graphs:
        return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))
    return float(tt.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def copy_bandwidth(dev: str) -> float:
    import triton.testing as tt

    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda a=a, b=b: b.copy_(a), warmup=5, rep=50, return_mode="median")
    return 2 * n / ms / 1e9  # TB/s: bytes / (ms * 1e-3) / 1e12


def check_decode(checks, gen, nblocks, dev, cache, lay, tab, ovf, k_pool, v_pool) -> None:  # noqa: ANN001
    """Decoded pages (the attention kernel's decoder) against the bf16 source, bit for bit."""
    blocks = torch.randperm(nblocks, generator=gen)[: min(nblocks, 4096)].to(dev)
    held = (ovf.ptr >= 0).any(-1).any(-1).nonzero().flatten()[:65536]  # blocks with an overflow run
    checks["decode_pages_checked"] = int(blocks.numel())
    checks["overflow_blocks_checked"] = int(held.numel())
    for key, ids in (("decode", blocks), ("overflow_blocks", held)):
        if ids.numel():
            dk, dv = decode_pages(cache, lay, tab, ids, ovf)
            checks[f"{key}_bit_exact"] = bool(
                torch.equal(dk.view(torch.int16), k_pool[ids].transpose(1, 2).view(torch.int16))
                and torch.equal(dv.view(torch.int16), v_pool[ids].transpose(1, 2).view(torch.int16)))


def main() -> None:  # noqa: C901, PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter, no timing")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--kv-gib", type=float, default=100.0, help="KV memory of the throughput model (both caches)")
    ap.add_argument("--no-model", action="store_true", help="skip the throughput model")
    ap.add_argument("--only-prefill", action="store_true", help="stop after the prefill / mixed-batch section")
    ap.add_argument("--no-writes", action="store_true", help="skip the page-write sweep")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill / mixed-batch section")
    args = ap.parse_args()
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    batches = [1, 2] if smoke else [int(x) for x in args.batches.split(",")]
    contexts = [40, 300] if smoke else [int(x) for x in args.contexts.split(",")]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    info = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__}
    import triton

    info["triton"] = triton.__version__
    if not smoke:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, mem_gb=round(p.total_memory / 2**30, 1))
    print("env", info)
    log("env", info, out)

    copy_tbs = None
    if not smoke:
        copy_tbs = copy_bandwidth(dev)
        print(f"copy bandwidth {copy_tbs:.2f} TB/s (read + write)")
        log("copy_TBps", copy_tbs, out)

    src = Source(args.layer, dev, gen)
    dec, e_k, e_v = src.tables()
    lay = KVPageLayout(D, B, e_k, e_v)
    dec_dev = dec.to(dev)
    tab = pack_bases(dec_dev)
    writer = PageWriter(lay, dec_dev)
    print(f"layout: E_k={e_k} E_v={e_v} C={lay.token_bytes} B/token/head, {8 * lay.token_bytes / (2 * D):.3f} bits "
          f"a value, {4 * D / lay.token_bytes:.3f}x tokens vs bf16")
    log("layout", {"E_k": e_k, "E_v": e_v, "token_bytes": lay.token_bytes, "page_bytes": lay.page_bytes}, out)

    # Escape statistics of the generated data (per value).
    kx, vx = src.draw(4096)
    enc = encode_table(dec)
    for kv, x in ((0, kx), (1, vx)):
        e, _ = bf16.split(x.cpu())
        idx = (torch.arange(H).view(1, H, 1) * D + torch.arange(D)) * 256 + e.to(torch.int64)
        rate = float((torch.take(enc[kv], idx) == ESCAPE).float().mean())
        log(f"escape_rate_{'kv'[kv]}", rate, out)
        print(f"escape rate {'KV'[kv]}: {rate:.4f}")

    # --- the pools: every combination takes its blocks from one pool --------------------------------
    # the grid's, and the fixed accuracy cases' (64 x 8k at most)
    max_tokens = max(batches) * max(contexts) if smoke else max(max(batches) * max(contexts), 64 * 8192)
    model_batches = None
    if not smoke and not args.no_model:
        model_batches = {kind: model_batch(args.kv_gib * 2**30, per_token) for kind, per_token in
                         (("bf16", 4 * D * H), ("glyd", lay.token_bytes * H))}
        max_tokens = max(max_tokens, max(model_batches.values()) * MODEL_CONTEXT)
    nblocks = max_tokens // B + 64
    cache = torch.empty(nblocks, H, lay.page_bytes, dtype=torch.uint8, device=dev)
    k_pool = torch.empty(nblocks, B, H, D, dtype=torch.bfloat16, device=dev)
    v_pool = torch.empty_like(k_pool)
    ovf = DeviceOverflowStore(nblocks, H, device=dev)
    chunk_blocks = 64 if smoke else 4096
    t0 = time.time()
    overflow_path = "device"
    for b0 in range(0, nblocks, chunk_blocks):
        nb = min(chunk_blocks, nblocks - b0)
        k, v = src.draw(nb * B)
        k_pool[b0 : b0 + nb] = k.view(nb, B, H, D)
        v_pool[b0 : b0 + nb] = v.view(nb, B, H, D)
        slots = torch.arange(b0 * B, (b0 + nb) * B, device=dev)
        try:
            writer.write(cache, ovf, k, v, slots)
        except RuntimeError as exc:  # the overflow allocator on the device: fall back to a CPU copy, say so
            if overflow_path != "device" or smoke:
                raise
            overflow_path = f"cpu copy ({exc!r:.200})"
            print("overflow allocation on the device failed; using a CPU copy:", exc)
            DeviceOverflowStore.reserve_bytes = _reserve_bytes_via_cpu(DeviceOverflowStore.reserve_bytes)
            writer.write(cache, ovf, k, v, slots)
    if not smoke:
        torch.cuda.synchronize()
    log("pool", {"blocks": nblocks, "seconds": time.time() - t0, "overflow_values": writer.counters.overflow_values,
                 "overflow_allocation": overflow_path,
                 "overflow_runs": ovf.runs_in_use, "overflow_bytes": ovf.bytes_held,
                 "values": writer.counters.values}, out)
    print(f"pool: {nblocks} blocks in {time.time() - t0:.1f} s; overflow values {writer.counters.overflow_values} "
          f"({ovf.runs_in_use} runs, {ovf.bytes_held} B) of {writer.counters.values}")

    # --- correctness ---------------------------------------------------------------------------------
    checks: dict[str, object] = {}
    try:
        check_decode(checks, gen, nblocks, dev, cache, lay, tab, ovf, k_pool, v_pool)
    except Exception as exc:  # noqa: BLE001
        checks["error"] = repr(exc)[:300]
        traceback.print_exc()
    print("checks", checks)
    log("checks", checks, out)

    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as exc:  # noqa: BLE001
        unified_attention = None
        print("vLLM baseline unavailable:", exc)
        log("vllm_error", repr(exc), out)

    scale = D ** -0.5

    def make_case(S: int, L: int, first_block: int):  # noqa: ANN202
        nbs = (L + B - 1) // B
        bt = (first_block + torch.randperm(S * nbs, generator=gen).view(S, nbs)).to(torch.int32).to(dev)
        lens = torch.full((S,), L, dtype=torch.int32, device=dev)
        q = torch.randn(S, HQ, D, generator=gen).to(torch.bfloat16).to(dev)
        return bt, lens, q

    def ours(q, bt, lens, L, out_t, cfg=None):  # noqa: ANN001, ANN202
        kw = dict(zip(("pages", "num_warps", "num_stages", "prefetch", "ovf_branch"), cfg or (), strict=False))
        return lambda: kv_decode_attention(q, cache, lay, tab, bt, lens, L, scale, ovf, out=out_t, **kw)

    def vllm_fn(q, bt, lens, L, out_t, scratch):  # noqa: ANN001, ANN202
        S = q.shape[0]
        cu = torch.arange(S + 1, dtype=torch.int32, device=dev)
        so, sm, se = scratch
        return lambda: unified_attention(q, k_pool, v_pool, out_t, cu, 1, lens, L, scale, True, (-1, -1), bt, 0,
                                         None, None, None, seq_threshold_3D=128 // H, num_par_softmax_segments=16,
                                         softmax_segm_output=so, softmax_segm_max=sm, softmax_segm_expsum=se)

    def scratch_for(S: int):  # noqa: ANN202
        return (torch.empty(S, HQ, 16, D, dtype=torch.float32, device=dev),
                torch.empty(S, HQ, 16, dtype=torch.float32, device=dev),
                torch.empty(S, HQ, 16, dtype=torch.float32, device=dev))

    def ref_fp32(q, bt, L):  # noqa: ANN001, ANN202
        S = q.shape[0]
        k = k_pool[bt.long()].reshape(S, -1, H, D)[:, :L].float()
        v = v_pool[bt.long()].reshape(S, -1, H, D)[:, :L].float()
        k = k.repeat_interleave(HQ // H, dim=2)
        v = v.repeat_interleave(HQ // H, dim=2)
        s = torch.einsum("shd,slhd->shl", q.float(), k) * scale
        return torch.einsum("shl,slhd->shd", torch.softmax(s, -1), v)

    # accuracy at a few shapes, poisoned outputs, two runs
    acc_rows = []
    for S, L in ([(2, 40), (1, 300)] if smoke else [(8, 1024), (2, 32768), (64, 2000)]):
        bt, lens, q = make_case(S, L, 0)
        ref = ref_fp32(q, bt, L)
        row = {"batch": S, "context": L}
        try:
            o1 = torch.full_like(q, float("nan"))
            ours(q, bt, lens, L, o1)()
            o2 = torch.full_like(q, float("nan"))
            ours(q, bt, lens, L, o2)()
            row["ours_rel_err"] = float((o1.float() - ref).norm() / ref.norm())
            row["ours_nan"] = bool(o1.isnan().any())
            row["ours_deterministic"] = bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16)))
        except Exception as exc:  # noqa: BLE001
            row["ours_error"] = repr(exc)[:300]
            traceback.print_exc()
        if unified_attention is not None:
            try:
                ov = torch.full_like(q, float("nan"))
                vllm_fn(q, bt, lens, L, ov, scratch_for(S))()
                row["vllm_rel_err"] = float((ov.float() - ref).norm() / ref.norm())
            except Exception as exc:  # noqa: BLE001
                row["vllm_error"] = repr(exc)[:300]
                traceback.print_exc()
        acc_rows.append(row)
        print("accuracy", row)
    log("accuracy", acc_rows, out)
    if not args.no_prefill:
        log("prefill", prefill_section((cache, lay, tab, ovf, k_pool, v_pool, dec_dev), unified_attention, gen, dev,
                                       smoke), out)
    if args.only_prefill:
        return
    if smoke:
        print("smoke ok")
        return

    # every row times the default launch (decode_config: what the backend runs) and each of these
    # (pages a tile, warps, stages, prefetch, ovf_branch: the overflow arena only under a tile-uniform branch)
    configs = [(2, 2, 1, True, True), (2, 4, 1, True, True), (4, 4, 1, True, True), (1, 4, 1, True, True),
               (2, 4, 1, False, True), (2, 4, 2, True, True), (2, 2, 1, True, False), (2, 4, 1, True, False)]

    def cfg_name(c: tuple) -> str:  # noqa: ANN001
        return "p{}w{}s{}f{}".format(*c[:3], int(c[3])) + ("b" if c[4] else "")

    for S2, L2 in ((8, 1024), (2, 32768), (64, 8192)):  # each config against fp32 too, poisoned, twice
        bt2, lens2, q2 = make_case(S2, L2, 0)
        ref = ref_fp32(q2, bt2, L2)
        for c in [None, *configs]:
            o1, o2 = torch.full_like(q2, float("nan")), torch.full_like(q2, float("nan"))
            ours(q2, bt2, lens2, L2, o1, c)()
            ours(q2, bt2, lens2, L2, o2, c)()
            row = {"batch": S2, "context": L2, "cfg": cfg_name(c) if c else "default",
                   "ours_rel_err": float((o1.float() - ref).norm() / ref.norm()), "ours_nan": bool(o1.isnan().any()),
                   "ours_deterministic": bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16)))}
            acc_rows.append(row)
        print("accuracy (configs)", acc_rows[-1 - len(configs):], flush=True)
    log("accuracy", acc_rows, out)

    rows = []
    l2 = 60e6
    for S in batches:
        for L in contexts:
            row: dict[str, object] = {"batch": S, "context": L}
            try:
                nbs = (L + B - 1) // B
                comp_bytes = S * nbs * H * lay.page_bytes
                bf_bytes = S * L * H * D * 4
                rot = max(1, min(16, math.ceil(4 * l2 / comp_bytes)))
                first = 0
                cases = []
                for _ in range(rot):
                    cases.append(make_case(S, L, first))
                    first += S * nbs
                    if first + S * nbs > nblocks:
                        first = 0
                outs = [torch.empty_like(c[2]) for c in cases]
                fns = [ours(q, bt, lens, L, o) for (bt, lens, q), o in zip(cases, outs, strict=True)]
                pages = decode_config(S, H)[0]
                row["default_cfg"] = "p{}w{}".format(*decode_config(S, H))
                row["splits"] = num_splits_for(S, H, L, B, pages)
                row["ours_ms"] = bench_fn(lambda fns=fns: [f() for f in fns], True) / rot
                per = {}
                for c in configs:
                    cf = [ours(q, bt, lens, L, o, c) for (bt, lens, q), o in zip(cases, outs, strict=True)]
                    per[cfg_name(c)] = bench_fn(lambda cf=cf: [f() for f in cf], True) / rot
                row["configs_ms"] = per
                row["best_cfg"] = min(per, key=lambda k: per[k])
                row["best_ms"] = per[row["best_cfg"]]
                row["ours_TBps"] = comp_bytes / row["ours_ms"] / 1e9
                if unified_attention is not None:
                    sc = scratch_for(S)
                    vf = [vllm_fn(q, bt, lens, L, o, sc) for (bt, lens, q), o in zip(cases, outs, strict=True)]
                    row["vllm_ms"] = bench_fn(lambda vf=vf: [f() for f in vf], True) / rot
                    row["vllm_TBps"] = bf_bytes / row["vllm_ms"] / 1e9
                # SDPA on contiguous bf16 (one copy; rotation only where it is small)
                srot = rot if bf_bytes * rot < 8e9 else 1
                sd = []
                for bt, _lens, q in cases[:srot]:
                    kc = k_pool[bt.long()].reshape(S, -1, H, D)[:, :L].transpose(1, 2).contiguous()
                    vc = v_pool[bt.long()].reshape(S, -1, H, D)[:, :L].transpose(1, 2).contiguous()
                    sd.append((q.view(S, HQ, 1, D), kc, vc))

                def sdpa(sd=sd):  # noqa: ANN001, ANN202
                    for qq, kc, vc in sd:
                        torch.nn.functional.scaled_dot_product_attention(qq, kc, vc, scale=scale, enable_gqa=True)
                row["sdpa_ms"] = bench_fn(sdpa, True) / len(sd)
                del sd
                row["speedup_vs_vllm"] = row.get("vllm_ms", float("nan")) / row["ours_ms"]
                row["best_vs_vllm"] = row.get("vllm_ms", float("nan")) / row["best_ms"]
                row["ours_frac_copy"] = row["ours_TBps"] / copy_tbs
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:300]
                traceback.print_exc()
            torch.cuda.empty_cache()
            rows.append(row)
            print("row", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
            log("rows", rows, out)

    if model_batches is not None:
        model: dict[str, object] = {"kv_gib": args.kv_gib, "context": MODEL_CONTEXT, "batches": model_batches}
        try:
            attn = {}
            for S in model_batches.values():
                bt, lens, q = make_case(S, MODEL_CONTEXT, 0)
                o = torch.empty_like(q)
                attn[f"glyd_b{S}"] = bench_fn(ours(q, bt, lens, MODEL_CONTEXT, o), True)
                if unified_attention is not None:
                    attn[f"vllm_b{S}"] = bench_fn(vllm_fn(q, bt, lens, MODEL_CONTEXT, o, scratch_for(S)), True)
                k1, v1 = src.draw(S)  # one decode token a sequence, into a scratch cache (the pool stays intact)
                s1 = (torch.arange(S, device=dev) * B + 5).to(dev)
                wc = torch.zeros(S, H, lay.page_bytes, dtype=torch.uint8, device=dev)
                attn[f"write_b{S}"] = bench_fn(lambda k1=k1, v1=v1, s1=s1, wc=wc: writer.launch(wc, k1, v1, s1), True)
            model["attention_ms"] = attn
            model.update(throughput_model(model_batches, attn, dev))
        except Exception as exc:  # noqa: BLE001
            model["error"] = repr(exc)[:300]
            traceback.print_exc()
        print("model", json.dumps(model, indent=1, default=str))
        log("model", model, out)

    # page writes: a prefill run of 32k tokens (a sweep of tokens a program x warps, the best checked byte for
    # byte against the default writer; the first pass alone too), and 128 single decode tokens
    writes: dict[str, object] = {}
    try:
        if args.no_writes:
            raise RuntimeError("skipped (--no-writes)")
        T = 32768
        k, v = src.draw(T)
        slots = torch.arange(T, device=dev)
        nbw = T // B
        sweep, rows_only, cfgs = {}, {}, {}
        wc = torch.zeros(nbw, H, lay.page_bytes, dtype=torch.uint8, device=dev)
        for tb, warps in ((8, 2), (16, 4), (32, 4)):  # first pass alone
            w = PageWriter(lay, dec_dev, tokens_per_program=tb, num_warps=warps)
            rows_only[f"tb{tb}w{warps}"] = bench_fn(lambda w=w: w.launch(wc, k, v, slots, escapes=False), False)
        # (tokens, warps) of each pass
        for tb, warps, etb, ewarps in ((32, 4, 4, 1), (32, 4, 8, 1), (32, 4, 8, 2), (32, 4, 2, 1), (16, 4, 4, 1)):
            cfg = dict(tokens_per_program=tb, num_warps=warps, escape_tokens_per_program=etb, escape_num_warps=ewarps)
            w = PageWriter(lay, dec_dev, **cfg)
            name = f"tb{tb}w{warps}-e{etb}w{ewarps}"
            cfgs[name] = cfg
            sweep[name] = bench_fn(lambda w=w: w.launch(wc, k, v, slots), False)
        best_w = min(sweep, key=sweep.get)
        writes.update(sweep_ms=sweep, rows_pass_ms=rows_only, best=best_w, prefill_ms=sweep[best_w],
                      prefill_GBps_bf16_in=2 * k.numel() * 2 / sweep[best_w] / 1e6)
        ca = torch.zeros(nbw, H, lay.page_bytes, dtype=torch.uint8, device=dev)
        cb = torch.zeros_like(ca)
        sa = PageWriter(lay, dec_dev).launch(ca, k, v, slots)[0]
        sb = PageWriter(lay, dec_dev, **cfgs[best_w]).launch(cb, k, v, slots)[0]
        writes["best_equals_default_bytes"] = bool(torch.equal(ca, cb) and torch.equal(sa, sb))
        # the same run behind 5 decode tokens, so the run's pages no longer line up with the token groups
        k5, v5 = src.draw(5)
        s5 = torch.cat([torch.arange(5, device=dev) * B + nbw * B + 3, slots])
        k5, v5 = torch.cat([k5, k]), torch.cat([v5, v])
        wb = PageWriter(lay, dec_dev, **cfgs[best_w])
        cm = torch.zeros(nbw + 8, H, lay.page_bytes, dtype=torch.uint8, device=dev)
        writes["prefill_after_5_decodes_ms"] = bench_fn(lambda: wb.launch(cm, k5, v5, s5), False)
        writes["prefill_after_5_decodes_GBps_bf16_in"] = 2 * k5.numel() * 2 / writes["prefill_after_5_decodes_ms"] / 1e6
        del ca, cb
        k1, v1 = src.draw(128)
        s1 = (torch.randperm(nblocks - 64, generator=gen)[:128] * B + 5).to(dev)
        writes["decode128_ms"] = bench_fn(lambda: writer.launch(cache, k1, v1, s1), True)
    except Exception as exc:  # noqa: BLE001
        writes["error"] = repr(exc)[:300]
        traceback.print_exc()
    print("writes", writes)
    log("writes", writes, out)

    print(f"\n== {info.get('gpu')} {info['date']} copy {copy_tbs:.2f} TB/s; C={lay.token_bytes} B/token/head "
          f"({8 * lay.token_bytes / (2 * D):.2f} bits/value); ours = the default launch (decode_config)")
    print(f"{'batch':>5} {'ctx':>6} {'ours ms':>8} {'vllm ms':>8} {'sdpa ms':>8} {'x vllm':>7} {'ours TB/s':>9} "
          f"{'%copy':>6} {'splits':>6} {'cfg':>5} {'best cfg':>9} {'x vllm':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['batch']:>5} {r['context']:>6} error {r['error'][:80]}")
            continue
        print(f"{r['batch']:>5} {r['context']:>6} {r['ours_ms']:>8.4f} {r.get('vllm_ms', float('nan')):>8.4f} "
              f"{r['sdpa_ms']:>8.4f} {r['speedup_vs_vllm']:>7.2f} {r['ours_TBps']:>9.2f} "
              f"{100 * r['ours_frac_copy']:>5.0f}% {r['splits']:>6} {r['default_cfg']:>5} {r['best_cfg']:>9} "
              f"{r['best_vs_vllm']:>6.2f}")
    print("accuracy", acc_rows)
    print("checks", checks, "writes", writes)


if __name__ == "__main__":
    main()
