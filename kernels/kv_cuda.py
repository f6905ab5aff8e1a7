"""Launchers of the page-code kernels in kernels/cuda/kv_pages.cu (decode attention, page writer, tile reader).

Each launcher takes the layer's tensors as vLLM holds them (`cache` is the layer's page tensor viewed as
[num_blocks, KV heads, page_bytes] uint8) and the window tops [2, H, D] on the same device. The kernels are
compiled per (head size, code bits, query heads a KV head, reserve, tiles a page) on first use (kernels/nvrtc.py).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from glyd_engine.format.kv_page import TILE, KVPageLayout, OverflowRoomError, OverflowStore
from glyd_kernels import kv_overflow, nvrtc

SOURCE = "kv_pages.cu"
WARPS = 4  # warps a decode block, each with its own share of the block's tiles
RING = 2  # tiles a decode warp holds in shared memory (one decoding, one in flight): fewer registers than a second
MIN_BLOCKS = 3  # register buffer, so three blocks (12 warps) fit a multiprocessor
SMS = 132  # multiprocessors of an H200, where the device does not say
MAX_SPLITS = 64
MERGE_SPLITS = 64  # the most splits the decode launch merges itself (kv_attention.cuh); kv_merge takes more
FUSED_MERGE = 1  # the last split of each (sequence, KV head) merges them: one launch a decode step
SPLIT_COST_TILES = 6  # a split's fixed cost (set-up, partial results, merge) in tiles a warp, fitted on the H200
KERNELS = ("kv_decode_attention", "kv_merge", "kv_read_tiles", "kv_write", "kv_sizes")
# the build switches a variant may set (kernels/cuda/kv_attention.cuh, kv_write.cuh): other builds that give correct
# results, timed by bench/gpu.py --variants
SWITCHES = ("WARPS", "RING", "MIN_BLOCKS", "BULK", "PATCH", "P_SPLIT", "WMIN_BLOCKS", "FUSED_MERGE", "PORTABLE")


def defines(layout: KVPageLayout, group: int, variant: tuple[tuple[str, int], ...] = ()) -> dict[str, int]:
    """Compile-time constants of a build; `variant` overrides SWITCHES (MIN_BLOCKS, WARPS, ...) for benchmarks."""
    unknown = [k for k, _ in variant if k not in SWITCHES]
    if unknown:
        raise ValueError(f"the KV kernels have no build switch {', '.join(unknown)} (they have {', '.join(SWITCHES)})")
    return {"HEAD": layout.head_size, "CODE_BITS": layout.code_bits, "GQ": group, "RESERVE": layout.reserve,
            "TPP": layout.tiles, "WARPS": WARPS, "RING": RING, "MIN_BLOCKS": MIN_BLOCKS, "FUSED_MERGE": FUSED_MERGE,
            "PORTABLE": 0, **dict(variant)}


@functools.lru_cache(maxsize=64)
def _module(head_size: int, code_bits: int, group: int, reserve: int, tiles: int, device: int,
            variant: tuple[tuple[str, int], ...] = ()) -> tuple[dict, int, int]:
    lay = KVPageLayout(head_size, tiles * TILE, reserve, code_bits)
    # PORTABLE=1 (benchmarks): the sm_80 code as PTX, compiled by the driver for this GPU (the path of GPUs before
    # Hopper, timed on one)
    ks = nvrtc.load(SOURCE, defines(lay, group, variant), KERNELS, device,
                    arch="compute_80" if dict(variant).get("PORTABLE") else None)
    sizes = torch.zeros(2, dtype=torch.int32, device=f"cuda:{device}")
    ks["kv_sizes"]((1,), (1,), [sizes])
    attn_smem, write_smem = (int(x) for x in sizes.tolist())
    if attn_smem > 48 * 1024:
        nvrtc.set_max_smem(ks["kv_decode_attention"], attn_smem)
    if write_smem > 48 * 1024:
        nvrtc.set_max_smem(ks["kv_write"], write_smem)
    split_counts(torch.device("cuda", device), MIN_COUNTS)  # now, before any graph capture needs them
    return ks, attn_smem, write_smem


def kernels(layout: KVPageLayout, group: int, device: torch.device, variant: tuple[tuple[str, int], ...] = ()
            ) -> tuple[dict, int, int]:
    """(kernels, decode attention's shared memory, writer's shared memory), compiled and loaded once."""
    if not 1 <= group <= 8:
        raise ValueError(f"the CUDA KV kernels take 1..8 query heads a KV head, not {group}")
    return _module(layout.head_size, layout.code_bits, group, layout.reserve, layout.tiles, device.index or 0, variant)


def _check(cache: torch.Tensor, layout: KVPageLayout, tops: torch.Tensor) -> int:
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != layout.page_bytes:
        raise ValueError(f"cache must be uint8 [num_blocks, H, {layout.page_bytes}], got {tuple(cache.shape)}")
    if cache.stride(2) != 1:  # blocks and heads may sit at any strides (_strides); a page's bytes are one run
        raise ValueError(f"each page must be {layout.page_bytes} contiguous bytes, got strides {cache.stride()}")
    h = cache.shape[1]
    if tops.shape != (2, h, layout.head_size) or tops.dtype != torch.uint8 or tops.device != cache.device:
        raise ValueError(f"tops must be uint8 [2, {h}, {layout.head_size}] on {cache.device}")
    return h


def _overflow_args(overflow: OverflowStore | None, layout: KVPageLayout, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The store's run table and arena reference (kernels read them only for tiles whose entries passed the page's
    list; the reference, in device memory, stays valid in a captured graph when the arena moves)."""
    if overflow is None:
        return torch.full((1,), -1, dtype=torch.int32, device=device), torch.zeros(2, dtype=torch.int64, device=device)
    return overflow.ptr, kv_overflow.device_runs(overflow, layout.head_size).arena_ref()


def num_splits_for(batch: int, num_kv_heads: int, max_seq_len: int, sms: int = SMS,
                   blocks_per_sm: int = MIN_BLOCKS) -> int:
    """Context splits of a decode launch: the fewest that minimise waves of blocks x (tiles a warp + a split's cost).

    Whole waves, because a wave of blocks only partly full still takes a block's time; the fixed cost, because
    each split sets up, writes partial results and is merged."""
    return _splits(max(1, batch * num_kv_heads), math.ceil(max(1, max_seq_len) / TILE), sms * blocks_per_sm)


@functools.lru_cache(maxsize=4096)
def _splits(blocks: int, tiles: int, slots: int) -> int:
    best, best_cost = 1, math.inf
    for s in range(1, max(1, min(MAX_SPLITS, tiles // WARPS)) + 1):
        cost = math.ceil(blocks * s / slots) * (math.ceil(tiles / (s * WARPS)) + SPLIT_COST_TILES)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(query: torch.Tensor, cache: torch.Tensor, layout: KVPageLayout, tops: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                     overflow: OverflowStore | None = None, out: torch.Tensor | None = None,
                     num_splits: int | None = None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                     variant: tuple[tuple[str, int], ...] = ()) -> torch.Tensor:
    """Attention of one query token a sequence over compressed pages.

    query [S, Hq, D] bf16 (head dim contiguous); block_table int32 [S, max_blocks]; seq_lens int32 [S] (all >= 1);
    max_seq_len (host int) sizes the context split: each sequence's splits share its own tiles, so any count is
    correct for any length, and a captured graph passes the longest length it will replay. Returns out [S, Hq, D].
    """
    h = _check(cache, layout, tops)
    s, hq, d = query.shape
    if hq % h or d != layout.head_size or query.dtype != torch.bfloat16 or query.stride(2) != 1:
        raise ValueError("query must be bf16 [S, a multiple of the KV heads, head size] with contiguous head dims")
    query = _aligned(query)  # the kernel reads Q rows as 16-byte vectors
    ks, smem, _ = kernels(layout, hq // h, cache.device, variant)
    build = defines(layout, hq // h, variant)
    warps = build["WARPS"]
    if out is None:
        out = torch.empty_like(query)
    if s == 0:
        return out
    splits = num_splits or num_splits_for(s, h, max_seq_len, _multiprocessors(query.device), build["MIN_BLOCKS"])
    if splits > 1:
        if scratch is None:
            part_o = torch.empty(s * hq * splits * d, dtype=torch.float32, device=query.device)
            part_ml = torch.empty(s * hq * splits * 2, dtype=torch.float32, device=query.device)
        else:
            part_o, part_ml = scratch
    else:
        part_o = part_ml = out
    ptr, ref = _overflow_args(overflow, layout, cache.device)
    bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    sl = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    fused = 1 < splits <= MERGE_SPLITS and build["FUSED_MERGE"]
    counts = split_counts(cache.device, s * h) if fused else None
    ks["kv_decode_attention"](
        (splits, h, s), (warps * 32,),
        [query, out, part_o, part_ml, cache, tops, ptr, ref, bt, sl, float(scale * 1.4426950408889634),
         query.stride(0), query.stride(1), out.stride(0), out.stride(1), bt.stride(0), h, splits, *_strides(cache),
         nvrtc.Ptr(0) if counts is None else counts],
        smem=smem)
    if splits > 1 and counts is None:
        ks["kv_merge"]((s, hq), (d,), [out, part_o, part_ml, out.stride(0), out.stride(1), hq, splits])
    return out


MIN_COUNTS = 1 << 14  # (sequence, KV head) pairs: 2048 sequences of 8 KV heads in 64 KiB


class _SplitCounts:
    """A device's split counters, zero between launches (the last split's atomicInc wraps its own), so a device's
    decode launches share one stream. Outgrown buffers stay alive, since a captured graph may replay with them."""

    def __init__(self) -> None:
        self.now: torch.Tensor | None = None
        self.old: list[torch.Tensor] = []


_COUNTS: dict[int, _SplitCounts] = {}


def split_counts(device: torch.device, pairs: int) -> torch.Tensor | None:
    """Counters for `pairs` (sequence, KV head) pairs, or None during a CUDA-graph capture that would have to grow
    them (that graph merges its splits in a second launch instead)."""
    c = _COUNTS.setdefault(device.index or 0, _SplitCounts())
    if c.now is None or c.now.numel() < pairs:
        if torch.cuda.is_current_stream_capturing():
            return None
        if c.now is not None:
            c.old.append(c.now)
        c.now = torch.zeros(max(pairs, MIN_COUNTS), dtype=torch.int32, device=device)
    return c.now


def read_tiles(cache: torch.Tensor, layout: KVPageLayout, tops: torch.Tensor, tiles: torch.Tensor,
               overflow: OverflowStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles (numbered block * tiles a page + tile) -> (K, V) [N, H, 16, D] bf16, escapes patched.

    Rows past a tile's fill are garbage, as with `KVPageCodec.read`."""
    h = _check(cache, layout, tops)
    ks, _, _ = kernels(layout, 1, cache.device)
    n = tiles.numel()
    k = torch.empty(n, h, TILE, layout.head_size, dtype=torch.bfloat16, device=cache.device)
    v = torch.empty_like(k)
    if n:
        ptr, ref = _overflow_args(overflow, layout, cache.device)
        ks["kv_read_tiles"]((n, h), (32,), [k, v, cache, tops, ptr, ref, tiles.to(torch.int64).contiguous(), h,
                                               *_strides(cache)])
    return k, v


def _strides(cache: torch.Tensor) -> list[nvrtc.I64]:
    """Bytes from one block's pages to the next and from one KV head's page to the next: vLLM may pad pages or
    interleave other layers' pages between blocks (its KV cache layouts), and the kernels follow its strides."""
    return [nvrtc.I64(cache.stride(0)), nvrtc.I64(cache.stride(1))]


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """The kernels read a token's head row as 16-byte vectors: rows must start 16-byte aligned."""
    if x.data_ptr() % 16 or x.stride(0) % 8 or x.stride(1) % 8:
        return x.clone(memory_format=torch.contiguous_format)
    return x


SPAN_TOKENS = 1024  # writes of at most this many tokens get a block a token (decode steps: a block a sequence)


def write(cache: torch.Tensor, layout: KVPageLayout, tops: torch.Tensor, overflow: OverflowStore,
          key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> int:
    """Append the step's K/V [T, H, D] bf16 at `slots` (int64; -1 padding); a tile's tokens must be consecutive
    and in order. Runs without a host sync when the arena surely has room or room was reserved for it
    (kernels/kv_overflow.py: how a captured graph's write runs); else waits for the device once, and returns the
    rounds it had to run again for tiles that found no room (0 almost always)."""
    h = _check(cache, layout, tops)
    t = slots.shape[0]
    if t == 0:
        return 0
    if key.shape[1:] != (h, layout.head_size) or key.dtype != torch.bfloat16 or key.stride(2) != 1:
        raise ValueError("key/value must be bf16 [T, H, D] with contiguous head dims")
    key, value = _aligned(key), _aligned(value)
    sl = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
    runs = kv_overflow.device_runs(overflow, layout.head_size)
    need = runs.need_for(t)
    if runs.take_reserved(t):
        launch_write(cache, layout, tops, overflow, key, value, sl, need)
        return 0
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a page write captured in a CUDA graph needs room reserved for it first "
                           "(KVLayer.reserve in the step's metadata builder)")
    if runs.unchecked_ok(t):
        launch_write(cache, layout, tops, overflow, key, value, sl, need)
        runs.launched_unchecked(t)
        return 0
    runs.checked += 1
    if not runs.unchecked_ok(min(t, kv_overflow.HEADROOM_TOKENS)):  # short of the arena's usual headroom
        runs.wait()
        with contextlib.suppress(OverflowRoomError):  # no room for the worst case: the write's misses say who lacks
            runs.make_room(t)
    launch_write(cache, layout, tops, overflow, key, value, sl, need)
    rounds = 0
    while True:
        _, missed = runs.wait(misses_expected=True)
        if not missed:
            return rounds
        rounds += 1
        wanted = need[need > 0].to(torch.int64)
        try:
            runs.make_room(t, extra=int((2 * wanted + 8).sum()))  # each short run moves to a power of two >= its need
        except OverflowRoomError as exc:  # the tiles that found no room stay unstored; every other one is whole
            lost = sl[(need.view(t, -1) > 0).any(1)].clone()
            need.zero_()
            raise OverflowRoomError(str(exc), slots=lost) from exc
        launch_write(cache, layout, tops, overflow, key, value, sl, need, only_needy=True)


def launch_write(cache: torch.Tensor, layout: KVPageLayout, tops: torch.Tensor, overflow: OverflowStore,
                 key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, need: torch.Tensor,
                 only_needy: bool = False, variant: tuple[tuple[str, int], ...] = (), span: int | None = None) -> None:
    """One run of the page writer, no host sync: it takes overflow runs on the device; tiles that found no room in
    the arena are left uncounted, counted in the store's counters and marked in `need` [T, H, 2] (all zero on entry);
    `write` grows the arena and runs it again with `only_needy`. `span` (tokens a block looks at, 1..16) is for
    benchmarks."""
    ks, _, smem = kernels(layout, 1, cache.device, variant)
    t, h = slots.shape[0], cache.shape[1]
    runs = kv_overflow.device_runs(overflow, layout.head_size)
    ptr, ref = _overflow_args(overflow, layout, cache.device)
    span = span or (1 if t <= SPAN_TOKENS else TILE)
    ks["kv_write"]((math.ceil(t / span), h), (128,), [
        cache, key, value, slots, tops, ptr, ref, runs.counters, need, t, h, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), int(only_needy), span, *_strides(cache)], smem=smem)


__all__ = ["decode_attention", "launch_write", "num_splits_for", "read_tiles", "write"]
