"""`glyd serve MODEL [vLLM args]`: vLLM's OpenAI-compatible server with the Glyd plugin.

The plugin loads through vLLM's entry point in every server process; `--kv` sets GLYD_KV for all of them.
The server binds 127.0.0.1 unless `--host` is given among the vLLM arguments.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_HOST = "127.0.0.1"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model with vLLM's OpenAI-compatible server and the Glyd plugin",
                       description="Arguments after MODEL go to `vllm serve` unchanged (e.g. --port 8000, "
                                   "--max-model-len 4096). Binds 127.0.0.1 unless --host is given.")
    p.add_argument("--kv", choices=("auto", "lossless", "exact", "off"),
                   help="the Glyd KV cache mode (sets GLYD_KV; default: GLYD_KV or auto)")
    p.add_argument("model", help="model directory, hub id, or 'demo'")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments for `vllm serve`")
    p.set_defaults(func=run)


def vllm_command(model: str, vllm_args: list[str]) -> list[str]:
    """The `vllm serve` command line, with the local-only default host."""
    args = list(vllm_args)
    if args and args[0] == "--":
        args = args[1:]
    if not any(a == "--host" or a.startswith("--host=") for a in args):
        args = ["--host", DEFAULT_HOST, *args]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *args]


def run(args: argparse.Namespace) -> int:
    from glyd_engine.models import resolve_model
    from glyd_engine.progress import print_progress

    model = str(resolve_model(args.model, progress=print_progress))
    env = dict(os.environ)
    if args.kv:
        env["GLYD_KV"] = args.kv
    cmd = vllm_command(model, args.vllm_args)
    print("glyd: " + " ".join(cmd[2:]), file=sys.stderr)
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)  # the server replaces this process: signals and exit code are vLLM's
    return 0  # pragma: no cover
