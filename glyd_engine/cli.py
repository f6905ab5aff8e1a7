"""`glyd`: the command-line entry point. Each subcommand lives in `glyd_engine.commands.<name>`.

Subcommand modules are imported only when their command runs, so `glyd --version` stays instant.
Each module exposes `add_parser(subparsers)`, which registers its parser with `func=run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from glyd_engine import __version__
from glyd_engine.errors import GlydError

# name -> module under glyd_engine.commands; the help text lives in the module's add_parser.
COMMANDS: dict[str, str] = {
    "models": "models",
    "pack": "pack",
    "verify": "pack",
    "kv": "kv",
    "bench": "bench",
    "run": "run",
    "doctor": "doctor",
    "paths": "paths",
    "serve": "serve",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glyd", description="Lossless bf16 weights and KV cache for vLLM.")
    parser.add_argument("--version", action="version", version=f"glyd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    for name, module in COMMANDS.items():
        if module in seen or (only is not None and name != only):
            continue
        seen.add(module)
        importlib.import_module(f"glyd_engine.commands.{module}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except GlydError as exc:  # a full disk too (atomic.DiskFullError)
        print(f"glyd: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the user named cannot be read or written: one line, not a traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"glyd: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("glyd: interrupted; nothing was left half-written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
