"""Per-process state of the KV backend: the model's tables, one codec and overflow store a layer, counters.

The tables are built (first start) or loaded in the worker when the first attention layer is made, so the
page size is known before vLLM sizes its cache (`customize_spec`). Counters are per process; tests and
`glyd bench kv` read them with `llm.collective_rpc(worker_stats)`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glyd_engine.format.kv_page import KVPageCodec, OverflowStore, escapes_held
from glyd_engine.tables.kv_tables import KVTables
from glyd_engine.vllm_plugin.rank_share import RankShare, current_share

log = logging.getLogger("vllm.glyd")

_lock = threading.Lock()
_tables: dict[str, KVTables] = {}
_rank_tables: dict[str, RankTables] = {}
_current: RankTables | None = None


def model_dir(model: str) -> Path:
    """A local directory for vLLM's `model`: the engine has its files already, so nothing is downloaded."""
    from glyd_engine.errors import GlydError
    from glyd_engine.models.resolve import resolve_local

    try:
        return resolve_local(model)
    except GlydError as exc:
        raise ValueError(f"Glyd KV cache: cannot find the files of model {model!r} locally to build its KV "
                         f"tables ({exc})") from exc


def _log_progress(event: Any) -> None:
    frac = event.fraction
    if frac is None or event.done in (0, event.total) or int(event.done) % 8 == 0:
        pct = f"{100 * frac:.0f}%" if frac is not None else "..."
        log.info("Glyd KV tables: %s %s", event.phase, pct)


def _read_tables(model: str) -> KVTables:
    """The model's whole tables from the cache, built on the first start (minutes, logged). Callers hold _lock."""
    from glyd_engine.tables import ensure_tables

    d = model_dir(model)
    building: list[bool] = []

    def progress(event: Any) -> None:  # only a build reports progress: its first event says so
        if not building:
            building.append(True)
            log.info("Glyd KV tables for %s are not cached yet: building them once (a few minutes)", d)
        _log_progress(event)

    tables = ensure_tables(d, progress=progress)
    log.info("Glyd KV tables %s: %s", "built" if building else "loaded", tables.describe())
    return tables


def load_tables(model: str) -> KVTables:
    """The model's KV tables, all layers and KV heads (page sizes, reports): cached on disk by fingerprint."""
    with _lock:
        if model not in _tables:
            _tables[model] = _read_tables(model)
        return _tables[model]


@dataclass(frozen=True)
class RankTables:
    """The tables of the layers and KV heads this worker holds (its tensor/pipeline-parallel share), indexed by the
    model's own layer numbers."""

    tables: KVTables
    share: RankShare

    @property
    def num_kv_heads(self) -> int:
        return self.tables.num_kv_heads

    @property
    def head_size(self) -> int:
        return self.tables.head_size

    def token_bytes(self, code_bits: int = 3) -> int:
        return self.tables.token_bytes(code_bits)

    def codec(self, layer: int, block_size: int, code_bits: int = 3) -> KVPageCodec:
        """The codec of the model's layer `layer` (a layer outside this worker's stage is an error)."""
        if layer not in self.share.layers:
            raise ValueError(f"layer {layer} is not in this worker's pipeline stage (layers {self.share.layers.start}"
                             f"-{self.share.layers.stop - 1})")
        return self.tables.codec(layer - self.share.layers.start, block_size, code_bits)


def rank_tables(model: str) -> RankTables:
    """This worker's share of the model's tables: its stage's layers and its rank's KV heads only (the whole file is
    read and checked, then only the share is kept)."""
    global _current
    with _lock:
        if model not in _rank_tables:
            whole = _tables.get(model) or _read_tables(model)
            share = current_share(whole.num_layers, whole.num_kv_heads)
            mine = whole if share == RankShare.whole(whole.num_layers, whole.num_kv_heads) else whole.select(
                share.layers, share.kv_heads)
            if mine is not whole:
                log.info("Glyd KV tables: this worker keeps %s", share.describe())
            _rank_tables[model] = RankTables(mine, share)
        _current = _rank_tables[model]
        return _current


def current_tables() -> RankTables | None:
    return _current


@dataclass
class Stats:
    """Counters over all layers of this process (values are bf16 K or V values)."""

    pages_decoded: int = 0
    values_checked: int = 0
    values_differing: int = 0
    split_batches: int = 0  # attention calls the GPU path split between decode attention and prefill


STATS = Stats()
ARENA_RESERVE = {"bytes": 0, "pointer_bytes": 0, "layers": 0, "logged": False}  # taken before vLLM's memory profile


def note_arena_reserve(arena: torch.Tensor, pointers: torch.Tensor | None = None) -> None:
    ARENA_RESERVE["bytes"] += arena.numel() * arena.element_size()
    if pointers is not None:
        ARENA_RESERVE["pointer_bytes"] += pointers.numel() * pointers.element_size()
    ARENA_RESERVE["layers"] += 1


def log_arena_reserve() -> None:
    """Once a process, when the first cache is bound: what the overflow arenas took inside vLLM's budget."""
    if ARENA_RESERVE["layers"] and not ARENA_RESERVE["logged"]:
        ARENA_RESERVE["logged"] = True
        log.info("Glyd KV cache: the overflow arenas of %d layers take %.1f MB (their run pointers at most %.1f MB "
                 "more), held before vLLM profiled memory, so its KV budget counts them", ARENA_RESERVE["layers"],
                 ARENA_RESERVE["bytes"] / 1e6, ARENA_RESERVE["pointer_bytes"] / 1e6)
COMPARE = {"paused": False}  # check mode: compares can pause (speed runs); the shadow is always written


def pause_compare(worker: Any = None, paused: bool = True) -> bool:
    """For `llm.collective_rpc(pause_compare, args=(True,))`: time a workload without the compare cost."""
    COMPARE["paused"] = bool(paused)
    return COMPARE["paused"]


@dataclass
class LayerState:
    """One attention layer's view of vLLM's tensor as pages, its codec, overflow and (check) shadow."""

    codec: KVPageCodec
    pages: torch.Tensor  # [num_blocks, H, page_bytes] uint8, a view of vLLM's cache
    overflow: OverflowStore
    data_ptr: int
    shadow: torch.Tensor | None = None  # [num_blocks, H, 2, B, D] bf16 in check mode
    extra: dict[str, Any] = field(default_factory=dict)


LAYERS: dict[str, LayerState] = {}


def after_write(st: LayerState, slots: torch.Tensor, lost: torch.Tensor) -> None:
    """After a page write: the slots it could not store for want of overflow room go to the scheduler to refuse
    their requests (refusals.py); blocks it wrote from token 0 hold only stored values again."""
    from glyd_engine.vllm_plugin import refusals

    b = st.codec.layout.block_size
    layer = id(st) if st.shadow is not None else None  # only the read-back check needs to know, per layer
    if layer is not None:
        refusals.restarted(layer, slots, b)
    if lost.numel():
        limit = st.overflow.limit
        why = (f"a layer's arena is limited to {2 * limit / 1e6:.3g} MB" if limit is not None else
               "the device has no memory left for it")
        refusals.report(lost, b, why, layer)


def apply_releases() -> None:
    """Before a step writes: the overflow of the blocks the scheduler freed when it refused their requests
    (refusals.py), given back before any of those blocks is reused."""
    from glyd_engine.vllm_plugin import refusals

    if refusals.serving_began():
        release_warm_up()
    for blocks, block_size in refusals.releases():
        release_overflow(blocks, block_size)


def release_warm_up() -> None:
    """The first step after the scheduler listens: every overflow run holds values of vLLM's start-up, which no
    request reads (each writes its blocks from token 0), so all go back and the arena's room is the requests'."""
    with torch.inference_mode():
        for st in LAYERS.values():
            held = (st.overflow.ptr >= 0).flatten(1).any(1).nonzero().view(-1)
            if held.numel():
                st.overflow.release(held)


def release_overflow(blocks: set[int], block_size: int) -> None:
    """The scheduler freed these blocks' requests and evicted them: give their overflow runs back now (each layer's
    store), not when vLLM next reuses them, so that the arena has room again for the requests that follow."""
    if not blocks:
        return
    with torch.inference_mode():  # the stores' tensors were made in the worker's inference mode
        for st in LAYERS.values():
            bs = st.codec.layout.block_size  # the pages' block (vLLM's scheduler may count in larger ones)
            b = torch.tensor(sorted({y for x in blocks for y in range(x * block_size // bs,
                                                                     ((x + 1) * block_size - 1) // bs + 1)}),
                             dtype=torch.int64)
            tiles = (b.view(-1, 1) * st.codec.layout.tiles + torch.arange(st.codec.layout.tiles)).reshape(-1)
            st.overflow.release(tiles.to(st.overflow.ptr.device))


def write_shadow(st: LayerState, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Check mode: the step's K/V [T, H, D] into the bf16 shadow at their slots (-1: padding)."""
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    b = st.codec.layout.block_size
    blk, off = slots[keep] // b, slots[keep] % b
    st.shadow[blk, :, 0, off] = key[keep]
    st.shadow[blk, :, 1, off] = value[keep]


@dataclass
class PagesInUse:
    """The distinct pages a batch's block tables name, each with its fill (rows holding tokens)."""

    blocks: torch.Tensor  # int64 [U], ascending
    fill: torch.Tensor  # int64 [U]
    used: torch.Tensor  # bool [S, max_blocks]: table entries below their sequence's length
    inverse: torch.Tensor  # int64: for each used entry, its index in `blocks`

    def rows(self, block_size: int) -> torch.Tensor:
        """bool [U, 1, B, 1]: the rows of each page that hold tokens (the rest are garbage)."""
        r = torch.arange(block_size, device=self.fill.device).view(1, block_size)
        return (r < self.fill.view(-1, 1)).view(-1, 1, block_size, 1)


def pages_in_use(table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PagesInUse:
    seq = seq_lens.to(torch.int64)
    cols = torch.arange(table.shape[1], dtype=torch.int64, device=table.device)
    fill_all = (seq.view(-1, 1) - cols.view(1, -1) * block_size).clamp(0, block_size)
    used = fill_all > 0
    uniq, inverse = torch.unique(table[used].to(torch.int64), return_inverse=True)
    fill = torch.zeros(uniq.numel(), dtype=torch.int64, device=table.device)
    fill.scatter_reduce_(0, inverse, fill_all[used], reduce="amax", include_self=False)
    return PagesInUse(uniq, fill, used, inverse)


def compare_read(st: LayerState, blocks: torch.Tensor, valid: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> None:
    """Check mode: every value read (K, V [N, H, B, D]; rows where `valid` [N, 1, B, 1]) against the shadow."""
    want = st.shadow[blocks.to(st.shadow.device)]  # [N, H, 2, B, D]
    got = torch.stack([k, v], dim=2).to(want.device)
    mask = valid.to(want.device).unsqueeze(2).expand_as(got)
    from glyd_engine.vllm_plugin import refusals

    unstored = refusals.unstored_blocks(id(st))
    if unstored:  # values of refused requests, never served: not a read-back
        keep = ~torch.isin(blocks.to(want.device), torch.tensor(sorted(unstored), device=want.device))
        mask = mask & keep.view(-1, 1, 1, 1, 1)
    diff = got.view(torch.int16) != want.view(torch.int16)
    STATS.values_checked += int(mask.sum())
    STATS.values_differing += int((diff & mask).sum())


def page_view(kv_cache: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """vLLM's per-layer cache [blocks, H, B, C'] (any dtype) -> [blocks, H, page_bytes] uint8, no copy.

    Blocks and heads keep vLLM's strides (its layouts may pad a page or put other layers' pages between blocks);
    only a page's own bytes must be one run, which every layout with C innermost gives."""
    nb, h, b, c = kv_cache.shape
    c *= kv_cache.element_size()
    if b * c < page_bytes:
        raise ValueError(f"vLLM allocated {b * c} bytes a page, the page code needs {page_bytes}")
    if kv_cache.stride(3) != 1 or (b > 1 and kv_cache.stride(2) * kv_cache.element_size() != c):
        from glyd_engine.errors import RefusedError

        raise RefusedError(f"Glyd KV cache: vLLM's cache view has strides {kv_cache.stride()}, where a page's tokens "
                           "are not one run of bytes", settings_hint())
    raw = kv_cache.view(torch.uint8)
    return raw.as_strided((nb, h, page_bytes), (raw.stride(0), raw.stride(1), 1))


def settings_hint() -> str:
    from glyd_engine.vllm_plugin.settings import OFF_HINT

    return OFF_HINT


def worker_share(worker: Any = None) -> dict[str, Any]:
    """For `llm.collective_rpc(worker_share)`: the layers and KV heads this worker's tables hold, and a digest of
    its window tops (tests compare it with the whole tables' slice)."""
    import hashlib

    t = _current
    if t is None:
        return {}
    h = hashlib.sha256()
    for bits in sorted(t.tables.tops):
        h.update(t.tables.tops[bits].contiguous().numpy().tobytes())
    return {"layers": [t.share.layers.start, t.share.layers.stop], "kv_heads": [t.share.kv_heads.start,
            t.share.kv_heads.stop], "tops_sha256": h.hexdigest(), "token_bytes": {b: t.token_bytes(b) for b in
                                                                                 sorted(t.tables.tops)}}


def worker_stats(worker: Any = None) -> dict[str, int]:
    """Counters of this process, for `llm.collective_rpc(worker_stats)` (the worker is ignored). `escapes` and
    `overflow_values` count what the CPU writer wrote (the CUDA writer keeps no host-side counts); `escapes_held` and
    `overflow_values_held` are what either writer's pages hold now, read from the tiles' trailers."""
    s = STATS
    held = sum(st.overflow.bytes_held for st in LAYERS.values())
    grows = sum(st.overflow.grows for st in LAYERS.values())
    compactions = sum(st.overflow.compactions for st in LAYERS.values())
    arena = sum(2 * st.overflow.arena.numel() for st in LAYERS.values())
    held_counts = [escapes_held(st.pages, st.codec.layout) for st in LAYERS.values()]
    codecs = [st.codec.stats for st in LAYERS.values()]
    return {"values_written": sum(c.values for c in codecs), "escapes": sum(c.escapes for c in codecs),
            "overflow_values": sum(c.overflow for c in codecs),
            "overflow_bytes_held": held, "overflow_arena_bytes": arena, "overflow_grows": grows,
            "overflow_compactions": compactions,
            "escapes_held": sum(e for e, _ in held_counts), "overflow_values_held": sum(o for _, o in held_counts),
            "pages_decoded": s.pages_decoded, "values_checked": s.values_checked,
            "values_differing": s.values_differing, "split_batches": s.split_batches, "layers": len(LAYERS)}
