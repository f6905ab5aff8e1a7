"""`glyd run [MODEL]`: open glyd-chat on a model (the same app as `glyd-chat MODEL`).

The app lives in `glyd_app`, which uses Textual; glyd_engine must not import it, so this command
replaces the process with `python -m glyd_app` instead of importing the app here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from glyd_engine.errors import GlydError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="chat with a model in the terminal (same as glyd-chat MODEL)",
        description="Open glyd-chat on MODEL: 'demo', a directory or a hub id.",
    )
    parser.add_argument("model", nargs="?", default="demo")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="further glyd-chat options (see glyd-chat -h)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("glyd_app") is None:
        raise GlydError("the chat app (glyd_app) is not installed with this glyd; install the 'glyd' package")
    argv = [sys.executable, "-m", "glyd_app", args.model, *args.rest]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached
