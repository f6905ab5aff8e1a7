"""Requests refused because their values find no room in the overflow arena: the writer tells the scheduler, and
the scheduler gives the freed blocks' overflow back to the writer.

A page write whose escapes find no overflow room stores the rest of the step and hands back the slots it could not
store (`kv_page.write_by_block`). The worker appends their blocks to `reports` in the engine's channel, a folder the
plugin's config check names in GLYD_REFUSAL_CHANNEL before vLLM starts its processes, so that the engine core and
every worker inherit it (each engine of data parallelism has a folder of its own in it: `channel_of`). After each
step the scheduler (`scheduler.py`) reads them, finishes every request holding such a block with an error, evicts
those blocks from the prefix cache, and appends the freed blocks to `releases`; each worker gives their overflow
runs back before its next step writes (`state.apply_releases`). One path, whether the worker shares the
scheduler's process (one GPU, glyd-chat) or runs in a process of its own (the CPU build's `vllm serve`, several
workers on one machine). Workers under Ray or on other nodes inherit no such folder: there the write raises.

Order: a worker reports inside the step, before it returns (the CUDA writer's lost slots are read on the host; another
rank reports before the collective that the output rank waits on), so the scheduler's update for that step finds
the report. A freed block returns to vLLM's pool only in that update, so a step that reuses it starts after the
release was written, and its worker applies the release before writing. Where no scheduler listens (the user named
their own, or Ray), the write raises instead, naming the way out; the engine stops, and nothing wrong is ever served.

vLLM's start-up runs (memory profile, compilation, CUDA-graph capture) come before it makes the scheduler, their
dummy slots padding (-1, which the writers skip). Should such a write store values in vLLM's null block (block 0,
which no request is ever given) and find no room all the same, it drops them; any other block's values that find no
room before a scheduler listens raise, as where none ever will. A worker's first step after its scheduler listens
gives back every run taken before (`serving_began`): an arena limit is room for requests alone.
"""

from __future__ import annotations

import atexit
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
_worker_channel: list[Path | None] = [None]  # this process's attention layers' engine's folder, fixed when made
_read: dict[str, int] = {}  # a channel file's path -> how far this process has read it
_unstored: dict[int, set[int]] = {}  # check mode: a layer's (id of its state) blocks holding values not stored
_logged: set[tuple[int, ...]] = set()  # blocks whose refusal this worker logged since its last step began
_serving: list[Path | None] = [None]  # the channel whose scheduler this worker has seen listening (its first step)
_warm_up_logged: list[Path | None] = [None]


def name_channel() -> str:
    """Called by the config check, before vLLM starts the engine's processes: the folder they will share (made by
    the scheduler when it starts listening, so that a config that never starts an engine leaves nothing behind)."""
    path = str(Path(tempfile.gettempdir()) / f"glyd-refusals-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.environ[CHANNEL_ENV] = path
    # a server stopped by a signal never shuts its scheduler down: the process that named the folder takes it
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def close_channel() -> None:
    """The config check of an engine whose scheduler will not listen: its writes raise."""
    os.environ.pop(CHANNEL_ENV, None)


def channel_of(vllm_config: Any) -> Path | None:
    """The engine's folder: the channel its processes inherited, and in it one folder an engine of data parallelism
    (they inherit one name; `data_parallel_index` is each one's rank, where vLLM resets `data_parallel_rank` to 0 for
    engines that run independently)."""
    path = os.environ.get(CHANNEL_ENV)
    if not path:
        return None
    pc = vllm_config.parallel_config
    rank = getattr(pc, "data_parallel_index", None)
    if not isinstance(rank, int):
        rank = getattr(pc, "data_parallel_rank", 0)
    return Path(path) / f"dp{rank if isinstance(rank, int) else 0}"


def join(vllm_config: Any) -> None:
    """Where a worker makes its attention layers: their reports and releases use this engine's folder from now on,
    even if a later config check names another channel."""
    _worker_channel[0] = channel_of(vllm_config)


def listen(vllm_config: Any) -> Path:
    """Called by the scheduler: reported blocks are refused from now on, not raised. Its folder, for `take`,
    `release` and `stop`."""
    if CHANNEL_ENV not in os.environ:  # the scheduler class named by hand, with no config check: one of its own
        name_channel()
    channel = channel_of(vllm_config)
    assert channel is not None
    channel.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in ("reports", "releases"):
        (channel / name).touch(mode=0o600)
    if _worker_channel[0] is None:  # this process's workers were made without a channel to join
        _worker_channel[0] = channel
    with _lock:
        for name in ("reports", "releases"):
            _read.pop(str(channel / name), None)
    return channel


def stop(channel: Path) -> None:
    """The scheduler shut down: its folder goes, and its workers' writes raise from now on."""
    shutil.rmtree(channel, ignore_errors=True)
    with contextlib.suppress(OSError):  # the last engine of the channel takes its folder too
        channel.parent.rmdir()
    with _lock:
        for name in ("reports", "releases"):
            _read.pop(str(channel / name), None)
        if _worker_channel[0] == channel:
            _unstored.clear()
            _serving[0] = channel  # it did listen: from now on a write with no room raises
            _logged.clear()


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
    channel = _worker_channel[0]
    # vLLM's null block (0), which no request is ever given, written before any scheduler listens: a start-up run
    if blocks == [0] and channel is not None and channel != _serving[0] and not channel.is_dir():
        if _warm_up_logged[0] != channel:
            _warm_up_logged[0] = channel
            log.warning("Glyd KV cache: %d dummy tokens of vLLM's start-up found no room in the overflow arena (%s); "
                        "no request holds their blocks, so their values are dropped", len(lost), why)
        return
    if channel is None or not channel.is_dir():
        raise OverflowRoomError(f"{message}; {HINT}")
    if layer is not None:
        with _lock:
            _unstored.setdefault(layer, set()).update(blocks)
    try:
        _append(channel / "reports", {"blocks": blocks, "size": block_size, "why": why})
    except FileNotFoundError as exc:  # the scheduler has shut down
        raise OverflowRoomError(f"{message}; {HINT}") from exc
    with _lock:  # every layer of the step reports the same blocks: one line says it
        new = tuple(blocks) not in _logged
        _logged.add(tuple(blocks))
    if new:
        log.error("%s. The requests holding them are refused; %s", message, HINT)


def serving_began() -> bool:
    """True once a worker: at its first step after its engine's scheduler listens. Every page and overflow run it wrote
    before then holds vLLM's warm-up tokens (the scheduler is made after the start-up's dummy runs)."""
    channel = _worker_channel[0]
    if channel is None or channel == _serving[0] or not channel.is_dir():
        return False
    _serving[0] = channel
    return True


def take(channel: Path) -> dict[tuple[int, int], str]:
    """The scheduler: the blocks reported since the last call, (block, block size) -> why."""
    got: dict[tuple[int, int], str] = {}
    for entry in _new_lines(channel / "reports"):
        for b in entry["blocks"]:
            got[(int(b), int(entry["size"]))] = str(entry["why"])
    return got


def release(channel: Path, blocks: set[int], block_size: int) -> None:
    """The scheduler freed these blocks' requests and evicted them: every worker gives their overflow runs back
    before its next step writes, so that the arena has room again for the requests that follow."""
    if blocks:
        with contextlib.suppress(FileNotFoundError):  # shut down meanwhile: the workers write nothing more
            _append(channel / "releases", {"blocks": sorted(blocks), "size": block_size})


def releases() -> list[tuple[set[int], int]]:
    """A worker, before a step writes: the releases the scheduler wrote since, (blocks, block size) each (a stat when
    there are none); `state.apply_releases` gives their overflow back."""
    with _lock:  # a new step: blocks reported again belong to other requests
        _logged.clear()
    channel = _worker_channel[0]
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


MESSAGE_START = "Glyd KV cache: this request's keys and values found no room"


def message(why: str) -> str:
    """What a refused request's output says (its `stop_reason`; finish reason `error`; server_errors.py gives it to
    API clients)."""
    return (f"{MESSAGE_START} in the overflow arena ({why}); "
            f"they are far rarer than the model's KV tables expect. To serve it, {HINT}")
