"""GPU benchmark of the KV page code's CUDA kernels at Qwen3-8B shapes, judged against issue 29's bars in the same run.

Shapes: 32 query heads, 8 KV heads, head 128, block 16 (one attention layer). K/V come from the demo model's
recordings (bench/kv_samples/smollm2_kv.safetensors): token rows are resampled per KV head and the 64 recorded
channels tiled to 128, so every channel's exponent statistics are the model's; the window tops and the escape
reserve come from the same samples.

In one run: the read-only stream rate of the card (bench/gpu_read.py), then for each page code (3- and 4-bit) the
page pool written by the CUDA writer from the same tokens (its throughput on a 32k-token prefill run and on single
decode tokens), tiles read back bit for bit against the bf16 source (overflow tiles included), attention against
fp32 (NaN-poisoned outputs, the same bits twice) beside FlashAttention 3's error on the same inputs; then decode
attention for each batch x context of (a) ours on compressed pages of each code, (b) vLLM 0.33's FlashAttention 3 on
the bf16 pages, called as vLLM calls it (`fa3`: the plain call; `fa3_sched`: vLLM's full-CUDA-graph decode call, with
its ahead-of-time scheduler metadata and up to 32 splits), (c) vLLM's Triton unified attention on the same pages,
(d) torch SDPA on contiguous bf16, each timed from CUDA-graph replays (median; inputs rotated where a case would sit
in L2), side by side. Then a high-escape regime (tables calibrated on other samples, or the samples scaled so most
values leave the windows) read back, checked and timed, its escape rates printed. `--variants` also times other
builds of our kernel, `--splits` our kernel with the context split forced; the throughput model (bench/gpu_model.py)
and a decode step's 36 layers launched from Python against replayed from a CUDA graph (bench/gpu_graph.py) unless
skipped. Last, the verdict (bench/gpu_bars.py): every failed check and missed bar is printed, gpu_bench.json under
--out holds it, and the run exits 1 when there is any (2 when FlashAttention 3 cannot be imported, unless --no-fa3).

Run (device, vLLM 0.33 staged into /tmp/site by ../shared/tools/vllm-on-device):
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/gpu.py --out $OUT --no-model --graph-batches ""
Without a staged vLLM, vLLM's Triton kernel comes from .baseline/ (git-ignored), and FlashAttention 3 is missing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if importlib.util.find_spec("vllm") is None:  # no vLLM staged: vLLM's Triton kernel alone, from .baseline/
    sys.path.insert(0, str(ROOT / ".baseline"))

import torch  # noqa: E402

from bench.tree import bind_kernels  # noqa: E402

bind_kernels()  # the kernels of this tree, installed or not
from bench import gpu_bars, gpu_graph, gpu_model  # noqa: E402
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


HIGH_ESCAPE = (  # (name, layer the tables are calibrated on, layer whose K/V the pages hold, values scaled by 2**shift)
    ("other-tables", 2, 28, 0),  # real K/V under another layer's tables: 3-bit ~21%, 4-bit ~1.8% of values escape
    ("scaled-x16", 15, 15, 4),  # the samples x16 under their own tables: 3-bit ~83%, 4-bit ~10%
)
MIN_POOL_TOKENS = 1 << 20  # a pool for a few cells still rotates cases past L2
QUICK_CELLS = "1x8192"  # the cell FlashAttention 3 won in issue 29's run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Decode attention and page writes of the KV page code's CUDA kernels "
                                 "against vLLM's FlashAttention 3, its Triton kernel and SDPA, judged against issue "
                                 "29's bars (bench/gpu_bars.py); needs a GPU, and vLLM 0.33 on PYTHONPATH for "
                                 "FlashAttention 3. Exits 1 when a check fails or a bar is missed.")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--cells", default="", help="only these batch x context cells, e.g. 1x8192,64x8192 (instead "
                    "of --batches x --contexts; the verdict then covers these cells only)")
    ap.add_argument("--quick", action="store_true", help=f"a subset in under 2 minutes: --cells {QUICK_CELLS}, the "
                    f"high-escape regimes at {QUICK_CELLS}, no write throughput, no model, no graph steps")
    ap.add_argument("--codes", default="3,4", help="page codes to time (bits)")
    ap.add_argument("--no-fa3", action="store_true", help="run without FlashAttention 3 (where vLLM is not staged or "
                    "the GPU is not Hopper); the bars against it are then not judged and the run exits 1")
    ap.add_argument("--high-escape-cells", default="1x8192,64x8192", help="cells timed in each high-escape regime "
                    "(%(default)s); empty to skip (a full-grid run then fails its verdict)")
    ap.add_argument("--no-writes", action="store_true", help="skip the page writer's throughput")
    ap.add_argument("--variants", default="", help="extra builds timed per row, e.g. MIN_BLOCKS=3;WARPS=8 "
                    "(glyd_kernels.kv_cuda.SWITCHES)")
    ap.add_argument("--splits", default="", help="also time our kernel with the context split forced to each of "
                    "these counts, e.g. 1,2,3 (columns sN: ratio to vLLM's Triton kernel)")
    ap.add_argument("--kv-gib", type=float, default=100.0, help="KV memory of the throughput model (every cache)")
    ap.add_argument("--no-model", action="store_true", help="skip the throughput model")
    ap.add_argument("--graph-batches", default="1,8,64", help="batches of the decode step launched from Python vs "
                    "replayed from a CUDA graph (bench/gpu_graph.py); empty to skip")
    args = ap.parse_args(argv)
    try:
        args.batches = [int(x) for x in args.batches.split(",")]
        args.contexts = [int(x) for x in args.contexts.split(",")]
        args.codes = [int(x) for x in args.codes.split(",")]
        args.cells = gpu_bars.parse_cells(QUICK_CELLS if args.quick else args.cells) or [
            (b, c) for b in args.batches for c in args.contexts]
        args.high_escape_cells = gpu_bars.parse_cells(QUICK_CELLS if args.quick else args.high_escape_cells)
    except ValueError as exc:
        ap.error(str(exc))
    if args.quick:
        args.no_writes = args.no_model = True
        args.graph_batches = ""
    if bad := sorted(set(args.codes) - {3, 4}):
        ap.error(f"--codes: no page code of {bad} bits (3 and 4)")
    args.variants = [tuple((k, int(v)) for k, v in (kv.split("=") for kv in part.split(",")))
                     for part in args.variants.split(";") if part]
    args.splits = [int(x) for x in args.splits.split(",") if x]
    args.graph_batches = [int(x) for x in args.graph_batches.split(",") if x]
    if bad := sorted({k for var in args.variants for k, _ in var} - set(kv_cuda.SWITCHES)):
        ap.error(f"--variants: no build switch {', '.join(bad)} (the switches: {', '.join(kv_cuda.SWITCHES)})")
    if any(n < 1 for n in args.splits):
        ap.error("--splits takes counts of 1 or more")
    return args


def check_codes(pools: Pools, src: Source, gen: torch.Generator, dev: str, writes: bool = True
                ) -> dict[str, dict[str, object]]:
    """Each code's layout, escape and pool figures, its write throughput and its tiles read back bit for bit."""
    infos = {}
    for cb, code in pools.codes.items():
        info = {**code.info, **code.pool_info(pools.tokens)}
        steps = [("read_back", lambda c=code: read_back(c, pools.k, pools.v, gen))]
        if writes:
            steps.insert(0, ("writes", lambda c=code: write_throughput(c, src, dev)))
        for name, fn in steps:
            try:
                info[name] = fn()
            except Exception as exc:
                info[name] = {"error": repr(exc)[:300]}
                traceback.print_exc()
        infos[f"code{cb}"] = info
        print(f"code{cb}", json.dumps(info), flush=True)
    return infos


# --- the kernels timed --------------------------------------------------------------------------------------------
class Baseline:
    """vLLM's Triton unified attention on the bf16 pool (the staged vLLM's, else .baseline/'s), with its backend's
    settings: the split path under 16 sequences, 16 segments. `available` is False where it does not import (the
    error is logged)."""

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


FA3_GRAPH_SPLITS = 32  # vLLM 0.33's flash_attn_max_num_splits_for_cuda_graph: its full-graph decode call


def load_fa3() -> tuple[Callable[..., object], Callable[..., object]] | str:
    """vLLM's FlashAttention 3 entry points (flash_attn_varlen_func, get_scheduler_metadata), or why not."""
    try:
        import vllm
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON
    except Exception as exc:
        return f"vllm.vllm_flash_attn does not import ({exc!r}): stage vLLM 0.33 and put it on PYTHONPATH"
    if not FA3_AVAILABLE:
        return f"vLLM {vllm.__version__} has no FlashAttention 3 build: {FA3_UNAVAILABLE_REASON}"
    if torch.cuda.get_device_capability()[0] != 9:
        return f"FlashAttention 3 runs on Hopper (9.x) only, not {torch.cuda.get_device_name()}"
    return flash_attn_varlen_func, get_scheduler_metadata


class FA3:
    """vLLM 0.33's FlashAttention 3 on the bf16 pool ([blocks, 16, KV heads, D], the layout its paged call takes),
    as vLLM's FLASH_ATTN backend calls it for decode: q [S, HQ, D], one query a sequence, causal, the same block
    tables and lengths as ours. `scheduled`: as vLLM's full-CUDA-graph decode steps call it, with scheduler metadata
    computed ahead (once a step, outside the graph) and up to FA3_GRAPH_SPLITS splits."""

    def __init__(self, pools: Pools, fns: tuple[Callable[..., object], Callable[..., object]], dev: str) -> None:
        self.pools, self.dev = pools, dev
        self.varlen, self.schedule = fns

    def fn(self, q: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor, L: int, o: torch.Tensor,
           scheduled: bool = False) -> Callable[[], object]:
        S = q.shape[0]
        if q.dtype != torch.bfloat16 or not q.is_contiguous() or bt.dtype != torch.int32 or lens.dtype != torch.int32:
            raise TypeError("FlashAttention 3 takes contiguous bf16 queries, int32 block tables and lengths")
        cu = torch.arange(S + 1, dtype=torch.int32, device=self.dev)
        k_pool, v_pool, varlen = self.pools.k, self.pools.v, self.varlen
        if not scheduled:
            return lambda: varlen(q, k_pool, v_pool, 1, cu, L, seqused_k=lens, softmax_scale=SCALE, causal=True,
                                  block_table=bt, out=o, fa_version=3)
        meta = self.schedule(batch_size=S, max_seqlen_q=1, max_seqlen_k=L, num_heads_q=HQ, num_heads_kv=H,
                             headdim=D, cache_seqlens=lens, qkv_dtype=torch.bfloat16, cu_seqlens_q=cu, page_size=B,
                             causal=True, window_size=(-1, -1), num_splits=FA3_GRAPH_SPLITS)
        return lambda: varlen(q, k_pool, v_pool, 1, cu, L, seqused_k=lens, softmax_scale=SCALE, causal=True,
                              block_table=bt, out=o, scheduler_metadata=meta, num_splits=FA3_GRAPH_SPLITS,
                              fa_version=3)


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
def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    return float((o.float() - ref).norm() / ref.norm())


def accuracy(pools: Pools, base: Baseline, fa3: FA3 | None, gen: torch.Generator, dev: str,
             variants: list[tuple[tuple[str, int], ...]] = ()) -> list[dict[str, object]]:
    """Each code's error against fp32 (the shipped build, then each variant build), FlashAttention 3's (the plain
    call, NaN-poisoned; the scheduled call three times: the same bits each time) and vLLM's Triton kernel's."""
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
                row[f"code{cb}_rel_err"] = rel_err(o1, ref)
                row[f"code{cb}_nan"] = bool(torch.isnan(o1).any())
                row[f"code{cb}_same_bits_twice"] = bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16)))
                for var in variants:
                    ours(code, q, bt, lens, L, o1, var)()
                    row[f"{build_name(cb, var)}_rel_err"] = rel_err(o1, ref)
            if fa3 is not None:
                o4 = torch.full_like(q, float("nan"))
                fa3.fn(q, bt, lens, L, o4)()
                row["fa3_rel_err"] = rel_err(o4, ref)
                row["fa3_nan"] = bool(torch.isnan(o4).any())
                try:
                    sched, runs = fa3.fn(q, bt, lens, L, o4, scheduled=True), []
                    for _ in range(3):  # the metadata reused as a step's layers reuse it
                        o4.fill_(float("nan"))
                        sched()
                        runs.append(o4.clone())
                    row["fa3_sched_rel_err"] = rel_err(runs[-1], ref)
                    row["fa3_sched_same_bits"] = all(torch.equal(r.view(torch.int16), runs[0].view(torch.int16))
                                                     for r in runs)
                except Exception as exc:
                    row["fa3_sched_error"] = repr(exc)[:300]
                    traceback.print_exc()
            if base.available:
                o3 = torch.empty_like(q)
                base.fn(q, bt, lens, L, o3, base.scratch(S))()
                row["vllm_rel_err"] = rel_err(o3, ref)
        except Exception as exc:
            row["error"] = repr(exc)[:300]
            traceback.print_exc()
        acc.append(row)
    return acc


# --- decode attention grid ------------------------------------------------------------------------------------------
def time_row(S: int, L: int, pools: Pools, base: Baseline, fa3: FA3 | None, gen: torch.Generator, dev: str,
             variants: list[tuple[tuple[str, int], ...]], splits: list[int]) -> dict[str, object]:
    """One batch x context: ours (each code, each variant build, each forced split count), FlashAttention 3 (both
    calls), vLLM's Triton kernel, SDPA; rates of the bytes each reads (ours: its pages; FA3: the bf16 pages)."""
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
        row["rotated_cases"] = rot
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
        if fa3 is not None:
            ff = [fa3.fn(q, bt, lens, L, o) for (bt, lens, q), o in zip(cases, outs, strict=True)]
            row["fa3_ms"] = bench_fn(lambda ff=ff: [f() for f in ff]) / rot
            try:
                ff = [fa3.fn(q, bt, lens, L, o, scheduled=True) for (bt, lens, q), o in zip(cases, outs, strict=True)]
                row["fa3_sched_ms"] = bench_fn(lambda ff=ff: [f() for f in ff]) / rot
            except Exception as exc:
                row["fa3_sched_error"] = repr(exc)[:300]
                traceback.print_exc()
            row["fa3_TBps"] = S * nbs * B * H * D * 4 / gpu_bars.fa3_ms(row) / 1e9
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


def _x(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None else f"{num / den:.3f}x"


def print_table(rows: list[dict[str, object]], cbs: list[int], read_tbs: float | None, splits: list[int]) -> None:
    """The Markdown table: ms, ratios (baseline time / ours: > 1 is Glyd faster; "vs FA3" against the faster FA3
    call), shares of the read-only rate (ours: compressed bytes; FA3: bf16 bytes), and with --splits each code's
    forced split counts as ratios to vLLM's Triton kernel."""
    sp = [(cb, n) for cb in cbs for n in splits]
    num = gpu_bars.number
    head = (["batch", "ctx", *(f"{cb}-bit ms" for cb in cbs), "FA3 ms", "FA3 sched ms", "vLLM Triton ms", "SDPA ms",
             *(f"{cb}-bit vs FA3" for cb in cbs), *(f"{cb}-bit vs Triton" for cb in cbs),
             *(f"{cb}-bit of read-only" for cb in cbs), "FA3 of read-only",
             *(f"{cb}-bit s{n} vs Triton" for cb, n in sp)])
    print("\n| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['batch']} | {r['context']} | error: {r['error']} |")
            continue
        fa3 = gpu_bars.fa3_ms(r)
        ms = [num(r, f"code{cb}_ms") for cb in cbs]
        cells = [str(r["batch"]), str(r["context"]), *(f"{m:.4f}" if m else "-" for m in ms),
                 *(f"{v:.4f}" if (v := num(r, k)) else "-" for k in ("fa3_ms", "fa3_sched_ms", "vllm_ms", "sdpa_ms")),
                 *(_x(fa3, m) for m in ms), *(_x(num(r, "vllm_ms"), m) for m in ms),
                 *(f"{t / read_tbs:.0%}" if (t := num(r, f"code{cb}_TBps")) and read_tbs else "-" for cb in cbs),
                 f"{t / read_tbs:.0%}" if (t := num(r, "fa3_TBps")) and read_tbs else "-",
                 *(_x(num(r, "vllm_ms"), num(r, f"code{cb}_s{n}_ms")) for cb, n in sp)]
        print("| " + " | ".join(cells) + " |")


# --- the high-escape regimes -----------------------------------------------------------------------------------------
def high_escape(args: argparse.Namespace, fa3_fns: tuple[Callable[..., object], Callable[..., object]] | None,
                dev: str, out: Path | None) -> list[dict[str, object]]:
    """Each regime of HIGH_ESCAPE in pools of its own: tiles read back, accuracy, the cells timed, escape rates."""
    regimes: list[dict[str, object]] = []
    for name, cal_layer, data_layer, shift in HIGH_ESCAPE:
        reg: dict[str, object] = {"name": name, "calibration_layer": cal_layer, "data_layer": data_layer,
                                  "scale": 2**shift}
        regimes.append(reg)
        try:
            src, calib = Source(data_layer, dev, seed=5, shift=shift), Source(cal_layer, dev, seed=6)
            tokens = max(MIN_POOL_TOKENS // 4, max(S * L for S, L in args.high_escape_cells))
            pools = fill_pools(src, args.codes, tokens, dev, calib)
            reg["tokens"] = pools.tokens
            reg["refused"] = {f"code{cb}": why for cb, why in pools.refused.items()}
            for cb, why in pools.refused.items():
                print(f"high-escape regime {name}: the {cb}-bit code refused {why}", flush=True)
            gen = torch.Generator().manual_seed(17)
            reg["codes"] = check_codes(pools, src, gen, dev, writes=False)
            base = Baseline(pools, dev, out)
            fa3 = None if fa3_fns is None else FA3(pools, fa3_fns, dev)
            reg["accuracy"] = accuracy(pools, base, fa3, gen, dev)
            reg["rows"] = [time_row(S, L, pools, base, fa3, gen, dev, [], []) for S, L in args.high_escape_cells]
            rates = {cb: (f"{i['k_escape_rate']:.2%} K, {i['v_escape_rate']:.2%} V")
                     for cb, i in reg["codes"].items()}
            print(f"\nhigh-escape regime {name}: tables of layer {cal_layer}, K/V of layer {data_layer} x {2**shift}; "
                  f"escapes {rates}", flush=True)
            print_table(reg["rows"], list(pools.codes), None, [])
        except Exception as exc:
            reg["error"] = repr(exc)[:300]
            traceback.print_exc()
        torch.cuda.empty_cache()
        log("high_escape", regimes, out)
    return regimes


def main_grid(args: argparse.Namespace, fa3_fns: tuple[Callable[..., object], Callable[..., object]] | None,
              read_tbs: float | None, dev: str, out: Path | None) -> None:
    """The pools of the recorded samples: each code checked, accuracy, the cells timed, the model, the graph steps."""
    src = Source(15, dev)
    bf16_batch = gpu_model.batches(args.kv_gib, None, H, D)["bf16"]
    model_tokens = 0 if args.no_model else 2 * bf16_batch * CONTEXT  # a page code holds < 2x the sequences
    pools = fill_pools(src, args.codes, max(MIN_POOL_TOKENS, max(S * L for S, L in args.cells), model_tokens), dev)
    for cb, why in pools.refused.items():  # the main grid's codes then show as missing in the verdict
        log(f"code{cb}", {"refused": why}, out)
    gen = torch.Generator().manual_seed(3)  # one stream, in this order: read-back tiles, accuracy cases, grid cases
    for key, info in check_codes(pools, src, gen, dev, writes=not args.no_writes).items():
        log(key, info, out)
    base = Baseline(pools, dev, out)
    fa3 = None if fa3_fns is None else FA3(pools, fa3_fns, dev)

    acc = accuracy(pools, base, fa3, gen, dev, args.variants)
    log("attention_accuracy", acc, out)
    print("accuracy", json.dumps(acc), flush=True)

    rows = []
    for S, L in args.cells:
        row = time_row(S, L, pools, base, fa3, gen, dev, args.variants, args.splits)
        rows.append(row)
        print("row", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        log("rows", rows, out)

    print_table(rows, list(pools.codes), read_tbs, args.splits)

    if not args.no_model:
        model = gpu_model.throughput_model(
            pools, lambda S, L: time_row(S, L, pools, base, fa3, gen, dev, [], []), dev, args.kv_gib, H, D)
        log("throughput_model", model, out)
        gpu_model.print_model(model)

    if args.graph_batches:
        code = pools.codes[max(pools.codes)]
        ggen = torch.Generator().manual_seed(11)
        steps = [gpu_graph.step_times(code, S, H, HQ, SCALE, pools.nblocks, ggen, dev) for S in args.graph_batches]
        log("graph_steps", steps, out)
        gpu_graph.print_steps(steps)


def main() -> int:
    args = parse_args()
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = "cuda"
    log("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), out)
    log("device", torch.cuda.get_device_name(), out)
    log("torch", torch.__version__, out)
    log("args", {k: v for k, v in vars(args).items() if k != "out"}, out)
    fa3_fns = None
    if args.no_fa3:
        log("fa3", {"available": False, "reason": "--no-fa3"}, out)
    else:
        loaded = load_fa3()
        if isinstance(loaded, str):
            log("fa3", {"available": False, "reason": loaded}, out)
            print(f"FlashAttention 3 is unavailable: {loaded}.\nThe bars are against FlashAttention 3: stage vLLM 0.33 "
                  "(../shared/tools/vllm-on-device) and run with PYTHONPATH=/tmp/site on a Hopper GPU, or pass "
                  "--no-fa3 to time the rest (the verdict then fails).", file=sys.stderr)
            return 2
        import vllm

        fa3_fns = loaded
        log("fa3", {"available": True, "vllm": vllm.__version__, "vllm_path": str(Path(vllm.__file__).parent)}, out)

    from bench import gpu_read

    try:
        read = gpu_read.read_only_rate(dev)
    except Exception as exc:
        read = {"error": repr(exc)[:300]}
        traceback.print_exc()
    log("read_only", read, out)
    read_tbs = gpu_bars.number(read, "TBps")
    copy_tbs = copy_bandwidth(dev)
    log("copy_TBps", copy_tbs, out)
    print(f"{torch.cuda.get_device_name()}: read-only {read_tbs or float('nan'):.2f} TB/s ({json.dumps(read)}), "
          f"copy {copy_tbs:.2f} TB/s", flush=True)

    main_grid(args, fa3_fns, read_tbs, dev, out)
    torch.cuda.empty_cache()  # the main pools went with main_grid
    if args.high_escape_cells:
        high_escape(args, fa3_fns, dev, out)

    failures = gpu_bars.judge(LOG, args.codes, args.cells, args.high_escape_cells)
    full = gpu_bars.full_grid(args.codes, args.cells)
    log("verdict", {"pass": not failures, "failures": failures, "full_grid": full,
                    "cells": args.cells, "codes": args.codes, "bars": vars(gpu_bars.BARS)}, out)
    scope = "issue 29's full grid" if full else f"{len(args.cells)} cell(s), codes {args.codes} (not the full grid)"
    if failures:
        print(f"\nVERDICT: FAIL ({len(failures)} failures, {scope})", *failures, sep="\n  ", flush=True)
        return 1
    print(f"\nVERDICT: PASS ({scope})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
