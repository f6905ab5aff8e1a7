"""GPU benchmark of the KV page code's CUDA kernels at Qwen3-8B shapes (one call of the device tool runs it all).

Shapes: 32 query heads, 8 KV heads, head 128, block 16 (one attention layer). K/V come from the demo model's
recordings (bench/kv_samples/smollm2_kv.safetensors): token rows are resampled per KV head and the 64 recorded
channels tiled to 128, so every channel's exponent statistics are the model's; the window tops and the escape
reserve come from the same samples.

In one run, for each page code (3- and 4-bit): the page pool written by the CUDA writer from the same tokens (its
throughput on a 32k-token prefill run and on single decode tokens), tiles read back bit for bit against the bf16
source (overflow tiles included), attention against fp32 (NaN-poisoned outputs, the same bits twice); then decode
attention for batch x context of (a) ours on compressed pages of each code, (b) vLLM 0.33's Triton unified attention
on bf16 pages (carried under .baseline/, see /work/shared/tools/vllm-triton-baseline), (c) torch SDPA on contiguous
bf16, each timed from CUDA-graph replays (median; inputs rotated where a case would sit in L2), side by side.
Prints a table; writes gpu_bench.json under --out.

Run (device):  PYTHONUNBUFFERED=1 python3 bench/gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / ".baseline"))

import torch  # noqa: E402

from glyd_engine.format import kv_page as kp  # noqa: E402
from kernels import kv_cuda  # noqa: E402

HQ, H, D, B = 32, 8, 128, 16
SAMPLES = ROOT / "bench" / "kv_samples" / "smollm2_kv.safetensors"
MAX_BITS = 11.3  # the page code's budget at D = 128, everything included
LOG: dict[str, object] = {}


def log(key: str, value: object, out: Path | None) -> None:
    LOG[key] = value
    if out is not None:
        (out / "gpu_bench.json").write_text(json.dumps(LOG, indent=1, default=str))


class Source:
    """Resamples recorded K/V rows into [N, 8, 128] bf16 with the recorded per-channel statistics."""

    def __init__(self, layer: int, device: str, seed: int = 0) -> None:
        from safetensors.torch import load_file

        rec = load_file(str(SAMPLES))
        tiled = []
        for kv in ("k", "v"):
            x = rec[f"{kv}{layer}"]  # [T, 3, 64]
            heads = [torch.cat([x[:, h % 3], x[:, (h + 1) % 3]], dim=-1) for h in range(H)]
            tiled.append(torch.stack(heads, dim=1).to(device))  # [T, 8, 128]
        self.k, self.v = tiled
        self.n = self.k.shape[0]
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, self.n, (n, H), generator=self.gen, device=self.device)
        hh = torch.arange(H, device=self.device).view(1, H)
        return self.k[idx, hh], self.v[idx, hh]

    def tops(self, code_bits: int) -> torch.Tensor:
        counts = []
        for x in (self.k, self.v):
            e = ((x.view(torch.int16).to(torch.int32) >> 7) & 0xFF).to(torch.int64).cpu()
            counts.append(torch.nn.functional.one_hot(e, 256).sum(0))
        return kp.best_windows(torch.stack(counts), code_bits)  # [2, H, D]


def bench_fn(fn) -> float:  # noqa: ANN001
    """Median ms of fn replayed from a CUDA graph."""
    import triton.testing as tt

    return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))


def copy_bandwidth(dev: str) -> float:
    import triton.testing as tt

    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda: b.copy_(a), warmup=5, rep=50, return_mode="median")
    return 2 * n / ms / 1e9  # TB/s


def reserve_for(src: Source, tops: torch.Tensor, code_bits: int) -> tuple[int, dict[str, float]]:
    """The reserve (entries a tile): the 3-bit code's as large as MAX_BITS allows (a tile past its list costs the
    kernel dependent loads), the 4-bit code's the calibration rule's (mean + one standard deviation)."""
    w = kp.window(code_bits)
    k, v = src.draw(4096 * 16)
    low = tops.to(k.device).to(torch.int32) - (w - 1)
    esc = []
    for kv, x in enumerate((k, v)):
        e = (x.view(torch.int16).to(torch.int32) >> 7) & 0xFF
        esc.append(((e < low[kv]) | (e >= low[kv] + w)).view(-1, 16, H, D).sum((1, 3)).float())  # [tiles, H]
    per_tile = (esc[0] + esc[1]).flatten()
    mean = float(per_tile.mean())
    if code_bits == 3:
        reserve = max(r for r in range(4, 400, 8) if bits_per_value(kp.KVPageLayout(D, B, r, 3)) <= MAX_BITS)
    else:
        reserve = kp.valid_reserve(math.ceil(mean + math.sqrt(mean)))
    stats = {"k_escape_rate": float(esc[0].mean() / (16 * D)), "v_escape_rate": float(esc[1].mean() / (16 * D)),
             "entries_a_tile_mean": mean, "entries_a_tile_p90": float(per_tile.quantile(0.9)),
             "entries_a_tile_max": float(per_tile.max())}
    return reserve, stats


def bits_per_value(lay: kp.KVPageLayout) -> float:
    """Pages plus the overflow run pointers (4 bytes a tile and K/V)."""
    return 8 * lay.token_bytes / (2 * D) + 64 / (B * 2 * D)


class Code:
    """One page code (3 or 4 bits) over the shared source data: its layout, its pool written by the CUDA writer."""

    def __init__(self, code_bits: int, src: Source, nblocks: int, dev: str) -> None:
        self.bits = code_bits
        tops = src.tops(code_bits)
        reserve, stats = reserve_for(src, tops, code_bits)
        self.lay = kp.KVPageLayout(D, B, reserve, code_bits)
        self.tops = tops.to(dev)
        self.info = {"reserve": reserve, "token_bytes": self.lay.token_bytes, "bits_per_value": bits_per_value(
            self.lay), "capacity_vs_bf16": 4 * D / (self.lay.token_bytes + 8 / B), **stats}
        t0 = time.perf_counter()
        kv_cuda.kernels(self.lay, HQ // H, torch.device(dev))
        self.info["first_compile_s"] = time.perf_counter() - t0
        self.cache = torch.empty(nblocks, H, self.lay.page_bytes, dtype=torch.uint8, device=dev)
        self.ovf = kp.OverflowStore(nblocks, H, device=dev)
        self.write_rounds = 0

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.write_rounds += kv_cuda.write(self.cache, self.lay, self.tops, self.ovf, k, v, slots)

    def pool_info(self, tokens: int) -> dict[str, object]:
        return {"overflow_runs": self.ovf.runs_in_use, "overflow_bits_per_value": 8 * self.ovf.bytes_held / (
            tokens * H * 2 * D), "write_rounds": self.write_rounds}


def write_throughput(code: Code, src: Source, dev: str) -> dict[str, float]:
    """A fresh 32k-token prefill run, and one decode token for each of 128 sequences (host sync included)."""
    import triton.testing as tt

    chunk, lay = 32768, code.lay
    k, v = src.draw(chunk)
    wc = torch.empty(chunk // B, H, lay.page_bytes, dtype=torch.uint8, device=dev)
    wo = kp.OverflowStore(chunk // B, H, device=dev, initial_entries=1 << 22)
    slots = torch.arange(chunk, device=dev)
    kv_cuda.write(wc, lay, code.tops, wo, k, v, slots)  # runs allocated: the timed calls need no growth
    ms = float(tt.do_bench(lambda: kv_cuda.write(wc, lay, code.tops, wo, k, v, slots), warmup=5, rep=50,
                           return_mode="median"))
    k1, v1 = src.draw(128)
    s1 = torch.arange(128, device=dev) * B  # token 0 of each tile: every call starts the tiles anew
    ms1 = float(tt.do_bench(lambda: kv_cuda.write(wc, lay, code.tops, wo, k1, v1, s1), warmup=5, rep=50,
                            return_mode="median"))
    return {"prefill_32k_ms": ms, "prefill_32k_GBps_bf16_in": chunk * H * D * 4 / ms / 1e6,
            "decode_128_tokens_ms_with_sync": ms1}


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


def main() -> None:  # noqa: C901, PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--codes", default="3,4", help="page codes to time (bits)")
    ap.add_argument("--variants", default="", help="extra builds timed per row, e.g. MIN_BLOCKS=3;WARPS=8")
    args = ap.parse_args()
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    dev = "cuda"
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    log("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), out)
    log("device", torch.cuda.get_device_name(), out)
    log("torch", torch.__version__, out)
    copy_tbs = copy_bandwidth(dev)
    log("copy_TBps", copy_tbs, out)
    print(f"{torch.cuda.get_device_name()}: copy {copy_tbs:.2f} TB/s", flush=True)

    # --- the pools: the same bf16 tokens in vLLM's layout and in each code's pages ------------------------------
    src = Source(15, dev)
    max_tokens = max(batches) * max(contexts)
    nblocks = max_tokens // B
    k_pool = torch.empty(nblocks, B, H, D, dtype=torch.bfloat16, device=dev)
    v_pool = torch.empty_like(k_pool)
    codes = {cb: Code(cb, src, nblocks, dev) for cb in (int(x) for x in args.codes.split(","))}
    chunk = 32768
    for start in range(0, max_tokens, chunk):
        k, v = src.draw(chunk)
        k_pool.view(-1, H, D)[start : start + chunk] = k
        v_pool.view(-1, H, D)[start : start + chunk] = v
        slots = torch.arange(start, start + chunk, device=dev)
        for code in codes.values():
            code.write(k, v, slots)
    torch.cuda.synchronize()
    gen = torch.Generator().manual_seed(3)
    for cb, code in codes.items():
        info = {**code.info, **code.pool_info(max_tokens)}
        for name, fn in (("writes", lambda c=code: write_throughput(c, src, dev)),
                         ("read_back", lambda c=code: read_back(c, k_pool, v_pool, gen))):
            try:
                info[name] = fn()
            except Exception as exc:  # noqa: BLE001
                info[name] = {"error": repr(exc)[:300]}
                traceback.print_exc()
        log(f"code{cb}", info, out)
        print(f"code{cb}", json.dumps(info), flush=True)

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

    def ours(code, q, bt, lens, L, o, variant=()):  # noqa: ANN001, ANN202
        return lambda: kv_cuda.decode_attention(q, code.cache, code.lay, code.tops, bt, lens, L, scale, code.ovf,
                                                out=o, variant=variant)

    variants = [tuple((k, int(v)) for k, v in (kv.split("=") for kv in part.split(",")))
                for part in args.variants.split(";") if part]

    def scratch_for(S: int):  # noqa: ANN202
        return (torch.empty(S, HQ, 16, D, dtype=torch.float32, device=dev),
                torch.empty(S, HQ, 16, dtype=torch.float32, device=dev),
                torch.empty(S, HQ, 16, dtype=torch.float32, device=dev))

    def vllm_fn(q, bt, lens, L, o, sc):  # noqa: ANN001, ANN202
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=dev)
        return lambda: unified_attention(q, k_pool, v_pool, o, cu, 1, lens, L, scale, True, (-1, -1), bt, 0, None,
                                         None, None, seq_threshold_3D=128 // H, num_par_softmax_segments=16,
                                         softmax_segm_output=sc[0], softmax_segm_max=sc[1], softmax_segm_expsum=sc[2])

    def ref_fp32(q, bt, L):  # noqa: ANN001, ANN202
        S = q.shape[0]
        k = k_pool[bt.long()].reshape(S, -1, H, D)[:, :L].float().repeat_interleave(HQ // H, dim=2)
        v = v_pool[bt.long()].reshape(S, -1, H, D)[:, :L].float().repeat_interleave(HQ // H, dim=2)
        s = torch.einsum("shd,slhd->shl", q.float(), k) * scale
        return torch.einsum("shl,slhd->shd", torch.softmax(s, -1), v)

    # --- accuracy: against fp32, NaN-poisoned outputs, the same bits twice ------------------------------------------
    acc = []
    for S, L in ((8, 1024), (2, 32768), (64, 2000), (3, 37)):
        row: dict[str, object] = {"batch": S, "context": L}
        try:
            bt, lens, q = make_case(S, L, 0)
            ref = ref_fp32(q, bt, L)
            for cb, code in codes.items():
                o1, o2 = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
                ours(code, q, bt, lens, L, o1)()
                ours(code, q, bt, lens, L, o2)()
                row[f"code{cb}_rel_err"] = float((o1.float() - ref).norm() / ref.norm())
                row[f"code{cb}_nan"] = bool(torch.isnan(o1).any())
                row[f"code{cb}_same_bits_twice"] = bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16)))
            if unified_attention is not None:
                o3 = torch.empty_like(q)
                vllm_fn(q, bt, lens, L, o3, scratch_for(S))()
                row["vllm_rel_err"] = float((o3.float() - ref).norm() / ref.norm())
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:300]
            traceback.print_exc()
        acc.append(row)
    log("attention_accuracy", acc, out)
    print("accuracy", json.dumps(acc), flush=True)

    # --- decode attention grid ---------------------------------------------------------------------------------------
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for S in batches:
        for L in contexts:
            row = {"batch": S, "context": L}
            try:
                nbs = (L + B - 1) // B
                bf_bytes = S * L * H * D * 4
                rot = max(1, min(16, math.ceil(4 * l2 / (0.7 * bf_bytes))))
                cases, first = [], 0
                for _ in range(rot):
                    cases.append(make_case(S, L, first))
                    first = first + S * nbs if first + 2 * S * nbs <= nblocks else 0
                outs = [torch.empty_like(c[2]) for c in cases]
                row["splits"] = kv_cuda.num_splits_for(S, H, L)
                for cb, code in codes.items():
                    for var in [(), *variants]:
                        fns = [ours(code, q, bt, lens, L, o, var) for (bt, lens, q), o in zip(cases, outs, strict=True)]
                        name = f"code{cb}" + "".join(f",{k}={v}" for k, v in var)
                        row[f"{name}_ms"] = bench_fn(lambda fns=fns: [f() for f in fns]) / rot
                    row[f"code{cb}_TBps"] = S * nbs * H * code.lay.page_bytes / row[f"code{cb}_ms"] / 1e9
                if unified_attention is not None:
                    sc = scratch_for(S)
                    vf = [vllm_fn(q, bt, lens, L, o, sc) for (bt, lens, q), o in zip(cases, outs, strict=True)]
                    row["vllm_ms"] = bench_fn(lambda vf=vf: [f() for f in vf]) / rot
                srot = rot if bf_bytes * rot < 8e9 else 1
                sd = []
                for bt, _lens, q in cases[:srot]:
                    kc = k_pool[bt.long()].reshape(S, -1, H, D)[:, :L].transpose(1, 2).contiguous()
                    vc = v_pool[bt.long()].reshape(S, -1, H, D)[:, :L].transpose(1, 2).contiguous()
                    sd.append((q.view(S, HQ, 1, D), kc, vc))

                def sdpa(sd=sd):  # noqa: ANN001, ANN202
                    for qq, kc, vc in sd:
                        torch.nn.functional.scaled_dot_product_attention(qq, kc, vc, scale=scale, enable_gqa=True)
                row["sdpa_ms"] = bench_fn(sdpa) / len(sd)
                del sd
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:300]
                traceback.print_exc()
            torch.cuda.empty_cache()
            rows.append(row)
            print("row", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            log("rows", rows, out)

    cbs = list(codes)
    print("\n| batch | ctx | " + " | ".join(f"{cb}-bit ms" for cb in cbs) + " | vLLM ms | SDPA ms | "
          + " | ".join(f"{cb}-bit vs vLLM" for cb in cbs) + " | " + " | ".join(f"{cb}-bit vs SDPA" for cb in cbs)
          + " | " + " | ".join(f"{cb}-bit of copy" for cb in cbs) + " |")
    print("|---" * (4 + 4 * len(cbs)) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['batch']} | {r['context']} | error |")
            continue
        ms = [f"{r[f'code{cb}_ms']:.3f}" for cb in cbs]
        vs = [f"{r['vllm_ms'] / r[f'code{cb}_ms']:.2f}x" if "vllm_ms" in r else "-" for cb in cbs]
        sd = [f"{r['sdpa_ms'] / r[f'code{cb}_ms']:.2f}x" for cb in cbs]
        fr = [f"{r[f'code{cb}_TBps'] / copy_tbs:.0%}" for cb in cbs]
        print(f"| {r['batch']} | {r['context']} | {' | '.join(ms)} | {r.get('vllm_ms', float('nan')):.3f} | "
              f"{r['sdpa_ms']:.3f} | {' | '.join(vs)} | {' | '.join(sd)} | {' | '.join(fr)} |")


if __name__ == "__main__":
    main()
