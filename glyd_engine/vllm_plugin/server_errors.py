"""A refused request's reason, for clients of vLLM's OpenAI server.

The scheduler finishes a request whose values found no overflow room with finish reason `error` and the reason in
its `stop_reason` (refusals.py). vLLM's server answers finish reason `error` with a generic "Internal server error".
Here the front end's `AsyncLLM.generate` raises vLLM's own `GenerationError` with the refusal's message instead,
after the request's last output, which the server turns into the client's error (an error chunk of a stream, or an
error response): the client reads why, and what to do, as the engine's log does.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import AsyncIterator
from typing import Any

from glyd_engine.vllm_plugin.refusals import MESSAGE_START

_MARK = "_glyd_refusal_message"
MODULE = "vllm.v1.engine.async_llm"  # vLLM's front end; an API server imports it only when it builds its engine


def refusal(output: Any) -> str | None:
    """The refusal message of a request's output, if the Glyd scheduler refused it."""
    for o in getattr(output, "outputs", None) or ():
        reason = getattr(o, "stop_reason", None)
        if getattr(o, "finish_reason", None) == "error" and isinstance(reason, str) and reason.startswith(
                MESSAGE_START):
            return reason
    return None


def install() -> bool:
    """Wrap the front end's generate in this process: now if it is imported, else when it is (an API server imports
    it after vLLM loads its plugins; engine cores and workers never do). True if wrapped now."""
    cls = getattr(sys.modules.get(MODULE), "AsyncLLM", None)
    if cls is None:
        if not any(isinstance(f, _WhenImported) for f in sys.meta_path):
            sys.meta_path.insert(0, _WhenImported())
        return False
    if getattr(cls.generate, _MARK, False):
        return True
    original = cls.generate
    from vllm.exceptions import GenerationError

    @functools.wraps(original)
    async def generate(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        refused = None
        async for output in original(self, *args, **kwargs):
            refused = refusal(output)
            if refused is None:
                yield output
        if refused is not None:  # the request has finished: nothing is left to abort
            raise GenerationError(refused)

    setattr(generate, _MARK, True)
    cls.generate = generate
    return True


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when vLLM's front end is imported, wraps it right after its module runs."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            install()

        loader.exec_module = exec_module
        return spec
