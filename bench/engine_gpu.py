"""Glyd inside vLLM's CUDA build: engines side by side on one GPU, each in its own child process.

Every engine is a child of `glyd_engine.bench.kv` (its engine core in-process, every prompt queued before the first
step: one schedule, so off repeats itself bit for bit and lossless must reproduce it). A plan names the engines and
their workloads; the parent compares each engine with its plan's reference (off under the same settings): KV tokens,
prompt logprobs bit for bit (positions differing, the largest difference), greedy tokens, the values read back.
Writes each child's raw result and the comparison as JSON under --out, prints a table, and exits non-zero when a
check fails (a differing value, logprob or token where the plan demands equality) or an engine fails to start.

Run (device, vLLM staged; bench/device_setup.sh):
    python3 bench/engine_gpu.py --model DIR --plan demo --packed DIR --out $OUT
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glyd_engine.bench.kernel_times import format_kernel_times  # noqa: E402
from glyd_engine.bench.kv import run_engine  # noqa: E402
from glyd_engine.errors import UnsupportedModelError  # noqa: E402
from glyd_engine.model_shape import AttentionShape  # noqa: E402

GIB = 1 << 30


STRESS_BF16_TOKENS = 540  # the stress engine's KV memory in bf16 tokens: ~720 in 4-bit pages, short of its requests


def bf16_token_bytes(model: str) -> int:
    """Bytes a token of a bf16 KV cache takes in every layer (K and V), from the model's config.json; the demo
    model's 23,040 where there is none to read."""
    try:
        shape = AttentionShape.from_model_dir(Path(model))
    except (OSError, UnsupportedModelError):
        return 30 * 3 * 64 * 4
    return shape.num_layers * shape.num_kv_heads * shape.head_size * 2 * 2


def plans(model: str, logprob_prompts: int, logprob_len: int, packed: str = "") -> dict[str, list[dict[str, Any]]]:
    """Named lists of engine specs; the first of a plan is its reference (off under the same settings)."""
    work = {"logprobs": [logprob_len] * logprob_prompts,
            "greedy": {"prompts": [300 + 37 * i for i in range(8)], "max_tokens": 64},
            "prefix": {"n": 8, "prefix": 600, "tail": 40, "max_tokens": 32},
            "speed": {"batch": 64, "prompt": 64, "max_tokens": 128}}
    base = {"model": model, "gpu": True, "one_schedule": True, "kv_bytes": 2 * GIB,
            "max_model_len": max(4096, logprob_len + 64), "work": work}
    speed = {"model": model, "gpu": True, "one_schedule": True, "gpu_memory_utilization": 0.9,
             "max_model_len": 32768 + 256, "max_num_seqs": 256,
             "work": {"sweep": {"contexts": [1024, 8192, 32768], "batches": [1, 8, 32, 64, 128], "max_tokens": 64,
                                "largest": [8192, 32768]}}}
    weights_work = {**work, "speed": {**work["speed"], "batches": [1, 64]}}
    return {
        # each KV mode with vLLM's defaults (the check engine runs eager), and a Glyd checkpoint of the same model in
        # both weights modes, against off: capacity, prompt logprobs and greedy tokens bit for bit, values read back
        "demo": [
            {**base, "name": "off", "mode": "off", "work": weights_work},
            {**base, "name": "lossless", "mode": "lossless", "work": weights_work, "expect": ["logprobs"]},
            {**base, "name": "exact", "mode": "exact", "expect": ["logprobs", "greedy"]},
            {**base, "name": "lossless-check", "mode": "lossless", "eager": True, "check": True,
             "work": {k: v for k, v in work.items() if k != "speed"}, "expect": ["values"]},
            # a cache too small for its requests: preemption, chunked prefill and prefix hits, every value read back
            {**base, "name": "lossless-stress", "mode": "lossless", "eager": True, "check": True,
             "kv_bytes": STRESS_BF16_TOKENS * bf16_token_bytes(model), "max_model_len": 640,
             "max_num_batched_tokens": 64,
             "work": {"stress": {"n": 24, "prefix": 150, "tail": 100, "extra": [560, 400, 300], "max_tokens": 32}},
             "expect": ["values", "preempted"]},
            {**base, "name": "weights-exact", "mode": "off", "model": packed, "weights": "exact", "work": weights_work,
             "expect": ["logprobs", "greedy"]},
            {**base, "name": "weights-lossless", "mode": "off", "model": packed, "work": weights_work},
        ],
        # decode speed in the engine at 0.9 of the GPU's memory: lossless against off with vLLM's default backend
        # (FlashAttention 3 on Hopper) and with TRITON_ATTN
        "speed": [
            {**speed, "name": "off", "mode": "off"},
            {**speed, "name": "lossless", "mode": "lossless"},
            {**speed, "name": "off-triton", "mode": "off", "attention_backend": "TRITON_ATTN"},
        ],
    }


def _diff(a: list[list[float]] | None, b: list[list[float]] | None) -> dict[str, Any]:
    """Prompt logprobs of two engines: positions compared, positions whose bits differ, the largest difference."""
    if not a or not b:
        return {"positions": 0, "differing": None, "max_abs_diff": None}
    n = differing = 0
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        for x, y in zip(ra, rb, strict=True):
            n += 1
            if json.dumps(x) != json.dumps(y) or math.copysign(1, x) != math.copysign(1, y):
                differing += 1
                if math.isfinite(x) and math.isfinite(y):
                    worst = max(worst, abs(x - y))
    return {"positions": n, "differing": differing, "max_abs_diff": worst}


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """An engine's row against the reference's; outputs of an engine compiled otherwise (an eager check engine against
    a compiled reference) are not compared: torch.compile's fusions round differently, whatever the cache holds."""
    same_build = ref.get("compilation_mode") == got.get("compilation_mode")
    lp = _diff(ref.get("prompt_logprobs"), got.get("prompt_logprobs")) if same_build else {
        "positions": 0, "differing": None, "max_abs_diff": None,
        "not_compared": f"{got.get('compilation_mode')} against the reference's {ref.get('compilation_mode')}"}
    greedy, prefix = ([[a == b for a, b in zip(ref.get(k, []), got.get(k, []), strict=False)] if same_build else []
                       for k in ("greedy", "prefix_greedy")])
    stats = got.get("stats", {})
    return {
        "kv_tokens": got.get("kv_tokens"),
        "capacity_vs_ref": round(got.get("kv_tokens", 0) / max(1, ref["kv_tokens"]), 4),
        "start_s": got.get("start_s"), "prompt_logprobs": lp,
        "greedy_equal": f"{sum(greedy)}/{len(greedy)}", "prefix_greedy_equal": f"{sum(prefix)}/{len(prefix)}",
        "decode_tokens_per_s": got.get("decode_tokens_per_s"),
        "decode_tokens_per_s_by_batch": got.get("decode_tokens_per_s_by_batch"),
        "weights": got.get("weights"),
        "speed_vs_ref": round(got["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 3)
        if got.get("decode_tokens_per_s") and ref.get("decode_tokens_per_s") else None,
        "values_checked": stats.get("values_checked"), "values_differing": stats.get("values_differing"),
        "escapes": stats.get("escapes"), "overflow_values": stats.get("overflow_values"),
        "escapes_held": stats.get("escapes_held"), "overflow_values_held": stats.get("overflow_values_held"),
        "stress": got.get("stress"),
        "preempted": sum(v for k, v in got.get("metrics", {}).items() if "preempt" in k and isinstance(v, int | float)),
        "prefix_hits": sum(v for k, v in got.get("metrics", {}).items()
                           if "prefix_cache_hits" in k and isinstance(v, int | float)),
    }


def verdict(spec: dict[str, Any], row: dict[str, Any] | None) -> list[str]:
    """What an engine's row breaks of what its spec expects to equal the reference (`expect`): prompt logprobs bit
    for bit, greedy tokens (plain and with prefix-cache hits), every value read back."""
    if row is None:
        return []
    bad = []
    lp = row["prompt_logprobs"]
    if "logprobs" in spec.get("expect", []) and (not lp["positions"] or lp["differing"]):
        bad.append(f"{spec['name']}: {lp['differing']} of {lp['positions']} prompt logprobs differ from the reference")
    if "greedy" in spec.get("expect", []):
        for key in ("greedy_equal", "prefix_greedy_equal"):
            same, total = row[key].split("/")
            if same != total or total == "0":
                bad.append(f"{spec['name']}: {key} {row[key]}")
    if "values" in spec.get("expect", []) and (not row["values_checked"] or row["values_differing"]):
        bad.append(f"{spec['name']}: {row['values_differing']} of {row['values_checked']} values read back differ")
    if "preempted" in spec.get("expect", []):
        st = row.get("stress") or {}
        if not row.get("preempted") or st.get("completed") != st.get("requests"):
            bad.append(f"{spec['name']}: no preemption or unfinished requests ({row.get('preempted')} preempted, "
                       f"{st.get('completed')} of {st.get('requests')} completed)")
    return bad


def with_cells(specs: list[dict[str, Any]], cells: str, key: str) -> list[dict[str, Any]]:
    """The specs with their sweeps' `key` ("profile": cells to profile, "cells": the only cells to run) set to `cells`
    ("8192x32,8192xmax"), each a context x a batch or the largest."""
    try:
        parsed = [[int(c), b if b == "max" else int(b)] for c, _, b in (x.partition("x") for x in cells.split(","))]
    except ValueError:
        raise SystemExit(f"--{key} {cells!r}: cells are CONTEXTxBATCH, the batch a number or max, e.g. "
                         "8192x32,8192xmax") from None
    return [{**s, "work": {**s["work"], "sweep": {**s["work"]["sweep"], key: parsed}}}
            if "sweep" in s.get("work", {}) else s for s in specs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--plan", default="demo")
    ap.add_argument("--packed", default="", help="the model's Glyd checkpoint (plan demo)")
    ap.add_argument("--only", default="", help="comma-separated engine names of the plan to run; the plan's reference "
                                               "(its first engine) runs too, unless --reference gives its row")
    ap.add_argument("--eager", action="store_true",
                    help="every engine eager, the reference too: the numbers' check in a fraction of the start time, "
                         "not of torch.compile and CUDA graphs")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--budget-s", type=float, default=480, help="start no engine past this many seconds")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--profile", default="",
                    help="sweep cells (plan speed) whose decode runs once more under torch's profiler, e.g. "
                         "8192x32,8192xmax: the largest kernels of each engine side by side")
    ap.add_argument("--cells", default="",
                    help="the only sweep cells to run (plan speed), in --profile's form: one question of the grid in "
                         "a fraction of a GPU call")
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="end the run by this many seconds: each engine's timeout is clipped to what is left (a GPU "
                         "call's limit), and one with less than a minute left is not started")
    ap.add_argument("--reference", type=Path, default=None,
                    help="an engine_PLAN.json written on this GPU by an earlier call: its reference row is used and "
                         "the reference engine is not run again (a plan whose engines do not fit one call's limit)")
    ap.add_argument("--logprob-prompts", type=int, default=15)
    ap.add_argument("--logprob-len", type=int, default=2048)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    specs = plans(a.model, a.logprob_prompts, a.logprob_len, a.packed)[a.plan]
    if a.only:
        keep = set(a.only.split(","))
        specs = [s for s in specs if s["name"] in keep or s is specs[0]]
    if a.eager:
        specs = [{**s, "eager": True} for s in specs]
    if a.profile:
        specs = with_cells(specs, a.profile, "profile")
    if a.cells:
        specs = with_cells(specs, a.cells, "cells")
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    failures: list[str] = []
    if a.reference is not None:
        results[specs[0]["name"]] = earlier_reference(a.reference, a.plan, specs[0]["name"])
    for spec in specs:
        if spec["name"] in results:
            continue
        now = time.monotonic() - t0
        left = a.deadline_s - now - 10 if a.deadline_s else a.timeout_s  # 10 s to compare and write the JSON
        if now > a.budget_s or left < 60:
            failures.append(f"{spec['name']}: not run (budget)")
            continue
        print(f"== {spec['name']} ({now:.0f} s)", flush=True)
        try:
            res = run_engine(spec, timeout=min(a.timeout_s, left), log=a.out / f"{spec['name']}.log")
            res.pop("log", None)
            results[spec["name"]] = res
        except Exception as exc:  # a failed start is a result: keep going, report it, exit non-zero
            failures.append(f"{spec['name']}: {str(exc).splitlines()[0][:400]}")
            traceback.print_exc(limit=1)
        report(a, specs, results, failures, final=False)  # a call killed at its limit keeps the engines done
    return 1 if report(a, specs, results, failures, final=True) else 0


def earlier_reference(path: Path, plan: str, name: str) -> dict[str, Any]:
    """The reference engine's row of an earlier run of the same plan on a GPU of the same name (refused otherwise:
    its figures would not be side by side)."""
    import torch

    doc = json.loads(path.read_text())
    here = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if doc.get("plan") != plan or name not in doc.get("results", {}):
        raise SystemExit(f"--reference {path}: no {name!r} engine of plan {plan!r} there")
    if doc.get("device") != here:
        raise SystemExit(f"--reference {path} ran on {doc.get('device')}, this is {here}: run the reference here")
    return {**doc["results"][name], "reference_from": f"{path} ({doc.get('date')})"}


def report(a: argparse.Namespace, specs: list[dict[str, Any]], results: dict[str, Any], failures: list[str],
           final: bool) -> list[str]:
    """Compares each engine with the reference, writes engine_PLAN.json and returns every failure; prints the table
    when final."""
    ref_name = specs[0]["name"]
    table = {name: compare(results[ref_name], res) for name, res in results.items()} if ref_name in results else {}
    failures = failures + [f for spec in specs for f in verdict(spec, table.get(spec["name"]))]
    if final:
        for name, row in table.items():
            lp = row["prompt_logprobs"]
            outputs = (f"outputs not compared ({lp['not_compared']})" if "not_compared" in lp else
                       f"logprobs differing={lp['differing']}/{lp['positions']} max={lp['max_abs_diff']} "
                       f"greedy={row['greedy_equal']} prefix={row['prefix_greedy_equal']}")
            print(f"{name:16s} kv_tokens={row['kv_tokens']} ({row['capacity_vs_ref']}x) start={row['start_s']}s "
                  f"{outputs} "
                  f"tok/s={row['decode_tokens_per_s']} ({row['speed_vs_ref']}x) "
                  f"checked={row['values_checked']} differing={row['values_differing']}", flush=True)
        for name, res in results.items():
            for row in res.get("sweep", []):
                print(f"{name:12s} ctx={row['context']:6d} batch={row['batch']:4d} "
                      + (f"tok/s={row['decode_tokens_per_s']:9.1f} ttft={row['ttft_s']:.3f}s" if row["fits"]
                         else "does not fit"), flush=True)
        for name, res in results.items():
            for row in res.get("sweep", []):
                if "profile" in row:
                    label = f"{name} ctx={row['context']} batch={row['batch']} (a prefix-cache prefill, then decode)"
                    print(format_kernel_times(label, row["profile"]), flush=True)
        for f in failures:
            print("FAILED", f)
    import torch

    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "plan": a.plan, "model": a.model, "eager": a.eager, "complete": final, "table": table,
           "failures": failures,
           "results": {k: {kk: vv for kk, vv in v.items() if kk != "prompt_logprobs_bits"} for k, v in results.items()}}
    tmp = a.out / f".engine_{a.plan}.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(a.out / f"engine_{a.plan}.json")
    return failures


if __name__ == "__main__":
    sys.exit(main())
