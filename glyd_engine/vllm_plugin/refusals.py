"""Requests refused because their values find no room in the overflow arena, from the writer to the scheduler.

A page write whose escapes find no overflow room stores the rest of the step and hands back the slots it could not
store (`kv_page.write_by_block`). Their blocks are reported here; the scheduler of the same process
(`scheduler.py`, installed by the plugin's config check) finishes every request holding one with an error and evicts
them, and every block after them in those requests, from the prefix cache: no request reads a value that was not
stored. Where no such scheduler listens (a worker in a process of its own, a scheduler of the user's), the write
raises instead, naming the way out; the engine stops, and nothing wrong is ever served.
"""

from __future__ import annotations

import logging
import threading

import torch

from glyd_engine.format.kv_page import OverflowRoomError

log = logging.getLogger("vllm.glyd")

HINT = ("set a larger GLYD_KV_ARENA_MB (or additional_config glyd.arena_mb), lower gpu_memory_utilization to leave "
        "the GPU room beside vLLM's budget, or run with GLYD_KV=off")

_lock = threading.Lock()
_pending: dict[tuple[int, int], str] = {}  # (block, block size) -> why, until the scheduler takes it
_unstored: dict[int, set[int]] = {}  # check mode: a layer's (id of its state) blocks holding values not stored
_listening = [False]


def listen() -> None:
    """Called by the scheduler of this process: reported blocks are refused from now on, not raised."""
    with _lock:
        _listening[0] = True
        _pending.clear()
        _unstored.clear()


def stop() -> None:
    """The scheduler shut down: a later engine of this process raises unless its own scheduler listens."""
    with _lock:
        _listening[0] = False
        _pending.clear()
        _unstored.clear()


def listening() -> bool:
    return _listening[0]


def report(lost: torch.Tensor, block_size: int, why: str, layer: int | None = None) -> None:
    """A write left `lost` slots unstored: refuse their blocks' requests (or raise where none can be refused).
    `layer` (check mode): the layer whose reads of those blocks the check leaves out."""
    blocks = sorted(set((lost.to(torch.int64) // block_size).tolist()))
    message = (f"Glyd KV cache: {len(lost)} tokens' values in {len(blocks)} blocks found no room in the overflow "
               f"arena ({why}): their values are far rarer than the model's KV tables expect")
    if not listening():
        raise OverflowRoomError(f"{message}; {HINT}")
    with _lock:
        for b in blocks:
            _pending[(b, block_size)] = why
        if layer is not None:
            _unstored.setdefault(layer, set()).update(blocks)
    log.error("%s. The requests holding them are refused; %s", message, HINT)


def take() -> dict[tuple[int, int], str]:
    """The blocks reported since the last call: (block, block size) -> why."""
    with _lock:
        got = dict(_pending)
        _pending.clear()
    return got


def restarted(layer: int, slots: torch.Tensor, block_size: int) -> None:
    """Check mode: the layer's write stored these slots; blocks it wrote from token 0 hold only stored values."""
    if _unstored.get(layer):
        s = slots.to(torch.int64)
        starts = set((s[(s >= 0) & (s % block_size == 0)] // block_size).tolist())
        with _lock:
            _unstored[layer].difference_update(starts)


def unstored_blocks(layer: int) -> set[int]:
    """Check mode: the layer's blocks whose values were not all stored (their requests were refused)."""
    with _lock:
        return set(_unstored.get(layer, ()))


def message(why: str) -> str:
    """What a refused request's output says (its `stop_reason`; finish reason `error`)."""
    return (f"Glyd KV cache: this request's keys and values found no room in the overflow arena ({why}); "
            f"they are far rarer than the model's KV tables expect. To serve it, {HINT}")
