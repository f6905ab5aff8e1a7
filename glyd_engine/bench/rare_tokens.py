"""Prompts built from a model's least-trained tokens, served by the real vLLM engine next to ordinary ones.

Finding the tokens (the "Magikarp" indicator, Land & Bartolo 2024, for tied embeddings): tokens that training
never (or hardly) showed the model keep rows of the embedding matrix that sit where untrained rows sit.

1. Rows: the unembedding matrix (`lm_head.weight`), or the input embeddings when they are tied (SmolLM2).
2. Remove the mean row and then the first principal component of what is left: a direction every row shares,
   which would otherwise dominate the cosines below.
3. Reference: the rows of special tokens the model never saw in text (for SmolLM2 the StarCoder code-data
   markers `<repo_name>` .. `<empty_output>`, ids 3-16; their rows are near identical, i.e. never updated).
   The control tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are trained and left out of it.
4. Score every token by the cosine of its row with the reference mean; the highest are the least trained.
5. Keep only ordinary tokens: no special/added/control token, and only tokens that round-trip, i.e. whose
   decoded text encodes back to exactly that one id (a prompt of them is what a user could send as text).

On SmolLM2-135M-Instruct the top of the list is `ĠInstancePreprocess`, `ManagementPlaneProtection`,
`Ġtransistorsum`, `PlaneProtection`, `MetaInfoClass`, `swigfaiss`, `kinesisfirehose`, then word stems the
tokenizer always merges further (`Ġquestionna`, `Ġbiomark`, `Ġglimp`, `Ġcockro`, `Ġmeticul`).

The engine child (`python -m glyd_engine.bench.rare_tokens --child SPEC`) reuses glyd_engine.bench.kv's engine
and prints one `GLYD_RESULT` line, like `glyd_engine.bench.kv`'s children.

Scheduling: the child runs vLLM's engine core inside itself (VLLM_ENABLE_V1_MULTIPROCESSING=0), so every
prompt is queued before the first step and the schedule (which requests' chunks share a step) depends only on
the settings. With vLLM's default (the engine core in a process of its own) the core starts stepping when the
first requests arrive, the split of the 48 prompts into chunks changes from run to run, and vLLM's bf16 CPU
forward gives other floats for other chunk compositions: rare-token prompts then flip tokens even between two
runs of off (docs/benchmarks.md), which would make `outputs_equal_off` a coin toss. With one schedule, off repeats
itself and lossless must give off's tokens and logprobs bit for bit. The parent also reports which tokens
differ, with the top-2 margins, and checks that both children built the same prompts (`prompts_sha256`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import sys
import time
from pathlib import Path
from typing import Any

from glyd_engine import torch_extras
from glyd_engine.bench.kv import corpus_ids

REFERENCE_SKIP = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # trained control tokens: not a reference


def _rows(model_dir: Path) -> Any:
    """The unembedding rows (the input embeddings when tied), float32 [vocab, hidden]."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    found: dict[str, Any] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.endswith("lm_head.weight") or key.endswith("embed_tokens.weight"):
                    found["lm_head" if "lm_head" in key else "embed"] = st.get_tensor(key)
    rows = found.get("lm_head", found.get("embed"))
    if rows is None:
        raise ValueError(f"no embedding or lm_head weight in {model_dir}")
    return rows.float()


def find_rare_tokens(model_dir: Path, n: int = 64, tokenizer: Any = None) -> list[dict[str, Any]]:
    """The n least-trained ordinary tokens, best first: [{"id", "token", "score"}] (see the module doc)."""
    import torch

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = _rows(model_dir)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    reference = sorted(i for i in special if i < rows.shape[0]
                       and tokenizer.convert_ids_to_tokens(i) not in REFERENCE_SKIP)
    if not reference:
        raise ValueError("the tokenizer has no unused special tokens to take as the untrained reference")
    centred = rows - rows.mean(0)
    # The first principal component exactly (top eigenvector of the [hidden, hidden] Gram matrix, float64), not
    # torch.pca_lowrank: that one is randomized, so each process (each engine child) got another list, in
    # another order, and rare_prompts, which draws by position, other prompts.
    gram = centred.double().T @ centred.double()
    pc = torch.linalg.eigh(gram).eigenvectors[:, -1].float()
    centred = centred - (centred @ pc)[:, None] * pc[None, :]
    ref = centred[reference].mean(0)
    score = torch.nn.functional.cosine_similarity(centred, ref[None, :], dim=1)
    out: list[dict[str, Any]] = []
    for i in score.argsort(descending=True, stable=True).tolist():  # ties (identical rows): lower id first
        if i in special or i >= len(tokenizer):
            continue
        text = tokenizer.decode([i])
        if tokenizer(text, add_special_tokens=False)["input_ids"] != [i]:
            continue
        out.append({"id": i, "token": tokenizer.convert_ids_to_tokens(i), "score": round(float(score[i]), 4)})
        if len(out) >= n:
            break
    return out


def rare_prompts(ids: list[int], n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` ids drawn (seeded, with replacement) from `ids`; each prompt its own draw."""
    rng = random.Random(seed)
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


def workload(tokenizer: Any, model_dir: Path, spec: dict[str, Any]) -> tuple[list[list[int]], list[dict]]:
    """The rare prompts then the ordinary ones (held-out corpus text) a spec's `rare` entry names."""
    r = spec["rare"]
    rare = find_rare_tokens(model_dir, int(r.get("vocab", 64)), tokenizer)
    prompts = rare_prompts([t["id"] for t in rare], int(r["n"]), int(r["length"]), int(r.get("seed", 0)))
    prompts += [corpus_ids(tokenizer, int(r["ordinary_length"]), skip=211 * i) for i in range(int(r["ordinary"]))]
    return prompts, rare


def run_rare_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: every prompt at once, greedy, `max_tokens` each (EOS ignored); timings, counters, and each
    generated token's top-2 logprobs (`top2`: [token, logprob, its IEEE bits]) for the parent's comparison."""
    # The engine core in this process: every prompt is queued before the first step, so the schedule does not
    # depend on when requests reach the core (see the module doc). Set before vLLM reads it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch_extras.guard()
    import vllm

    from glyd_engine.bench.kv import _counters, _engine, _generate

    t0 = time.monotonic()
    llm = _engine(spec)
    cfg = llm.llm_engine.vllm_config.cache_config
    res: dict[str, Any] = {"mode": spec["mode"], "vllm": vllm.__version__, "start_s": round(time.monotonic() - t0, 1),
                           "num_blocks": cfg.num_gpu_blocks, "block_size": cfg.block_size,
                           "kv_tokens": int(cfg.num_gpu_blocks or 0) * int(cfg.block_size)}
    prompts, rare = workload(llm.get_tokenizer(), Path(spec["model"]), spec)
    res["prompts_sha256"] = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()  # the parent checks they agree
    max_tokens = int(spec["rare"]["max_tokens"])
    n_rare = int(spec["rare"]["n"])
    res["pids"] = {"engine": os.getpid(), "workers": llm.collective_rpc(_worker_pid)}  # in-process or apart
    if spec["rare"].get("phases"):
        res["phases"] = _phases(llm, prompts, spec["rare"]["phases"], max_tokens)
        res["stats"] = res["phases"][-1]["stats"]
        return res
    t = time.monotonic()
    outs, top2 = _tokens_top2(_generate(llm, prompts, max_tokens, logprobs=2))
    dt = time.monotonic() - t
    prompt_tokens = sum(map(len, prompts))
    res.update({
        "rare_tokens": rare[:12], "rare_vocab": len(rare), "requests": len(prompts), "rare_requests": n_rare,
        "completed": sum(len(o) == max_tokens for o in outs), "prompt_tokens": prompt_tokens,
        "generated_tokens": sum(map(len, outs)), "seconds": round(dt, 2),
        "prompt_tokens_per_s": round(prompt_tokens / dt, 1), "outputs": outs, "top2": top2,
        "engine_core": "in-process" if not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING else "own process",
    })
    res["metrics"] = _counters(llm)
    if spec["mode"] != "off":
        res["stats"] = _stats(llm)
    res["total_s"] = round(time.monotonic() - t0, 1)
    return res


def _worker_pid(worker: Any = None) -> int:
    return os.getpid()


def _stats(llm: Any) -> dict[str, int]:
    from glyd_engine.vllm_plugin.state import worker_stats

    stats = llm.collective_rpc(worker_stats)
    return {k: sum(int(s[k]) for s in stats) for k in stats[0]} if stats else {}


def _phases(llm: Any, prompts: list[list[int]], plan: list[list[Any]], max_tokens: int) -> list[dict[str, Any]]:
    """The prompts in phases, one after another: a phase lists prompt indices (the rare prompts first, then the
    ordinary ones), or [index, tokens] for a prompt's first tokens. Each request's tokens and how it finished (a
    refusal when the overflow arena is limited: GLYD_KV_ARENA_MB), and the counters after each phase."""
    from glyd_engine.bench.kv import _generate

    out = []
    for phase in plan:
        batch = [prompts[p[0]][: p[1]] if isinstance(p, (list, tuple)) else prompts[p] for p in phase]
        requests = [{"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                     "stop_reason": o.outputs[0].stop_reason} for o in _generate(llm, batch, max_tokens)]
        out.append({"requests": requests, "stats": _stats(llm)})
    return out


def _tokens_top2(outs: list[Any]) -> tuple[list[list[int]], list[list[list]]]:
    """Each request's generated tokens and, for each, the two most likely [token, logprob, bits]."""
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    top2 = [[[[tid, float(lp.logprob), struct.pack("<d", float(lp.logprob)).hex()]
              for tid, lp in sorted(step.items(), key=lambda kv: (kv[1].rank, kv[0]))][:2]
             for step in (o.outputs[0].logprobs or [])] for o in outs]
    return tokens, top2


def _margin(top: list[list]) -> float | None:
    """The top-2 logprob margin of one generated token (None without two entries)."""
    return round(top[0][1] - top[1][1], 5) if len(top) > 1 else None


def compare_outputs(off: dict[str, Any], glyd: dict[str, Any], n_rare: int) -> dict[str, Any]:
    """Lossless's generated tokens against off's: how many differ, which (prompt, step, rare or ordinary, both
    tokens, both top-2 margins), and whether the top-2 logprobs are equal bit for bit (None when a child gave none).
    A step after a prompt's first differing token continues another text; it is listed, marked `after_diff`."""
    a, b = off["outputs"], glyd["outputs"]
    ta, tb = off.get("top2"), glyd.get("top2")
    differing = []
    for i, (oa, ob) in enumerate(zip(a, b, strict=True)):
        for j, (x, y) in enumerate(zip(oa, ob, strict=False)):
            if x == y:
                continue
            d: dict[str, Any] = {"prompt": i, "kind": "rare" if i < n_rare else "ordinary", "step": j, "off": x,
                                 "lossless": y, "after_diff": oa[:j] != ob[:j]}
            if ta and tb:
                d["off_margin"], d["lossless_margin"] = _margin(ta[i][j]), _margin(tb[i][j])
            differing.append(d)
    bits = None
    if ta is not None and tb is not None:
        bits = [[[e[2] for e in s] for s in p] for p in ta] == [[[e[2] for e in s] for s in p] for p in tb]
    return {"tokens_compared": sum(map(len, a)), "tokens_differing": len(differing),
            "prompts_differing": sorted({d["prompt"] for d in differing}), "differing": differing,
            "logprobs_equal_off": bits}


def run_engine(spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """glyd_engine.bench.kv.run_engine, with this module's child."""
    from glyd_engine.bench import kv

    return kv.run_engine(spec, timeout, module="glyd_engine.bench.rare_tokens")


def run_rare_bench(model: Path, kv_bytes: int, n: int = 40, length: int = 1400, ordinary: int = 8,
                   ordinary_length: int = 1400, max_tokens: int = 2, check: bool = True,
                   modes: tuple[str, ...] = ("off", "lossless")) -> dict[str, Any]:
    """Off, then lossless (read-back check on unless check=False), same KV memory, every prompt at once."""
    longest = max(length, ordinary_length) + max_tokens
    base = {"model": str(model), "kv_bytes": kv_bytes, "max_model_len": max(2048, longest + 16),
            "rare": {"n": n, "length": length, "ordinary": ordinary, "ordinary_length": ordinary_length,
                     "max_tokens": max_tokens}}
    runs = {m: run_engine({**base, "mode": m, **({"check": True} if check and m != "off" else {})}) for m in modes}
    result: dict[str, Any] = {"model": str(model), "kv_cache_memory_bytes": kv_bytes, "rare_prompts": n,
                              "rare_length": length, "ordinary_prompts": ordinary, "ordinary_length": ordinary_length,
                              "max_tokens": max_tokens, "read_back_check": check}
    for m, r in runs.items():
        result[m] = {k: r[k] for k in ("kv_tokens", "requests", "completed", "prompt_tokens", "seconds",
                                       "prompt_tokens_per_s", "start_s") if k in r}
        if "stats" in r:
            s = r["stats"]
            result[m].update({k: s.get(k, 0) for k in ("values_written", "values_checked", "values_differing",
                                                       "escapes", "overflow_values", "overflow_bytes_held",
                                                       "escapes_held", "overflow_values_held")})
            # shares of the K/V values written; the CUDA writer keeps no host-side counts, so there none (not 0)
            written = s.get("values_written", 0)
            result[m]["escape_rate"] = round(s.get("escapes", 0) / written, 5) if written else None
            result[m]["overflow_rate"] = round(s.get("overflow_values", 0) / written, 5) if written else None
    first = next(iter(runs.values()))
    result["rare_tokens"] = [t["token"] for t in first["rare_tokens"]]
    if "off" in runs and "lossless" in runs:
        result["throughput_ratio"] = round(runs["lossless"]["prompt_tokens_per_s"]
                                           / runs["off"]["prompt_tokens_per_s"], 3)
        result["prompts_equal"] = runs["lossless"].get("prompts_sha256") == runs["off"].get("prompts_sha256")
        result["outputs_equal_off"] = runs["lossless"]["outputs"] == runs["off"]["outputs"]
        result.update(compare_outputs(runs["off"], runs["lossless"], n))
    result["engine_core"] = first.get("engine_core")
    result["vllm_version"] = first["vllm"]
    return result


if __name__ == "__main__":
    from glyd_engine.bench.kv import child_main

    sys.exit(child_main(sys.argv, run_rare_child))
