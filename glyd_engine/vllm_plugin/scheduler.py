"""vLLM's scheduler, refusing the requests whose values found no room in the overflow arena (refusals.py).

After each step it takes the blocks the page writers could not store, finishes every running request holding one
with finish reason `error` (its `stop_reason` says why and what to do), and evicts those blocks and every later
block of those requests from the prefix cache (their values were computed over the unstored ones); the workers give
the freed blocks' overflow back before their next step. The rest of the batch goes on untouched. The plugin's config
check names `GlydScheduler` as vLLM's scheduler class, with the refusal channel its processes share, unless the user
named a scheduler of their own.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from glyd_engine.vllm_plugin import refusals

log = logging.getLogger("vllm.glyd")

QUALNAME = "glyd_engine.vllm_plugin.scheduler.GlydScheduler"


class _Refusing:
    """The refusal step, mixed in before vLLM's scheduler class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._channel = refusals.listen(self.vllm_config)  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        refusals.stop(self._channel)
        super().shutdown()  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        sched: Any = self
        refused = refusals.take(self._channel)
        if not refused:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        bad: dict[int, str] = {}
        for (block, size), why in refused.items():
            for b in range(block * size // sched.block_size, -(-(block + 1) * size // sched.block_size)):
                bad[b] = why
        whys: dict[str, str] = {}
        owned: set[int] = set()  # the refused requests' blocks from their first unstored one on
        for request in sched.running:
            blocks = [b for group in sched.kv_cache_manager.get_block_ids(request.request_id) for b in group]
            first = next((i for i, b in enumerate(blocks) if b in bad), None)
            if first is not None:
                whys[request.request_id] = bad[blocks[first]]
                owned.update(blocks[first:])
        sched.kv_cache_manager.evict_blocks(owned | set(bad))
        finished = sched.finish_requests(whys, RequestStatus.FINISHED_ERROR)
        # only blocks this call freed: another free block may already be another request's, written from token 0
        refusals.release(self._channel, owned, sched.block_size)
        out = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        for request in finished:
            log.error("Glyd KV cache: request %s refused (%s)", request.request_id, whys[request.request_id])
            eco = out.setdefault(request.client_index, EngineCoreOutputs())
            eco.outputs = [*eco.outputs, EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason(),
                stop_reason=refusals.message(whys[request.request_id]), events=request.take_events(),
                trace_headers=request.trace_headers)]
        return out


class RefusingScheduler(_Refusing, Scheduler):
    pass


class RefusingAsyncScheduler(_Refusing, AsyncScheduler):
    pass


def GlydScheduler(*args: Any, **kwargs: Any) -> Scheduler:  # noqa: N802 (vLLM calls what scheduler_cls names)
    """vLLM's scheduler of this engine (async or not, as its config decided) with the refusal step."""
    cfg = kwargs.get("vllm_config", args[0] if args else None)
    cls = RefusingAsyncScheduler if cfg.scheduler_config.async_scheduling else RefusingScheduler
    return cls(*args, **kwargs)


def install(vllm_config: Any) -> str | None:
    """Name GlydScheduler as the engine's scheduler and the refusal channel its processes inherit; None if done, else
    why refusals stay errors."""
    sc = vllm_config.scheduler_config
    if sc.scheduler_cls not in (None, QUALNAME):
        refusals.close_channel()
        return f"the engine names its own scheduler ({sc.scheduler_cls})"
    pc = vllm_config.parallel_config
    if pc.distributed_executor_backend == "ray" or getattr(pc, "nnodes", 1) > 1:  # no shared folder reaches them
        refusals.close_channel()
        return "the workers run under Ray or on several nodes"
    if sc.scheduler_cls != QUALNAME or refusals.CHANNEL_ENV not in os.environ:  # a config copied: its channel stays
        refusals.name_channel()
    sc.scheduler_cls = QUALNAME
    return None
