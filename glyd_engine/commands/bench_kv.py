"""`glyd bench kv --model DIR --json`: the real vLLM engine, off against the lossless KV cache, same KV memory.

Hooked into `glyd bench` by `glyd_engine.commands.bench.add_parser` calling `add_kv_parser(which)`.
"""

from __future__ import annotations

import argparse


def add_kv_parser(which: argparse._SubParsersAction) -> None:
    k = which.add_parser("kv", help="vLLM's KV capacity, prompt logprobs, exactness and speed: off vs lossless")
    k.add_argument("--model", default="demo", help="model directory or 'demo' (default)")
    k.add_argument("--kv-bytes", type=int, default=160 * 1024 * 1024,
                   help="fixed kv_cache_memory_bytes for both engines (default 160 MiB)")
    k.add_argument("--logprob-tokens", type=int, default=2000, help="prompt length for the logprobs comparison")
    k.add_argument("--batch", type=int, default=8, help="requests decoding at once for the speed figure")
    k.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes (default 64)")
    k.add_argument("--compiled", action="store_true",
                   help="both engines in vLLM's default mode (torch.compile) instead of eager")
    k.add_argument("--json", action="store_true", help="print one JSON object")
    k.set_defaults(func=run_kv)


def run_kv(args: argparse.Namespace) -> int:
    from glyd_engine.bench.kv import run_kv_bench
    from glyd_engine.models import resolve_model
    from glyd_engine.progress import print_progress

    model = resolve_model(args.model, progress=print_progress)
    result = run_kv_bench(model, args.kv_bytes, args.logprob_tokens, args.batch, args.max_tokens,
                          compiled=args.compiled)
    from glyd_engine.commands.printing import print_result

    print_result(result, args.json)
    ok = result["prompt_logprobs_identical"] and result["values_differing"] == 0 and result["values_checked"] > 0
    return 0 if ok else 1
