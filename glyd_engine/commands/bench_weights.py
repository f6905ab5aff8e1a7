"""`glyd bench weights --model DIR --json`: bf16 weights against the model's Glyd checkpoint in vLLM."""

from __future__ import annotations

import argparse


def add_weights_parser(which: argparse._SubParsersAction) -> None:
    w = which.add_parser("weights", help="vLLM on bf16 weights vs the Glyd checkpoint: exactness, bytes, speed")
    w.add_argument("--model", default="demo", help="bf16 model directory or 'demo' (packed into the cache)")
    w.add_argument("--logprob-tokens", type=int, default=2000, help="prompt length for the logprobs comparison")
    w.add_argument("--batch", type=int, default=4, help="requests decoding at once for the speed figure")
    w.add_argument("--max-tokens", type=int, default=16, help="tokens each request decodes (default 16)")
    w.add_argument("--json", action="store_true", help="print one JSON object")
    w.set_defaults(func=run_weights)


def run_weights(args: argparse.Namespace) -> int:
    from glyd_engine.bench.weights import run_weights_bench
    from glyd_engine.models import resolve_model
    from glyd_engine.progress import print_progress

    model = resolve_model(args.model, progress=print_progress)
    result = run_weights_bench(model, args.logprob_tokens, args.batch, args.max_tokens)
    from glyd_engine.commands.printing import print_result

    print_result(result, args.json)
    return 0 if result["prompt_logprobs_identical"] and result["greedy_tokens_identical"] else 1
