"""The CUDA backend's code path (GLYD_KV_KERNELS=triton) inside the real vLLM engine, on the CPU build.

Runs the demo model twice at the same KV memory: vLLM's own cache, and the Glyd pages written and read by the
Triton kernels in Triton's interpreter with the read-back check on. Prints the values checked and differing, the
greedy tokens and the prompt-logprob differences, and how far this bf16 model's logprobs move between two correct
attentions (transformers' eager against sdpa, and each against fp32) on the same prompt: the noise level.

Run: TRITON_INTERPRET=1 .venv/bin/python bench/triton_path_cpu.py      (~5 min on 2 CPUs; docs/benchmarks.md)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPEC = {"kv_bytes": 160 * 1024 * 1024, "max_model_len": 512, "max_num_batched_tokens": 128, "max_num_seqs": 4,
        "work": {"logprobs": [60], "greedy": {"prompts": [40, 25], "max_tokens": 6}}}


def _diff(a: list[float], b: list[float]) -> dict[str, float]:
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"mean": round(sum(d) / len(d), 4), "max": round(max(d), 3)}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the Triton kernels run in the interpreter on the CPU", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from glyd_engine.bench.kv import corpus_ids, run_engine
    from glyd_engine.models import ensure_demo_model

    model = ensure_demo_model()
    triton = run_engine({"model": model, "mode": "lossless", "kernels": "triton", "check": True, **SPEC},
                        timeout=3000)
    off = run_engine({"model": model, "mode": "off", **SPEC}, timeout=900)
    ids = corpus_ids(AutoTokenizer.from_pretrained(model), 60)  # the engines' logprob prompt
    hf = {}
    for impl, dtype in (("eager", torch.bfloat16), ("sdpa", torch.bfloat16), ("sdpa", torch.float32)):
        m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=dtype, attn_implementation=impl)
        with torch.no_grad():
            lp = m(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        hf[f"{impl}_{str(dtype)[6:]}"] = [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    ours, theirs, fp32 = triton["prompt_logprobs"][0], off["prompt_logprobs"][0], hf["sdpa_float32"]
    s = triton["stats"]
    print(json.dumps({
        "kv_tokens": {"off": off["kv_tokens"], "triton": triton["kv_tokens"]},
        "values_written": s["values_written"], "values_checked": s["values_checked"],
        "values_differing": s["values_differing"],
        "greedy": {"off": off["greedy"], "triton": triton["greedy"]},
        "logprobs_triton_vs_off": _diff(ours, theirs), "logprobs_triton_vs_fp32": _diff(ours, fp32),
        "logprobs_off_vs_fp32": _diff(theirs, fp32),
        "logprobs_hf_eager_vs_sdpa_bf16": _diff(hf["eager_bfloat16"], hf["sdpa_bfloat16"]),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
