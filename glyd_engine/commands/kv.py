"""`glyd kv build MODEL` and `glyd kv show MODEL`: the per-model KV exponent tables."""

from __future__ import annotations

import argparse
import json
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv", help="the per-model KV cache tables")
    which = p.add_subparsers(dest="kv", metavar="WHAT", required=True)
    b = which.add_parser("build", help="build (or reuse) the KV tables for a model")
    b.add_argument("model", nargs="?", default="demo")
    b.add_argument("--window", type=int, help="positions to cover (default: the model's whole window)")
    b.add_argument("--rebuild", action="store_true", help="build even if valid tables are cached")
    b.set_defaults(func=run_build)
    s = which.add_parser("show", help="print the cached tables' summary")
    s.add_argument("model", nargs="?", default="demo")
    s.set_defaults(func=run_show)


def run_build(args: argparse.Namespace) -> int:
    from glyd_engine.models import resolve_model
    from glyd_engine.progress import print_progress
    from glyd_engine.tables import ensure_tables, tables_path

    model = resolve_model(args.model, progress=print_progress)
    t0 = time.perf_counter()
    tables = ensure_tables(model, args.window, progress=print_progress, rebuild=args.rebuild)
    # seconds: this call (a build, or loading and checking the cached file); build_seconds: the build's
    print(json.dumps({"path": str(tables_path(tables.fingerprint)), **tables.describe(),
                      "build_seconds": round(tables.build_seconds, 1),
                      "seconds": round(time.perf_counter() - t0, 3)}, indent=2))
    return 0


def run_show(args: argparse.Namespace) -> int:
    from glyd_engine.errors import GlydError
    from glyd_engine.models import model_fingerprint, resolve_model
    from glyd_engine.tables import KVTables, tables_path

    model = resolve_model(args.model)
    path = tables_path(model_fingerprint(model))
    if not path.exists():
        raise GlydError(f"no KV tables for {model} yet; run `glyd kv build {args.model}`")
    print(json.dumps({"path": str(path), **KVTables.load(path).describe()}, indent=2))
    return 0
