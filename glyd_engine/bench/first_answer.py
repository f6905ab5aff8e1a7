"""The demo model's first answer under vLLM's two modes and three samplings (docs/benchmarks.md,
"First answers").

`python -m glyd_engine.bench.first_answer --json` prints, for "What is the capital of France?" with the
model's chat template: the top-5 first-token logprobs from vLLM eager, vLLM compiled (its default mode) and
an fp32 transformers forward on the same bf16 weights (the reference); then, over ten short factual
questions, how many answers name the right thing greedily and sampled at temperature 0.2/top-p 0.9 (the
model card's) and 0.7/top-p 0.95 (glyd-chat's old fixed default), 20 seeds each, and greedily with a
repetition penalty of 1.1 (vLLM eager); for the greedy ones also how long replies to three chatty prompts run.
Each engine runs in its own child process (`--child`), as in glyd_engine.bench.kv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from glyd_engine import torch_extras

QUESTION = "What is the capital of France?"
QA = [(QUESTION, ["Paris"]), ("What is the capital of Germany?", ["Berlin"]),
      ("What is the capital of Italy?", ["Rome"]), ("What is the capital of Japan?", ["Tokyo"]),
      ("What is the largest planet in the solar system?", ["Jupiter"]),
      ("Who wrote Romeo and Juliet?", ["Shakespeare"]),
      ("At what temperature in Celsius does water boil at sea level?", ["100"]),
      ("How many days are there in a week?", ["seven", "7"]), ("What color is the sky on a clear day?", ["blue"]),
      ("What is the chemical symbol for gold?", ["Au"])]
# name: (temperature, top-p, repetition penalty)
SAMPLINGS = {"greedy": (0.0, 1.0, 1.0), "greedy, repetition penalty 1.1": (0.0, 1.0, 1.1),
             "T0.2/p0.9": (0.2, 0.9, 1.0), "T0.7/p0.95": (0.7, 0.95, 1.0)}
CHATTY = ["My name is Ada. Remember it.", "Say hello.", "Tell me about yourself."]
RESULT = "GLYD_RESULT "


def _prompt(tok: Any, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def _top5(pairs: list[tuple[str, float]]) -> list[list[Any]]:
    return [[t, round(v, 3)] for t, v in sorted(pairs, key=lambda p: -p[1])[:5]]


def child(model: str, compiled: bool, seeds: int) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch_extras.guard()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from glyd_engine.engine.engine_args import engine_args
    from glyd_engine.engine.protocol import EngineSettings

    t0 = time.monotonic()
    settings = EngineSettings(max_model_len=1024, kv_cache_bytes=256 << 20, enforce_eager=not compiled)
    llm = LLM(**engine_args(model, settings, cpu=True))
    load_s = round(time.monotonic() - t0, 1)  # compiled: includes torch.compile unless vLLM's cache had it
    tok = llm.get_tokenizer()
    first = llm.generate([TokensPrompt(prompt_token_ids=_prompt(tok, QUESTION))],
                         SamplingParams(temperature=0, max_tokens=12, logprobs=5), use_tqdm=False)[0].outputs[0]
    top5 = _top5([(v.decoded_token, v.logprob) for v in first.logprobs[0].values()])
    out: dict[str, Any] = {"load_s": load_s, "greedy_answer": first.text, "first_token_top5": top5}
    if compiled:
        return out
    for name, (temp, top_p, penalty) in SAMPLINGS.items():
        n = 1 if temp == 0 else seeds
        prompts, params, answers = [], [], []
        for q, a in QA:
            for s in range(n):
                prompts.append(TokensPrompt(prompt_token_ids=_prompt(tok, q)))
                params.append(SamplingParams(temperature=temp, top_p=top_p, repetition_penalty=penalty,
                                             max_tokens=48, seed=s))
                answers.append(a)
        outs = llm.generate(prompts, params, use_tqdm=False)
        right = [any(x.lower() in o.outputs[0].text.lower() for x in a) for o, a in zip(outs, answers, strict=True)]
        out[name] = {"right": sum(right), "asked": len(right), "capital_of_france": sum(right[:n]), "of": n}
        if temp == 0:  # chatty prompts: does the reply end, or run to the 512-token limit repeating itself?
            ends = llm.generate([TokensPrompt(prompt_token_ids=_prompt(tok, q)) for q in CHATTY],
                                SamplingParams(temperature=0, repetition_penalty=penalty, max_tokens=512),
                                use_tqdm=False)
            out[name]["chatty_reply_tokens"] = [len(o.outputs[0].token_ids) for o in ends]
    return out


def reference(model: str) -> list[list[Any]]:
    """fp32 transformers on the same (bf16) weights: where the first token's logprobs really are."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        lp = m(torch.tensor([_prompt(tok, QUESTION)])).logits[0, -1].log_softmax(-1)
    top = lp.topk(5)
    return _top5([(tok.decode([int(i)]), float(v)) for v, i in zip(top.values, top.indices, strict=True)])


def _run_child(model: str, compiled: bool, seeds: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "glyd_engine.bench.first_answer", "--child", model, "--seeds", str(seeds)]
    proc = subprocess.run(cmd + (["--compiled"] if compiled else []), capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"engine child failed ({proc.returncode}): {proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", metavar="MODEL_DIR")
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.compiled, args.seeds)), flush=True)
        return 0
    from glyd_engine.models import resolve_model

    model = str(resolve_model(args.model))
    report = {"model": model, "eager": _run_child(model, False, args.seeds),
              "compiled": _run_child(model, True, args.seeds), "fp32_reference_top5": reference(model)}
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
