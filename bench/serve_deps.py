"""Which modules vLLM's OpenAI server imports that this Python lacks (its module, then those its app's routers and
middleware import while the app is built), all in one go (the GPU machine's slim vLLM
leaves some out; each is then carried as a wheel: bench/device_setup.sh). Exit status 1 when any is missing.
Use: python3 bench/serve_deps.py"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from unittest import mock


class _Stand(types.ModuleType):
    """A missing module's stand-in, so the import goes on to the next missing one."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=f"{self.__name__}.{name}")


def _build_app() -> None:
    """The server's app, with `vllm serve`'s default arguments: its routers import more (orjson, the SageMaker and
    Prometheus middleware) than the server's module does."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # vLLM 0.33 (the GPU machine's)
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ModuleNotFoundError as e:  # 0.32 (the CPU build's)
        if e.name != "vllm.entrypoints.common.cli_args":
            raise
        from vllm.entrypoints.launchers.cli_args import make_arg_parser

    build_app(make_arg_parser(FlexibleArgumentParser()).parse_args([]), ("generate",))


def main() -> int:
    missing: list[str] = []
    for _ in range(40):
        try:
            importlib.import_module("vllm.entrypoints.openai.api_server")
            _build_app()
            break
        except ModuleNotFoundError as e:
            if not e.name or e.name in missing:
                raise
            missing.append(e.name)
            stand = _Stand(e.name)
            stand.__spec__ = importlib.machinery.ModuleSpec(e.name, None)  # find_spec() needs one
            sys.modules[e.name] = stand
            for name in [m for m in sys.modules if m.startswith("vllm.entrypoints")]:
                del sys.modules[name]
    print("missing:", " ".join(missing) if missing else "none")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
