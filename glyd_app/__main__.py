"""`glyd-chat [MODEL]` (and `glyd run MODEL`): open the chat; the engine starts in the background.

Only argparse and glyd_engine's light modules are imported before the UI is up; Textual loads next,
and torch/vLLM only ever load in the engine's child process.
"""

from __future__ import annotations

import argparse
import sys

from glyd_engine.kv_mode import SETTING as KV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="'demo' (the default), a local model directory, or a Hugging Face id",
    )
    parser.add_argument(
        "--kv",
        type=KV.arg_type(),
        metavar=KV.metavar,
        default=None,
        help="KV cache mode (default: auto; 'off' uses vLLM's own bf16 cache)",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default 4096)")
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="KV cache budget in MiB (CPU default 256; 0 lets vLLM size it on a GPU)",
    )
    parser.add_argument("--chat", type=int, default=None, help="open this chat id (default: the last one)")
    parser.add_argument("--data-dir", action="store_true", help="print where chats are kept and exit")


def run_app(args: argparse.Namespace) -> int:
    """Build the app from parsed arguments and run it; shared by glyd-chat and `glyd run`."""
    from glyd_app.config import load_engine_settings

    if getattr(args, "data_dir", False):
        from glyd_app.store import db_path

        print(db_path())
        return 0
    settings, error = load_engine_settings(kv=args.kv, max_model_len=args.max_model_len,
                                           kv_cache_mib=args.kv_cache_mib)

    from glyd_app.app import GlydApp

    app = GlydApp(model=args.model or "demo", settings=settings, chat_id=args.chat)
    if error:
        app.call_later(app.notify, f"Config not loaded: {error}", severity="error")
    app.run()
    return int(app.return_code or 0)


def main(argv: list[str] | None = None) -> int:
    from glyd_engine import __version__

    parser = argparse.ArgumentParser(prog="glyd-chat", description="Chat with a local model on Glyd's engine.")
    parser.add_argument("--version", action="version", version=f"glyd-chat {__version__}")
    add_arguments(parser)
    return run_app(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
