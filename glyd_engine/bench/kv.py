"""`glyd bench kv`: the real vLLM engine with and without the lossless KV cache, same KV memory.

Each engine runs in its own child process (`python -m glyd_engine.bench.kv --child SPEC`): vLLM spawns
processes and keeps global state, and a child's exit frees all of it. A child runs the workloads a spec
names and prints one JSON line (prefixed `GLYD_RESULT `). The parent compares off against lossless.
Tests in tests/vllm use the same children. JSON turns every NaN into one NaN, so prompt logprobs also cross
as the hex of their IEEE bit patterns (`prompt_logprobs_bits`), which is what `bits_equal` compares.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from glyd_engine import torch_extras
from glyd_engine.machine import cpu_build, model_gets_every_core

RESULT = "GLYD_RESULT "
DEFAULT_KV_BYTES = 160 * 1024 * 1024


# -- the child (one engine) ----------------------------------------------------------------------------
def corpus_ids(tokenizer: Any, n: int, skip: int = 0) -> list[int]:
    """n token ids of the held-out corpus (repeated if short), starting `skip` tokens in."""
    from glyd_engine.corpus import heldout_texts

    ids: list[int] = []
    for t in heldout_texts():
        ids += tokenizer(t.text, add_special_tokens=False)["input_ids"]
    while len(ids) < n + skip:
        ids += ids
    return ids[skip : skip + n]


def _engine(spec: dict[str, Any]) -> Any:
    """One engine for a spec. On the CPU build eager unless `compiled`; with `gpu`, vLLM's defaults (torch.compile,
    CUDA graphs) unless `eager`, its KV budget a fixed `kv_bytes` or else `gpu_memory_utilization`."""
    torch_extras.guard()
    from vllm import LLM

    from glyd_engine.engine.engine_args import engine_args
    from glyd_engine.engine.protocol import EngineSettings

    gpu = bool(spec.get("gpu"))
    eager = bool(spec.get("eager")) if gpu else not spec.get("compiled")  # compiled: vLLM's default (torch.compile)
    kv_bytes = int(spec.get("kv_bytes", 0 if gpu else DEFAULT_KV_BYTES)) or None
    settings = EngineSettings(kv=spec["mode"], max_model_len=int(spec.get("max_model_len", 8192)),
                              kv_cache_bytes=kv_bytes, enforce_eager=eager,
                              gpu_memory_utilization=float(spec.get("gpu_memory_utilization", 0.85)),
                              max_num_batched_tokens=int(spec.get("max_num_batched_tokens") or 0) or None)
    glyd: dict[str, Any] = {"check": True} if spec.get("check") else {}
    for key in ("kernels", "code", "weights", "arena_mb"):
        if spec.get(key):
            glyd[key] = str(spec[key])
    extra: dict[str, Any] = {k: int(spec[k]) for k in ("max_num_seqs", "block_size", "tensor_parallel_size",
                                                        "pipeline_parallel_size") if spec.get(k)}
    for key in ("quantization", "attention_backend"):
        if spec.get(key):
            extra[key] = spec[key]
    if spec.get("executor"):  # "mp": the worker in a process of its own, as vLLM's CPU server runs it
        extra["distributed_executor_backend"] = spec["executor"]
    if "prefix_caching" in spec:
        extra["enable_prefix_caching"] = bool(spec["prefix_caching"])
    return LLM(**engine_args(spec["model"], settings, cpu=not gpu, glyd=glyd, seed=0,
                             **{"enable_prefix_caching": True, "enable_chunked_prefill": True,
                                "disable_log_stats": False, **extra}))


def _prompt_logprobs(llm: Any, prompts: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    result = []
    for out, ids in zip(outs, prompts, strict=True):
        lps = out.prompt_logprobs or []
        result.append([float(d[t].logprob) for d, t in zip(lps[1:], ids[1:], strict=True)])
    return result


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None) -> list[Any]:
    """vLLM's request outputs of greedy decoding (EOS ignored), with `logprobs` top entries a token if asked."""
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)


def _greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in _generate(llm, prompts, max_tokens)]


def prefix_prompts(tokenizer: Any, n: int, prefix_tokens: int, tail_tokens: int) -> list[list[int]]:
    """n prompts sharing one long prefix (prefix-cache hits), each with its own tail."""
    base = corpus_ids(tokenizer, prefix_tokens + n * tail_tokens)
    prefix = base[:prefix_tokens]
    return [prefix + base[prefix_tokens + i * tail_tokens : prefix_tokens + (i + 1) * tail_tokens]
            for i in range(n)]


def decode_sweep(llm: Any, tok: Any, sweep: dict[str, Any], kv_tokens: int) -> list[dict[str, Any]]:
    """Decode tokens a second at each context x batch, prefill left out: the batch's distinct prompts are prefilled
    once (which fills the prefix cache: the time of the first is the time to first token), prefilled again from the
    cache with one new token (t1), then decoded `max_tokens` more from the cache (t2): the decode rate is
    batch x max_tokens / (t2 - t1), t1 and t2 each the least of `repeats` runs (single runs of the same cell on one
    GPU differ by up to 1.5x, though the kernels' time in them does not). A cell whose batch x (context + new
    tokens) exceeds the cache is "does not fit"; contexts named in `largest` also run the largest batch the cache
    holds. Cells named in `profile` ([context, batch or "max"]) run their decode once more under torch's profiler,
    after the timed runs (`profile` in the row: glyd_engine/bench/kernel_times.py); where `cells` names some (same
    form), only those run: one question of the grid answered in a fraction of a GPU call."""
    new = int(sweep.get("max_tokens", 64))
    repeats = max(1, int(sweep.get("repeats", 3)))
    profiled = {(int(c), str(b)) for c, b in sweep.get("profile", [])}
    only = {(int(c), str(b)) for c, b in sweep.get("cells", [])}
    rows = []
    for ctx in sweep["contexts"]:
        for batch in sweep["batches"] + (["max"] if ctx in sweep.get("largest", []) else []):
            if only and (ctx, str(batch)) not in only:
                continue
            b = max(1, kv_tokens // (ctx + new + 16)) if batch == "max" else int(batch)
            row: dict[str, Any] = {"context": ctx, "batch": b, "largest": batch == "max"}
            if b * (ctx + new + 16) > kv_tokens:
                rows.append({**row, "fits": False})
                continue
            prompts = [corpus_ids(tok, ctx, skip=7919 * i + 13 * ctx) for i in range(b)]
            t = time.monotonic()
            _greedy(llm, prompts[:1], 1)
            ttft = time.monotonic() - t
            _greedy(llm, prompts, 1)  # the rest of the batch into the prefix cache
            t1s, t2s = [], []
            for _ in range(repeats):
                t = time.monotonic()
                _greedy(llm, prompts, 1)
                t1s.append(time.monotonic() - t)
                t = time.monotonic()
                outs = _greedy(llm, prompts, 1 + new)
                t2s.append(time.monotonic() - t)
            done = sum(len(o) for o in outs) - b
            t1, t2 = min(t1s), min(t2s)
            print(f"sweep ctx={ctx} batch={b}: ttft {ttft:.3f} s, decode {min(t2s):.3f} s", file=sys.stderr,
                  flush=True)  # the child's log shows how far a run killed at its limit got
            rows.append({**row, "fits": True, "ttft_s": round(ttft, 4), "t1_s": round(t1, 4), "t2_s": round(t2, 4),
                         "decode_tokens_per_s": round(done / max(1e-9, t2 - t1), 1),
                         "runs_tokens_per_s": [round(done / max(1e-9, y - x), 1)
                                               for x, y in zip(t1s, t2s, strict=True)]})
            if (ctx, str(batch)) in profiled:
                from glyd_engine.bench.kernel_times import kernel_times

                rows[-1]["profile"] = kernel_times(lambda prompts=prompts: _greedy(llm, prompts, 1 + new))
    return rows


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's preemption and prefix-cache counters (what the stress workload must have exercised)."""
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if any(k in m.name for k in ("preempt", "prefix_cache")) and isinstance(getattr(m, "value", None),
                                                                                   int | float):
                out[m.name] = out.get(m.name, 0) + m.value
    except Exception as exc:  # metrics are a report, never a failure
        out["error"] = str(exc)  # type: ignore[assignment]
    return out


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("one_schedule"):  # the engine core in this process: every prompt queued before the first step
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch_extras.guard()
    import vllm

    t0 = time.monotonic()
    llm = _engine(spec)
    cfg = llm.llm_engine.vllm_config.cache_config
    res: dict[str, Any] = {"mode": spec["mode"], "vllm": vllm.__version__, "start_s": round(time.monotonic() - t0, 1),
                           "compilation_mode": getattr(llm.llm_engine.vllm_config.compilation_config.mode, "name", ""),
                           "num_blocks": cfg.num_gpu_blocks, "block_size": cfg.block_size,
                           "kv_tokens": int(cfg.num_gpu_blocks or 0) * int(cfg.block_size)}
    tok = llm.get_tokenizer()
    work = spec.get("work", {})
    if "logprobs" in work:  # prompt lengths
        t = time.monotonic()
        prompts = [corpus_ids(tok, n, skip=97 * i) for i, n in enumerate(work["logprobs"])]
        res["prompt_logprobs"] = _prompt_logprobs(llm, prompts)
        res["logprobs_s"] = round(time.monotonic() - t, 1)
    if "greedy" in work:  # {"prompts": [lengths], "max_tokens": m}
        g = work["greedy"]
        prompts = [corpus_ids(tok, n, skip=131 * i) for i, n in enumerate(g["prompts"])]
        res["greedy"] = _greedy(llm, prompts, int(g["max_tokens"]))
    if "prefix" in work:  # {"n": 14, "prefix": 600, "tail": 40, "max_tokens": 24}: shared-prefix hits
        p = work["prefix"]
        prompts = prefix_prompts(tok, int(p["n"]), int(p["prefix"]), int(p["tail"]))
        first = _greedy(llm, prompts[:1], int(p["max_tokens"]))  # fills the prefix cache
        res["prefix_greedy"] = first + _greedy(llm, prompts[1:], int(p["max_tokens"]))
    if "stress" in work:  # many requests at once, mixed lengths, shared prefixes, under a small cache
        s = work["stress"]
        prompts = prefix_prompts(tok, int(s["n"]), int(s["prefix"]), int(s["tail"]))
        prompts += [corpus_ids(tok, n, skip=53 * i) for i, n in enumerate(s.get("extra", []))]
        t = time.monotonic()
        outs = _greedy(llm, prompts, int(s["max_tokens"]))
        res["stress"] = {"requests": len(prompts), "completed": sum(len(o) == int(s["max_tokens"]) for o in outs),
                         "seconds": round(time.monotonic() - t, 1)}
    if "speed" in work:  # {"batch": 8, "prompt": 64, "max_tokens": 64}; "batches": [1, 64] times each
        s = work["speed"]
        glyd = spec["mode"] != "off" and spec.get("check")
        if glyd:  # time the cache, not the debug compare (the shadow stays written)
            from glyd_engine.vllm_plugin.state import pause_compare

            llm.collective_rpc(pause_compare, args=(True,))
        by_batch = {}
        for batch in s.get("batches") or [int(s["batch"])]:
            prompts = [corpus_ids(tok, int(s["prompt"]), skip=1000 + 211 * i) for i in range(int(batch))]
            _greedy(llm, prompts, 4)  # warm-up: the same batch's graphs and kernels
            t = time.monotonic()
            outs = _greedy(llm, prompts, int(s["max_tokens"]))
            by_batch[str(batch)] = round(sum(map(len, outs)) / (time.monotonic() - t), 2)
        if glyd:
            llm.collective_rpc(pause_compare, args=(False,))
        res["decode_tokens_per_s_by_batch"] = by_batch
        res["decode_tokens_per_s"] = by_batch[str((s.get("batches") or [s["batch"]])[-1])]
        res["speed_batch"] = int((s.get("batches") or [s["batch"]])[-1])
    if "sweep" in work:  # {"contexts": [1024, 8192], "batches": [1, 8], "max_tokens": 64}
        res["sweep"] = decode_sweep(llm, tok, work["sweep"], int(res["kv_tokens"]))
    res["metrics"] = _counters(llm)
    from glyd_engine.vllm_plugin import kv_status

    res["kv_bytes_per_token"] = kv_status(llm.llm_engine.vllm_config)["bytes_per_token"]  # all layers, K and V
    if llm.llm_engine.vllm_config.model_config.quantization == "glyd":
        from glyd_engine.vllm_plugin.weights import worker_weight_bytes

        by_rank = llm.collective_rpc(worker_weight_bytes)
        res["weights"], res["weights_by_rank"] = by_rank[0], by_rank
    if spec["mode"] != "off":
        from glyd_engine.vllm_plugin.state import worker_share, worker_stats

        res["kv_shares"] = llm.collective_rpc(worker_share)  # each worker's layers and KV heads of the tables
        stats = llm.collective_rpc(worker_stats)
        res["stats"] = {k: sum(int(s[k]) for s in stats) for k in stats[0]} if stats else {}
    res["total_s"] = round(time.monotonic() - t0, 1)
    return res


# -- the parent --------------------------------------------------------------------------------------
def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(worker_stats) sends a function
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if cpu_build():
        model_gets_every_core(env)  # as `glyd serve` runs it
    return env


def run_engine(spec: dict[str, Any], timeout: float = 900, log: Path | None = None,
               module: str = "glyd_engine.bench.kv") -> dict[str, Any]:
    """Run one engine child (`python -m module --child SPEC`); its result dict, or RuntimeError with the
    log's tail (and its first Glyd line). Its output goes to files as it runs, so a child killed at the timeout
    still leaves what it printed, in `log` and in the error."""
    import tempfile

    spec = {**spec, "model": str(spec["model"])}
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        timed_out = False
        with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
            try:
                proc = subprocess.run([sys.executable, "-m", module, "--child", json.dumps(spec)], stdout=out_f,
                                      stderr=err_f, text=True, timeout=timeout, env=child_env())
                rc: int | str = proc.returncode
            except subprocess.TimeoutExpired:  # run() has killed the child
                timed_out, rc = True, f"killed after {timeout:.0f} s"
        stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    text = stdout + "\n" + stderr
    if log is not None:
        log.write_text(text)
    out = None if timed_out else parse_result(stdout)
    if out is not None:
        out["log"] = text
        return out
    cause = next((ln.strip() for ln in text.splitlines() if "Error: " in ln and "Engine core initialization" not in ln),
                 "")
    raise RuntimeError(f"engine ({spec['mode']}) failed, rc={rc}: {cause}\n{text[-6000:]}")


def parse_result(stdout: str) -> dict[str, Any] | None:
    """A child's result: its last `GLYD_RESULT` line, decoded (None when it printed none)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return None


def float_bits(rows: list[list[float]]) -> list[list[str]]:
    """Each float's IEEE-754 double bit pattern as 16 hex digits: -0.0, infinities and NaN payloads kept."""
    return [[struct.pack("<d", x).hex() for x in row] for row in rows]


def bits_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two children's prompt logprobs equal bit for bit: their bit patterns as the children read them (the
    floats of the JSON cannot tell NaN payloads apart). False when either has none."""
    ka, kb = a.get("prompt_logprobs_bits"), b.get("prompt_logprobs_bits")
    return bool(ka) and ka == kb


def run_kv_bench(model: Path, kv_bytes: int = DEFAULT_KV_BYTES, logprob_tokens: int = 2000, batch: int = 8,
                 max_tokens: int = 64, max_model_len: int = 4096, compiled: bool = False) -> dict[str, Any]:
    """Off, then lossless (with the read-back check), at the same fixed KV memory; eager unless `compiled`."""
    work = {"logprobs": [logprob_tokens], "speed": {"batch": batch, "prompt": 64, "max_tokens": max_tokens}}
    base = {"model": str(model), "kv_bytes": kv_bytes, "work": work, "compiled": compiled,
            "max_model_len": max(max_model_len, logprob_tokens + 16)}
    off = run_engine({**base, "mode": "off"})
    glyd = run_engine({**base, "mode": "lossless", "check": True})
    stats = glyd.get("stats", {})
    return {
        "model": str(model), "kv_cache_memory_bytes": kv_bytes, "block_size": off["block_size"],
        "kv_tokens_off": off["kv_tokens"], "kv_tokens_lossless": glyd["kv_tokens"],
        "capacity_ratio": round(glyd["kv_tokens"] / max(1, off["kv_tokens"]), 4),
        "kv_bytes_per_token_off": off["kv_bytes_per_token"], "kv_bytes_per_token_lossless": glyd["kv_bytes_per_token"],
        "prompt_logprob_tokens": logprob_tokens,
        "prompt_logprobs_identical": bits_equal(off, glyd),
        "values_checked": stats.get("values_checked", 0), "values_differing": stats.get("values_differing", 0),
        "escapes": stats.get("escapes", 0), "overflow_values": stats.get("overflow_values", 0),
        "decode_batch": batch,
        "decode_tokens_per_s_off": off["decode_tokens_per_s"],
        "decode_tokens_per_s_lossless": glyd["decode_tokens_per_s"],
        "vllm_version": off["vllm"], "device": "cpu", "compilation_mode": glyd.get("compilation_mode"),
    }


def child_main(argv: list[str], run: Any = None) -> int:
    """A child's entry: run the spec given after --child and print its result line for `run_engine`."""
    spec = json.loads(argv[argv.index("--child") + 1])
    res = (run or run_child)(spec)
    if "prompt_logprobs" in res:  # the bits, before JSON makes every NaN the same NaN
        res["prompt_logprobs_bits"] = float_bits(res["prompt_logprobs"])
    sys.stdout.write(RESULT + json.dumps(res) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv))
