"""`glyd bench rare --model DIR --json`: prompts of the model's least-trained tokens, served at once with
ordinary ones by the real vLLM engine, off against lossless (read-back check on), same KV memory.

Hooked into `glyd bench` by `glyd_engine.commands.bench.add_parser` calling `add_rare_parser(which)`.
"""

from __future__ import annotations

import argparse
import json

DEFAULT_KV_BYTES = 1792 * 1024 * 1024  # holds 48 x ~1,400-token requests at once with vLLM's own cache


def add_rare_parser(which: argparse._SubParsersAction) -> None:
    r = which.add_parser("rare", help="rare-token prompts with ordinary ones: complete, exact, escapes, speed")
    r.add_argument("--model", default="demo", help="model directory or 'demo' (default)")
    r.add_argument("--kv-bytes", type=int, default=DEFAULT_KV_BYTES,
                   help="fixed kv_cache_memory_bytes for both engines (default 1792 MiB: every request fits)")
    r.add_argument("--prompts", type=int, default=40, help="rare-token prompts (default 40)")
    r.add_argument("--length", type=int, default=1400, help="tokens in each rare prompt (default 1400)")
    r.add_argument("--ordinary", type=int, default=8, help="ordinary prompts served with them (default 8)")
    r.add_argument("--ordinary-length", type=int, default=1400, help="tokens in each ordinary prompt")
    r.add_argument("--max-tokens", type=int, default=2,
                   help="tokens each request generates (default 2: one decode step reads every page back)")
    r.add_argument("--no-check", action="store_true", help="lossless without the read-back check")
    r.add_argument("--list-tokens", type=int, default=0, metavar="N",
                   help="only print the N least-trained tokens and their scores")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=run_rare)


def run_rare(args: argparse.Namespace) -> int:
    from glyd_engine.models import resolve_model
    from glyd_engine.progress import print_progress

    model = resolve_model(args.model, progress=print_progress)
    if args.list_tokens:
        from glyd_engine.bench.rare_tokens import find_rare_tokens

        tokens = find_rare_tokens(model, args.list_tokens)
        if args.json:
            print(json.dumps(tokens, indent=2))
        else:
            for t in tokens:
                print(f"{t['id']:>7} {t['score']:.4f} {t['token']!r}")
        return 0
    from glyd_engine.bench.rare_tokens import run_rare_bench

    result = run_rare_bench(model, args.kv_bytes, args.prompts, args.length, args.ordinary, args.ordinary_length,
                            args.max_tokens, check=not args.no_check)
    from glyd_engine.commands.printing import print_result

    print_result(result, args.json)
    return 0 if rare_ok(result) else 1


def rare_ok(result: dict) -> bool:
    """The run's verdict: every request completed in both modes, both engines were served the same prompts,
    lossless generated off's tokens, and (with the read-back check) every value read back was the value written."""
    glyd, off = result["lossless"], result["off"]
    ok = glyd["completed"] == glyd["requests"] and off["completed"] == off["requests"]
    ok = ok and result.get("prompts_equal") is not False  # absent: a result from before the prompts were hashed
    ok = ok and result.get("outputs_equal_off") is True
    if result.get("read_back_check"):
        ok = ok and glyd.get("values_checked", 0) > 0 and glyd.get("values_differing", 1) == 0
    return ok
