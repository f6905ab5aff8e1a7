"""GPU benchmark of the KV page code's CUDA kernels at Qwen3-8B shapes (one call of the device tool runs it all).

Shapes: 32 query heads, 8 KV heads, head 128, block 16 (one attention layer). K/V come from the demo model's
recordings (bench/kv_samples/smollm2_kv.safetensors): token rows are resampled per KV head and the 64 recorded
channels tiled to 128, so every channel's exponent statistics are the model's; the window tops and the escape
reserve come from the same samples.

In one run, for each page code (3- and 4-bit): the page pool written by the CUDA writer from the same tokens (its
throughput on a 32k-token prefill run and on single decode tokens), tiles read back bit for bit against the bf16
source (overflow tiles included), attention against fp32 (NaN-poisoned outputs, the same bits twice); then decode
attention for batch x context of (a) ours on compressed pages of each code, (b) vLLM 0.33's Triton unified attention
on bf16 pages (vLLM's Triton unified attention kernel, laid out under .baseline/, git-ignored), (c) torch SDPA on
contiguous bf16, each timed from CUDA-graph replays (median; inputs rotated where a case would sit in L2), side by
side. `--variants` also times other builds of our kernel (compile-time constants), `--splits` our kernel with the
context split forced. Then the throughput model (bench/gpu_model.py) and a decode step's 36 layers launched from
Python against replayed from a CUDA graph (bench/gpu_graph.py). Prints tables; writes gpu_bench.json under --out.

Run (device):  PYTHONUNBUFFERED=1 python3 bench/gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / ".baseline"))

import torch  # noqa: E402

from bench import gpu_graph, gpu_model  # noqa: E402
from bench.gpu_pools import (  # noqa: E402
    CONTEXT,
    HQ,
    SCALE,
    B,
    Code,
    D,
    H,
    Pools,
    Source,
    bench_fn,
    fill_pools,
)
from glyd_engine.format import kv_page as kp  # noqa: E402
from glyd_kernels import kv_cuda  # noqa: E402

LOG: dict[str, object] = {}


def log(key: str, value: object, out: Path | None) -> None:
    LOG[key] = value
    if out is not None:
        (out / "gpu_bench.json").write_text(json.dumps(LOG, indent=1, default=str))


def copy_bandwidth(dev: str) -> float:
    import triton.testing as tt

    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda: b.copy_(a), warmup=5, rep=50, return_mode="median")
    return 2 * n / ms / 1e9  # TB/s


def write_throughput(code: Code, src: Source, dev: str) -> dict[str, float]:
    """A fresh 32k-token prefill run (the whole call, which waits for the device once to check the arena's room, and
    the kernel alone), and one decode token for each of 128 sequences (the call, with no wait in the common case;
    the kernel alone with a block a token, as the call launches it, and with a block for 16 tokens)."""
    import triton.testing as tt

    from glyd_kernels import kv_overflow

    chunk, lay = 32768, code.lay
    k, v = src.draw(chunk)
    wc = torch.empty(chunk // B, H, lay.page_bytes, dtype=torch.uint8, device=dev)
    wo = kp.OverflowStore(chunk // B, H, device=dev, initial_entries=1 << 22)
    slots = torch.arange(chunk, device=dev)
    kv_cuda.write(wc, lay, code.tops, wo, k, v, slots)  # runs allocated: the timed calls need no growth
    runs = kv_overflow.device_runs(wo, D)
    ms = float(tt.do_bench(lambda: kv_cuda.write(wc, lay, code.tops, wo, k, v, slots), warmup=5, rep=50,
                           return_mode="median"))
    need = runs.need_for(chunk)

    def kernel_only(t: int = chunk, span: int | None = None) -> None:  # as a CUDA graph replays it
        kv_cuda.launch_write(wc, lay, code.tops, wo, k[:t], v[:t], slots[:t] * (B if t < chunk else 1), need[:t],
                             span=span)

    ms_kernel = bench_fn(kernel_only)
    k1, v1 = k[:128], v[:128]
    s1 = torch.arange(128, device=dev) * B  # token 0 of each tile: every call starts the tiles anew
    checked = runs.checked
    ms1 = float(tt.do_bench(lambda: kv_cuda.write(wc, lay, code.tops, wo, k1, v1, s1), warmup=5, rep=50,
                            return_mode="median"))
    return {"prefill_32k_ms": ms, "prefill_32k_GBps_bf16_in": chunk * H * D * 4 / ms / 1e6,
            "prefill_32k_kernel_ms": ms_kernel, "prefill_32k_kernel_GBps_bf16_in": chunk * H * D * 4 / ms_kernel / 1e6,
            "decode_128_tokens_call_ms": ms1, "decode_128_checked_calls": runs.checked - checked,
            "decode_128_kernel_ms": bench_fn(lambda: kernel_only(128)),
            "decode_128_kernel_span16_ms": bench_fn(lambda: kernel_only(128, 16))}


def read_back(code: Code, k_pool: torch.Tensor, v_pool: torch.Tensor, gen: torch.Generator) -> dict[str, int]:
    """Tiles read back through the tile reader against the bf16 source, bit for bit (overflow tiles too)."""
    nblocks = k_pool.shape[0]
    sample = torch.randperm(nblocks, generator=gen)[:8192].to(k_pool.device)
    held = (code.ovf.ptr >= 0).any(-1).any(-1).nonzero().flatten()[:32768]
    bad = 0
    for tiles in (sample, held):
        for part in tiles.split(4096):
            rk, rv = kv_cuda.read_tiles(code.cache, code.lay, code.tops, part, code.ovf)
            bad += int((rk.view(torch.int16) != k_pool[part].transpose(1, 2).view(torch.int16)).sum())
            bad += int((rv.view(torch.int16) != v_pool[part].transpose(1, 2).view(torch.int16)).sum())
    return {"tiles_checked": int(sample.numel()), "overflow_tiles_checked": int(held.numel()),
            "values_differing": bad}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Decode attention and page writes of the KV page code's CUDA kernels "
                                 "against vLLM's Triton kernel and SDPA (needs a GPU)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--codes", default="3,4", help="page codes to time (bits)")
    ap.add_argument("--variants", default="", help="extra builds timed per row, e.g. MIN_BLOCKS=3;WARPS=8 "
                    "(glyd_kernels.kv_cuda.SWITCHES)")
    ap.add_argument("--splits", default="", help="also time our kernel with the context split forced to each of "
                    "these counts, e.g. 1,2,3 (columns sN: ratio to vLLM)")
    ap.add_argument("--kv-gib", type=float, default=100.0, help="KV memory of the throughput model (every cache)")
    ap.add_argument("--no-model", action="store_true", help="skip the throughput model")
    ap.add_argument("--graph-batches", default="1,8,64", help="batches of the decode step launched from Python vs "
                    "replayed from a CUDA graph (bench/gpu_graph.py); empty to skip")
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.codes = [int(x) for x in args.codes.split(",")]
    args.variants = [tuple((k, int(v)) for k, v in (kv.split("=") for kv in part.split(",")))
                     for part in args.variants.split(";") if part]
    args.splits = [int(x) for x in args.splits.split(",") if x]
    args.graph_batches = [int(x) for x in args.graph_batches.split(",") if x]
    if bad := sorted({k for var in args.variants for k, _ in var} - set(kv_cuda.SWITCHES)):
        ap.error(f"--variants: no build switch {', '.join(bad)} (the switches: {', '.join(kv_cuda.SWITCHES)})")
    if any(n < 1 for n in args.splits):
        ap.error("--splits takes counts of 1 or more")
    return args


def check_codes(pools: Pools, src: Source, gen: torch.Generator, dev: str, out: Path | None) -> None:
    """Each code's layout and pool figures, its write throughput and its tiles read back bit for bit (logged)."""
    for cb, code in pools.codes.items():
        info = {**code.info, **code.pool_info(pools.tokens)}
        for name, fn in (("writes", lambda c=code: write_throughput(c, src, dev)),
                         ("read_back", lambda c=code: read_back(c, pools.k, pools.v, gen))):
            try:
                info[name] = fn()
            except Exception as exc:
                info[name] = {"error": repr(exc)[:300]}
                traceback.print_exc()
        log(f"code{cb}", info, out)
        print(f"code{cb}", json.dumps(info), flush=True)


# --- the kernels timed --------------------------------------------------------------------------------------------
class Baseline:
    """vLLM's Triton unified attention on the bf16 pool (from .baseline/), with its backend's settings: the split
    path under 16 sequences, 16 segments. `available` is False where it does not import (the error is logged)."""

    def __init__(self, pools: Pools, dev: str, out: Path | None) -> None:
        self.pools, self.dev = pools, dev
        try:
            from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        except Exception as exc:
            unified_attention = None
            print("vLLM baseline unavailable:", exc)
            log("vllm_error", repr(exc), out)
        self.kernel = unified_attention

    @property
    def available(self) -> bool:
        return self.kernel is not None

    def scratch(self, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.empty(S, HQ, 16, D, dtype=torch.float32, device=self.dev),
                torch.empty(S, HQ, 16, dtype=torch.float32, device=self.dev),
                torch.empty(S, HQ, 16, dtype=torch.float32, device=self.dev))

    def fn(self, q: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor, L: int, o: torch.Tensor,
           sc: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Callable[[], object]:
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=self.dev)
        k_pool, v_pool, ua = self.pools.k, self.pools.v, self.kernel
        return lambda: ua(q, k_pool, v_pool, o, cu, 1, lens, L, SCALE, True, (-1, -1), bt, 0, None, None, None,
                          seq_threshold_3D=128 // H, num_par_softmax_segments=16, softmax_segm_output=sc[0],
                          softmax_segm_max=sc[1], softmax_segm_expsum=sc[2])


def ours(code: Code, q: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor, L: int, o: torch.Tensor,
         variant: tuple[tuple[str, int], ...] = (), num_splits: int | None = None) -> Callable[[], object]:
    """Our decode attention on the code's pages (num_splits None: the launcher's own choice)."""
    return lambda: kv_cuda.decode_attention(q, code.cache, code.lay, code.tops, bt, lens, L, SCALE, code.ovf, out=o,
                                            num_splits=num_splits, variant=variant)


def build_name(cb: int, variant: tuple[tuple[str, int], ...]) -> str:
    """A build's column prefix: code4, code4,P_SPLIT=1."""
    return f"code{cb}" + "".join(f",{k}={v}" for k, v in variant)


def make_case(S: int, L: int, first_block: int, gen: torch.Generator, dev: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """S sequences of L tokens on random blocks from first_block on: (block table, lengths, queries)."""
    nbs = (L + B - 1) // B
    bt = (first_block + torch.randperm(S * nbs, generator=gen).view(S, nbs)).to(torch.int32).to(dev)
    lens = torch.full((S,), L, dtype=torch.int32, device=dev)
    q = torch.randn(S, HQ, D, generator=gen).to(torch.bfloat16).to(dev)
    return bt, lens, q


def ref_fp32(pools: Pools, q: torch.Tensor, bt: torch.Tensor, L: int) -> torch.Tensor:
    S = q.shape[0]
    k = pools.k[bt.long()].reshape(S, -1, H, D)[:, :L].float().repeat_interleave(HQ // H, dim=2)
    v = pools.v[bt.long()].reshape(S, -1, H, D)[:, :L].float().repeat_interleave(HQ // H, dim=2)
    s = torch.einsum("shd,slhd->shl", q.float(), k) * SCALE
    return torch.einsum("shl,slhd->shd", torch.softmax(s, -1), v)


# --- accuracy: against fp32, NaN-poisoned outputs, the same bits twice ----------------------------------------------
def accuracy(pools: Pools, base: Baseline, gen: torch.Generator, dev: str,
             variants: list[tuple[tuple[str, int], ...]] = ()) -> list[dict[str, object]]:
    """Each code's error against fp32 (the shipped build, then each variant build), and vLLM's."""
    acc = []
    for S, L in ((8, 1024), (2, 32768), (64, 2000), (3, 37)):
        row: dict[str, object] = {"batch": S, "context": L}
        try:
            bt, lens, q = make_case(S, L, 0, gen, dev)
            ref = ref_fp32(pools, q, bt, L)
            for cb, code in pools.codes.items():
                o1, o2 = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
                ours(code, q, bt, lens, L, o1)()
                ours(code, q, bt, lens, L, o2)()
                row[f"code{cb}_rel_err"] = float((o1.float() - ref).norm() / ref.norm())
                row[f"code{cb}_nan"] = bool(torch.isnan(o1).any())
                row[f"code{cb}_same_bits_twice"] = bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16)))
                for var in variants:
                    ours(code, q, bt, lens, L, o1, var)()
                    row[f"{build_name(cb, var)}_rel_err"] = float((o1.float() - ref).norm() / ref.norm())
            if base.available:
                o3 = torch.empty_like(q)
                base.fn(q, bt, lens, L, o3, base.scratch(S))()
                row["vllm_rel_err"] = float((o3.float() - ref).norm() / ref.norm())
        except Exception as exc:
            row["error"] = repr(exc)[:300]
            traceback.print_exc()
        acc.append(row)
    return acc


# --- decode attention grid ------------------------------------------------------------------------------------------
def time_row(S: int, L: int, pools: Pools, base: Baseline, gen: torch.Generator, dev: str,
             variants: list[tuple[tuple[str, int], ...]], splits: list[int]) -> dict[str, object]:
    """One batch x context: ours (each code, each variant build, each forced split count), vLLM's kernel, SDPA."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    row: dict[str, object] = {"batch": S, "context": L}
    try:
        nbs = (L + B - 1) // B
        bf_bytes = S * L * H * D * 4
        rot = max(1, min(16, math.ceil(4 * l2 / (0.7 * bf_bytes))))
        cases, first = [], 0
        for _ in range(rot):
            cases.append(make_case(S, L, first, gen, dev))
            first = first + S * nbs if first + 2 * S * nbs <= pools.nblocks else 0
        outs = [torch.empty_like(c[2]) for c in cases]
        row["splits"] = kv_cuda.num_splits_for(S, H, L)
        for cb, code in pools.codes.items():
            for var in [(), *variants]:
                fns = [ours(code, q, bt, lens, L, o, var) for (bt, lens, q), o in zip(cases, outs, strict=True)]
                name = build_name(cb, var)
                row[f"{name}_ms"] = bench_fn(lambda fns=fns: [f() for f in fns]) / rot
            row[f"code{cb}_TBps"] = S * nbs * H * code.lay.page_bytes / row[f"code{cb}_ms"] / 1e9
            for n in splits:
                fns = [ours(code, q, bt, lens, L, o, num_splits=n)
                       for (bt, lens, q), o in zip(cases, outs, strict=True)]
                row[f"code{cb}_s{n}_ms"] = bench_fn(lambda fns=fns: [f() for f in fns]) / rot
        if base.available:
            sc = base.scratch(S)
            vf = [base.fn(q, bt, lens, L, o, sc) for (bt, lens, q), o in zip(cases, outs, strict=True)]
            row["vllm_ms"] = bench_fn(lambda vf=vf: [f() for f in vf]) / rot
        srot = rot if bf_bytes * rot < 8e9 else 1
        sd = []
        for bt, _lens, q in cases[:srot]:
            kc = pools.k[bt.long()].reshape(S, -1, H, D)[:, :L].transpose(1, 2).contiguous()
            vc = pools.v[bt.long()].reshape(S, -1, H, D)[:, :L].transpose(1, 2).contiguous()
            sd.append((q.view(S, HQ, 1, D), kc, vc))

        def sdpa(sd: list[tuple[torch.Tensor, ...]] = sd) -> None:
            for qq, kc, vc in sd:
                torch.nn.functional.scaled_dot_product_attention(qq, kc, vc, scale=SCALE, enable_gqa=True)
        row["sdpa_ms"] = bench_fn(sdpa) / len(sd)
        del sd
    except Exception as exc:
        row["error"] = repr(exc)[:300]
        traceback.print_exc()
    torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict[str, object]], cbs: list[int], copy_tbs: float, splits: list[int]) -> None:
    """The Markdown table: ms, ratios (baseline time / ours: > 1 is Glyd faster), share of copy bandwidth, and with
    --splits each code's forced split counts as ratios to vLLM."""
    sp = [(cb, n) for cb in cbs for n in splits]
    print("\n| batch | ctx | " + " | ".join(f"{cb}-bit ms" for cb in cbs) + " | vLLM ms | SDPA ms | "
          + " | ".join(f"{cb}-bit vs vLLM" for cb in cbs) + " | " + " | ".join(f"{cb}-bit vs SDPA" for cb in cbs)
          + " | " + " | ".join(f"{cb}-bit of copy" for cb in cbs) + " |"
          + "".join(f" {cb}-bit s{n} vs vLLM |" for cb, n in sp))
    print("|---" * (4 + 4 * len(cbs) + len(sp)) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['batch']} | {r['context']} | error |")
            continue
        ms = [f"{r[f'code{cb}_ms']:.3f}" for cb in cbs]
        vs = [f"{r['vllm_ms'] / r[f'code{cb}_ms']:.2f}x" if "vllm_ms" in r else "-" for cb in cbs]
        sd = [f"{r['sdpa_ms'] / r[f'code{cb}_ms']:.2f}x" for cb in cbs]
        fr = [f"{r[f'code{cb}_TBps'] / copy_tbs:.0%}" for cb in cbs]
        sv = [f"{r['vllm_ms'] / r[f'code{cb}_s{n}_ms']:.2f}x" if "vllm_ms" in r else "-" for cb, n in sp]
        print(f"| {r['batch']} | {r['context']} | {' | '.join(ms)} | {r.get('vllm_ms', float('nan')):.3f} | "
              f"{r['sdpa_ms']:.3f} | {' | '.join(vs)} | {' | '.join(sd)} | {' | '.join(fr)} |"
              + "".join(f" {x} |" for x in sv))


def main() -> None:
    args = parse_args()
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    dev = "cuda"
    log("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), out)
    log("device", torch.cuda.get_device_name(), out)
    log("torch", torch.__version__, out)
    copy_tbs = copy_bandwidth(dev)
    log("copy_TBps", copy_tbs, out)
    print(f"{torch.cuda.get_device_name()}: copy {copy_tbs:.2f} TB/s", flush=True)

    src = Source(15, dev)
    bf16_batch = gpu_model.batches(args.kv_gib, None, H, D)["bf16"]
    model_tokens = 0 if args.no_model else 2 * bf16_batch * CONTEXT  # a page code holds < 2x the sequences
    pools = fill_pools(src, args.codes, max(max(args.batches) * max(args.contexts), model_tokens), dev)
    gen = torch.Generator().manual_seed(3)  # one stream, in this order: read-back tiles, accuracy cases, grid cases
    check_codes(pools, src, gen, dev, out)
    base = Baseline(pools, dev, out)

    acc = accuracy(pools, base, gen, dev, args.variants)
    log("attention_accuracy", acc, out)
    print("accuracy", json.dumps(acc), flush=True)

    rows = []
    for S in args.batches:
        for L in args.contexts:
            row = time_row(S, L, pools, base, gen, dev, args.variants, args.splits)
            rows.append(row)
            print("row", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            log("rows", rows, out)

    print_table(rows, list(pools.codes), copy_tbs, args.splits)

    if not args.no_model:
        model = gpu_model.throughput_model(
            pools, lambda S, L: time_row(S, L, pools, base, gen, dev, [], []), dev, args.kv_gib, H, D)
        log("throughput_model", model, out)
        gpu_model.print_model(model)

    if args.graph_batches:
        code = pools.codes[max(pools.codes)]
        ggen = torch.Generator().manual_seed(11)
        steps = [gpu_graph.step_times(code, S, H, HQ, SCALE, pools.nblocks, ggen, dev) for S in args.graph_batches]
        log("graph_steps", steps, out)
        gpu_graph.print_steps(steps)


if __name__ == "__main__":
    main()
