"""Requests refused because their values find no room in the overflow arena: the writer tells the scheduler, and
the scheduler gives the freed blocks' overflow back to the writer.

A page write whose escapes find no overflow room stores the rest of the step and hands back the slots it could not
store (`kv_page.write_by_block`). The worker appends their blocks to the channel's `reports`, a folder the plugin's
config check names in GLYD_REFUSAL_CHANNEL before vLLM starts its processes, so that the engine core and every worker
inherit it. After each step the scheduler (`scheduler.py`) reads them, finishes every request holding such a block
with an error, evicts those blocks from the prefix cache, and appends the freed blocks to `releases`; each worker
gives their overflow runs back before its next step writes (`state.apply_releases`). One path, whether the worker shares
the scheduler's process (one GPU; the CPU build with its engine core in-process) or runs in a process of its own
(the CPU build's `vllm serve`, several workers). The engines of data parallelism share the channel's name, each
with a folder of its own in it (`join`).

Order: a worker reports inside the step, before it returns (the CUDA writer's lost slots are read on the host; another
rank reports before the collective that the output rank waits on), so the scheduler's update for that step finds
the report. A freed block returns to vLLM's pool only in that update, so a step that reuses it starts after the
release was written, and its worker applies the release before writing. Where no scheduler listens (the user named
their own: the channel's folder does not exist), the write raises instead, naming the way out; the engine stops,
and nothing wrong is ever served.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from glyd_engine.format.kv_page import OverflowRoomError

log = logging.getLogger("vllm.glyd")

CHANNEL_ENV = "GLYD_REFUSAL_CHANNEL"
HINT = ("set a larger GLYD_KV_ARENA_MB (or additional_config glyd.arena_mb), lower gpu_memory_utilization to leave "
        "the GPU room beside vLLM's budget, or run with GLYD_KV=off")

_lock = threading.Lock()
_engine = ["dp0"]  # this process's engine's folder in the channel
_read: dict[str, int] = {}  # a channel file's path -> how far this process has read it
_unstored: dict[int, set[int]] = {}  # check mode: a layer's (id of its state) blocks holding values not stored


def name_channel() -> str:
    """Called by the config check, before vLLM starts the engine's processes: the folder they will share (made by
    the scheduler when it starts listening, so that a config that never starts an engine leaves nothing behind)."""
    path = str(Path(tempfile.gettempdir()) / f"glyd-refusals-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.environ[CHANNEL_ENV] = path
    return path


def close_channel() -> None:
    """The config check of an engine whose scheduler will not listen: its writes raise."""
    os.environ.pop(CHANNEL_ENV, None)


def join(vllm_config: Any) -> None:
    """Where an engine's scheduler or attention layers are made: the engines of data parallelism inherit one channel
    (the config check ran once, before they started), each uses a folder of its own in it, by its rank."""
    rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0)
    _engine[0] = f"dp{rank if isinstance(rank, int) else 0}"


def _channel() -> Path | None:
    path = os.environ.get(CHANNEL_ENV)
    return Path(path) / _engine[0] if path else None


def listen() -> None:
    """Called by the scheduler: reported blocks are refused from now on, not raised."""
    if CHANNEL_ENV not in os.environ:  # the scheduler class named by hand, with no config check: one of its own
        name_channel()
    channel = _channel()
    assert channel is not None
    channel.mkdir(parents=True, exist_ok=True)
    for name in ("reports", "releases"):
        (channel / name).touch()
    with _lock:
        _read.clear()
        _unstored.clear()


def stop() -> None:
    """The scheduler shut down: its channel goes, and a later engine of this process raises unless its own
    scheduler listens."""
    channel = _channel()
    if channel is not None:
        shutil.rmtree(channel, ignore_errors=True)
        with contextlib.suppress(OSError):  # the last engine of the channel takes its folder too
            channel.parent.rmdir()
    with _lock:
        _read.clear()
        _unstored.clear()


def listening() -> bool:
    channel = _channel()
    return channel is not None and channel.is_dir()


def _append(path: Path, entry: dict) -> None:
    """One line in one write: appends of several processes never interleave within it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (json.dumps(entry, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)


def _new_lines(path: Path) -> list[dict]:
    """The whole lines appended to `path` since this process last read it."""
    key = str(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return []
    with _lock:
        start = _read.get(key, 0)
        if size <= start:
            return []
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(size - start)
        end = data.rfind(b"\n") + 1
        _read[key] = start + end
    return [json.loads(line) for line in data[:end].splitlines() if line]


def report(lost: torch.Tensor, block_size: int, why: str, layer: int | None = None) -> None:
    """A write left `lost` slots unstored: refuse their blocks' requests (or raise where none can be refused).
    `layer` (check mode): the layer whose reads of those blocks the check leaves out."""
    blocks = sorted(set((lost.to(torch.int64) // block_size).tolist()))
    message = (f"Glyd KV cache: {len(lost)} tokens' values in {len(blocks)} blocks found no room in the overflow "
               f"arena ({why}): their values are far rarer than the model's KV tables expect")
    channel = _channel()
    if channel is None or not channel.is_dir():
        raise OverflowRoomError(f"{message}; {HINT}")
    if layer is not None:
        with _lock:
            _unstored.setdefault(layer, set()).update(blocks)
    try:
        _append(channel / "reports", {"blocks": blocks, "size": block_size, "why": why})
    except FileNotFoundError as exc:  # the scheduler has shut down
        raise OverflowRoomError(f"{message}; {HINT}") from exc
    log.error("%s. The requests holding them are refused; %s", message, HINT)


def take() -> dict[tuple[int, int], str]:
    """The scheduler: the blocks reported since the last call, (block, block size) -> why."""
    channel = _channel()
    got: dict[tuple[int, int], str] = {}
    if channel is not None:
        for entry in _new_lines(channel / "reports"):
            for b in entry["blocks"]:
                got[(int(b), int(entry["size"]))] = str(entry["why"])
    return got


def release(blocks: set[int], block_size: int) -> None:
    """The scheduler freed these blocks' requests and evicted them: every worker gives their overflow runs back
    before its next step writes, so that the arena has room again for the requests that follow."""
    channel = _channel()
    if blocks and channel is not None:
        _append(channel / "releases", {"blocks": sorted(blocks), "size": block_size})


def releases() -> list[tuple[set[int], int]]:
    """A worker, before a step writes: the releases the scheduler wrote since, (blocks, block size) each (a stat when
    there are none); `state.apply_releases` gives their overflow back."""
    channel = _channel()
    if channel is None:
        return []
    return [({int(b) for b in e["blocks"]}, int(e["size"])) for e in _new_lines(channel / "releases")]


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
