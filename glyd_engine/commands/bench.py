"""`glyd bench codec`: bits a value, floors and speed of the formats on a real model."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure the formats")
    which = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    c = which.add_parser("codec", help="bits per value and speed of the weight and KV codes")
    c.add_argument("--model", default="demo", help="model directory or 'demo' (default)")
    c.add_argument("--text", type=Path, help="text to record K/V on (default: the held-out corpus)")
    c.add_argument("--tokens", type=int, default=4096, help="tokens of text to record (default 4096)")
    c.add_argument("--block-size", type=int, action="append",
                   help="vLLM block size(s) to lay pages out at (default: 16, the GPU's, and 128, the CPU's)")
    c.add_argument("--window", type=int, help="positions the KV tables cover (default: the model's)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=run_codec)
    from glyd_engine.commands.bench_kv import add_kv_parser

    add_kv_parser(which)
    from glyd_engine.commands.bench_rare import add_rare_parser

    add_rare_parser(which)
    from glyd_engine.commands.bench_weights import add_weights_parser

    add_weights_parser(which)


def run_codec(args: argparse.Namespace) -> int:
    from glyd_engine.bench.codec import run_codec_bench
    from glyd_engine.errors import GlydError
    from glyd_engine.models import resolve_model
    from glyd_engine.progress import print_progress

    model = resolve_model(args.model, progress=print_progress)
    if args.text:
        try:
            text, name = args.text.read_text(encoding="utf-8"), str(args.text)
        except OSError as exc:
            raise GlydError(f"cannot read {args.text}: {exc.strerror}") from exc
    else:
        from glyd_engine.corpus import heldout_texts

        texts = heldout_texts()
        text, name = "\n\n".join(t.text for t in texts), "assets/text/heldout (all files)"
    result = run_codec_bench(model, text, name, args.tokens, args.block_size or [16, 128], args.window,
                             progress=print_progress)
    from glyd_engine.commands.printing import print_result

    print_result(result, args.json)
    return 0 if result["exact"] else 1
