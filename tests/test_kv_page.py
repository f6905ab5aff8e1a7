"""The KV page code (v3): every value written comes back bit for bit, however the page was filled."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glyd_engine.errors import UnsupportedModelError
from glyd_engine.format import bf16, kv_page
from glyd_engine.format.kv_page import (
    CODE_BITS,
    HEAD_SIZES,
    RESERVE_STEP,
    KVPageCodec,
    KVPageLayout,
    page_reserve,
    token_bytes,
    valid_reserve,
)
from tests.test_bf16_planes import all_patterns


def tops_for(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Window tops [2, H, D] from the data itself (what the table build does per model)."""
    out = []
    for x in (k, v):
        e, _ = bf16.split(x)
        out.append(kv_page.best_windows(torch.nn.functional.one_hot(e.to(torch.int64), 256).sum(0)))
    return torch.stack(out)


def slots_for(n_tokens: int, b: int, blocks: torch.Tensor) -> torch.Tensor:
    t = torch.arange(n_tokens)
    return blocks[t // b] * b + t % b


def read_tokens(codec, cache, overflow, blocks, n_tokens):
    k, v = codec.read(cache, overflow, blocks)  # [N, H, B, D]
    h, d = k.shape[1], k.shape[3]
    flat = lambda x: x.permute(0, 2, 1, 3).reshape(-1, h, d)[:n_tokens]  # noqa: E731
    return flat(k), flat(v)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def write_in_runs(codec, cache, overflow, k, v, slots, runs):
    t = 0
    for n in runs:
        codec.write(cache, overflow, k[t : t + n], v[t : t + n], slots[t : t + n])
        t += n
    assert t == k.shape[0]


def test_layout_sizes_and_refusals():
    lay = kv_page.KVPageLayout(64, 16, 36)
    # K and V: 16 L bytes and 6 hi bytes a channel per tile, an 8-byte trailer, 36 two-byte entries
    assert lay.tile_bytes == 2 * (16 * 64 + 6 * 64) + 8 + 72 == 2896
    assert lay.token_bytes == 181 and lay.page_bytes == 2896
    assert kv_page.KVPageLayout(64, 32, 36).page_bytes == 2 * 2896
    assert kv_page.token_bytes(128, 68) == 361  # 11.28 bits a value at D = 128
    assert kv_page.valid_reserve(30) == 36 and kv_page.valid_reserve(36) == 36 and kv_page.valid_reserve(0) == 4
    with pytest.raises(ValueError, match="4 mod 8"):
        kv_page.KVPageLayout(64, 16, 30)
    with pytest.raises(ValueError, match="multiple of 16"):
        kv_page.KVPageLayout(64, 8, 36)
    with pytest.raises(UnsupportedModelError, match="head size 80.*GLYD_KV=off"):
        kv_page.KVPageLayout(80, 16, 36)


@pytest.mark.parametrize("d", [64, 128])
def test_fragment_order_is_a_bijection_at_the_documented_places(d: int):
    """Each value has one L byte and three hi bits of its own; spot-check the fragment formulas of the docstring."""
    for kv in (0, 1):
        o, hbit = kv_page.fragment_maps(d, kv)
        assert torch.equal(o.flatten().sort().values, torch.arange(16 * d))
        assert torch.equal(hbit.flatten().sort().values, torch.arange(6 * d * 8))
    o, hbit = kv_page.fragment_maps(d, 0)
    # K: lane 4g + tig holds token 8(q % 2) + g, channels 16(q / 2) + 2tig + {0, 1, 8, 9}
    t, ch = 8 * 1 + 3, 16 * 2 + 2 * 1 + 8  # g = 3, tig = 1, q = 5, b = 2
    assert int(o[t, ch]) == (5 // 4) * 512 + (4 * 3 + 1) * 16 + (5 % 4) * 4 + 2
    # group 0 of lane 0 is unrotated in word 0: value b's sign is bit 8b + 7, c >> 2 bit 8b + 1, c >> 1 & 1 bit 8b
    assert hbit[0, 9].tolist() == [8 * 3 + 7, 8 * 3 + 1, 8 * 3]  # token 0, channel 9: q 0, b 3
    o, _ = kv_page.fragment_maps(d, 1)
    # V: lane 4g + tig holds channel 16(q / 2) + g + 8(q % 2), tokens 2tig + {0, 1, 8, 9}
    assert int(o[9, 16 + 5 + 8]) == 0 * 512 + (4 * 5 + 0) * 16 + 3 * 4 + 3  # q 3, g 5, tig 0, b 3


def test_an_escape_is_its_page_fields_plus_its_entry():
    """A value outside its window keeps L and its hi bits in the page and its exponent's top 5 bits in the list."""
    h, d, b = 1, 64, 16
    tops = torch.full((2, h, d), 130, dtype=torch.uint8)  # windows 123..130
    codec = kv_page.KVPageCodec(kv_page.KVPageLayout(d, b, 12), tops)
    k = torch.full((1, h, d), 1.5, dtype=torch.bfloat16)  # exponent 127: inside
    k[0, 0, 5] = -3.0e-20  # exponent 61: an escape
    v = k.clone()
    cache, ovf = codec.new_cache(1), codec.new_overflow(1)
    codec.write(cache, ovf, k, v, torch.tensor([0]))
    lay, page = codec.layout, cache[0, 0]
    counts = page[lay.trailer_offset : lay.trailer_offset + 8].view(torch.int16).tolist()
    assert counts == [1, 1, 1, 1]  # K entries, V entries, K in the page, V in the page
    o, _ = kv_page.fragment_maps(d, 0)
    bits = int(k[0, 0, 5].view(torch.int16)) & 0xFFFF
    e = (bits >> 7) & 0xFF
    k_entry = int(page[lay.list_offset : lay.list_offset + 2].view(torch.int16)) & 0xFFFF
    assert k_entry == int(o[0, 5]) | (e >> 3) << 11
    assert int(page[lay.l_offset(0) + int(o[0, 5])]) == ((e & 1) << 7) | (bits & 0x7F)
    end = lay.list_offset + 2 * lay.reserve
    v_entry = int(page[end - 2 : end].view(torch.int16)) & 0xFFFF  # V fills the list from its end
    assert v_entry == int(kv_page.fragment_maps(d, 1)[0][0, 5]) | (e >> 3) << 11
    rk, rv = read_tokens(codec, cache, ovf, torch.tensor([0]), 1)
    assert same_bits(rk, k) and same_bits(rv, v)


def test_all_patterns_as_k_and_v_with_overflow():
    h, d, b = 2, 64, 16
    x = all_patterns()[torch.randperm(65536)].reshape(-1, h, d)
    n = x.shape[0]
    codec = kv_page.KVPageCodec(kv_page.KVPageLayout(d, b, 12), tops_for(x[:50], x.flip(0)[:50]))
    nb = (n + b - 1) // b + 2
    cache, ovf = codec.new_cache(nb), codec.new_overflow(nb)
    cache.random_(0, 256)  # pages are reused without being zeroed
    blocks = torch.randperm(nb)[: (n + b - 1) // b]
    slots = slots_for(n, b, blocks)
    codec.write(cache, ovf, x, x.flip(0), slots)
    k, v = read_tokens(codec, cache, ovf, blocks, n)
    assert same_bits(k, x) and same_bits(v, x.flip(0))
    assert codec.stats.overflow > 0 and ovf.runs_in_use > 0
    # the trailers count what the writer counted (the CUDA writer's pages are counted this way)
    assert kv_page.escapes_held(cache[blocks], codec.layout) == (codec.stats.escapes, codec.stats.overflow)
    # Rewriting the blocks from token 0 gives their overflow runs back before taking new ones.
    held_before, arena_before = ovf.bytes_held, ovf.arena.numel()
    codec.write(cache, ovf, x, x, slots)
    assert ovf.bytes_held == held_before and ovf.arena.numel() == arena_before
    k, v = read_tokens(codec, cache, ovf, blocks, n)
    assert same_bits(k, x) and same_bits(v, x)


def test_a_limited_arena_stores_the_blocks_that_fit_and_names_the_rest():
    """Blocks of every bf16 pattern (most of them escapes) then ordinary values (no overflow), in one write, under an
    arena limit that holds one pattern block's runs: the write stores and counts nothing and says so before touching
    a page; written block by block, fewest escapes a token first, the ordinary blocks and one pattern block read back
    bit for bit, and the slots not stored are exactly those of the two other pattern blocks. Restarting a block gives
    its runs back."""
    h, d, b = 2, 64, 16
    gen = torch.Generator().manual_seed(3)
    plain = (torch.randn(4 * b, h, d, generator=gen) * 0.1).to(torch.bfloat16)
    wild = all_patterns()[torch.randperm(65536, generator=gen)][: 3 * b * h * d].reshape(-1, h, d)
    codec = kv_page.KVPageCodec(kv_page.KVPageLayout(d, b, 12), tops_for(plain, plain))
    one = codec.new_overflow(8)
    codec.write(codec.new_cache(8), one, wild[:b], wild[:b], torch.arange(b))
    assert one._top > 0
    codec.stats = kv_page.WriteStats()
    cache, ovf = codec.new_cache(8), codec.new_overflow(8)
    ovf.limit = one._top + one._top // 2  # one pattern block's runs, not two
    slots = torch.arange(7 * b)  # blocks 0-2 patterns, 3-6 ordinary
    x = torch.cat([wild, plain])
    before = cache.clone()
    with pytest.raises(kv_page.OverflowRoomError) as err:
        codec.write(cache, ovf, x, x, slots)
    assert err.value.slots is None and torch.equal(cache, before) and ovf._top == 0
    assert codec.stats.values == 0 and codec.stats.escapes == 0
    lost = kv_page.write_by_block(lambda k, v, s: codec.write(cache, ovf, k, v, s), x, x, slots, b,
                                  lambda: codec.escapes(x, x))
    assert lost.numel() == 2 * b and bool((lost < 3 * b).all()) and ovf.arena.numel() <= ovf.limit
    kept = ~torch.isin(slots // b, lost // b)
    stored = torch.unique(slots[kept] // b)
    k, v = read_tokens(codec, cache, ovf, stored, 5 * b)
    assert same_bits(k, x[kept]) and same_bits(v, x[kept])
    assert codec.stats.values == 2 * 5 * b * h * d  # the blocks stored, each counted once
    held = ovf.bytes_held
    wild_kept = int(stored[0])
    codec.write(cache, ovf, plain[:b], plain[:b], torch.arange(wild_kept * b, (wild_kept + 1) * b))  # from token 0
    assert ovf.bytes_held < held
    again = lost[:b]
    assert kv_page.write_by_block(lambda k, v, s: codec.write(cache, ovf, k, v, s), x[again], x[again], again,
                                  b).numel() == 0
    k, _ = read_tokens(codec, cache, ovf, torch.unique(again // b), b)
    assert same_bits(k, x[again])


def test_block_by_block_writes_go_fewest_escapes_a_token_first():
    """After a whole write finds no room, its blocks go one by one in order of escapes a token (ties by block), so
    ordinary text is stored before the rare text that would fill the arena."""
    order: list[int] = []

    def write(k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
        if s.numel() == 64:
            raise kv_page.OverflowRoomError("whole write")
        order.append(int(s[0]) // 16)
        if int(s[0]) // 16 == 1:
            raise kv_page.OverflowRoomError("block 1")

    slots = torch.arange(64)
    escapes = torch.tensor([5] * 16 + [1] * 16 + [9] * 16 + [1] * 8 + [0] * 8)  # rates 5, 1, 9, 0.5
    x = torch.zeros(64, 1, 64, dtype=torch.bfloat16)
    lost = kv_page.write_by_block(write, x, x, slots, 16, lambda: escapes)
    assert order == [3, 1, 0, 2] and torch.equal(lost, torch.arange(16, 32))


def test_compaction_moves_live_runs_and_loses_nothing():
    """Tiles restarted with one token give back their runs and take smaller ones, leaving holes; compaction packs the
    live runs at the arena's front (what the CUDA writer's host side does when the arena fills) and every value
    still reads back, also after more writes."""
    h, d, b = 2, 64, 16
    x = all_patterns()[torch.randperm(65536, generator=torch.Generator().manual_seed(2))].reshape(-1, h, d)
    n = x.shape[0]
    codec = kv_page.KVPageCodec(kv_page.KVPageLayout(d, b, 12), tops_for(x[:50], x.flip(0)[:50]))
    nb = n // b
    cache, ovf = codec.new_cache(nb), codec.new_overflow(nb)
    slots = slots_for(n, b, torch.arange(nb))
    codec.write(cache, ovf, x, x.flip(0), slots)
    firsts = torch.arange(0, n // 2, b)  # the first half's tiles restart with one token each
    codec.write(cache, ovf, x.flip(0)[firsts], x[firsts], slots[firsts])
    held, top_before, where, grows = ovf.bytes_held // 2, ovf._top, ovf.arena.data_ptr(), ovf.grows
    top = ovf.compact(0)  # room enough: in place
    assert top == held < top_before and ovf.arena.data_ptr() == where
    assert ovf.grows == grows and ovf.compactions == 1
    k, v = read_tokens(codec, cache, ovf, torch.arange(nb), n)
    assert same_bits(k[firsts], x.flip(0)[firsts]) and same_bits(v[firsts], x[firsts])
    size = ovf.arena.numel()
    assert ovf.compact(size + 1) == top and ovf.arena.numel() == size + 8  # a larger arena, whole 8-entry runs
    k, v = read_tokens(codec, cache, ovf, torch.arange(nb), n)
    assert same_bits(k[firsts], x.flip(0)[firsts]) and same_bits(v[firsts], x[firsts])
    assert same_bits(k[n // 2 :], x[n // 2 :]) and same_bits(v[n // 2 :], x.flip(0)[n // 2 :])
    codec.write(cache, ovf, x, x, slots)  # runs taken after compaction
    k, v = read_tokens(codec, cache, ovf, torch.arange(nb), n)
    assert same_bits(k, x) and same_bits(v, x)


def test_a_store_writes_into_the_arena_it_adopted():
    """The engine's arena, taken before vLLM profiled memory, is the store's until rare values outgrow it: runs go
    into it (no growth) and read back bit for bit; a store with runs already refuses another."""
    from glyd_kernels import kv_overflow

    h, d, b = 2, 64, 16
    x = all_patterns()[:4096].reshape(-1, h, d)
    n = x.shape[0]
    codec = kv_page.KVPageCodec(kv_page.KVPageLayout(d, b, 12), tops_for(x[:50], x.flip(0)[:50]))
    nb = n // b
    cache, ovf = codec.new_cache(nb), codec.new_overflow(nb)
    arena = kv_overflow.reserve_arena(h, d, torch.device("cpu"))
    assert arena.dtype == torch.int16 and arena.numel() == kv_overflow.fresh_entries(h, d)
    ovf.adopt(arena)
    codec.write(cache, ovf, x, x.flip(0), slots_for(n, b, torch.arange(nb)))
    assert ovf.runs_in_use > 0 and ovf.grows == 0 and ovf.arena.data_ptr() == arena.data_ptr()
    k, v = read_tokens(codec, cache, ovf, torch.arange(nb), n)
    assert same_bits(k, x) and same_bits(v, x.flip(0))
    with pytest.raises(ValueError, match="before its first run"):
        ovf.adopt(torch.zeros(64, dtype=torch.int16))
    with pytest.raises(ValueError, match="int16"):
        codec.new_overflow(nb).adopt(torch.zeros(64, dtype=torch.int32))


def test_a_store_keeps_its_run_pointers_in_the_memory_it_was_given():
    """The engine's run-pointer memory, taken before vLLM profiled memory: the store's pointer table is its first
    entries (the rest untouched), every run is there, and values read back bit for bit."""
    from glyd_kernels.kv_layer import KVLayer

    h, d, b = 2, 64, 16
    x = all_patterns()[torch.randperm(65536, generator=torch.Generator().manual_seed(3))][:8192].reshape(-1, h, d)
    n = x.shape[0]
    lay = kv_page.KVPageLayout(d, b, 12)
    nb = n // b + 3
    need = nb * lay.tiles * h * 2
    table = torch.full((need + 5,), 7, dtype=torch.int32)
    kv = KVLayer(lay, tops_for(x[:50], x.flip(0)[:50]), torch.zeros(nb, h, lay.page_bytes, dtype=torch.uint8),
                 impl="torch", pointers=table)
    assert kv.overflow.ptr.data_ptr() == table.data_ptr() and kv.overflow.ptr.shape == (nb * lay.tiles, h, 2)
    blocks = torch.randperm(nb, generator=torch.Generator().manual_seed(4))[: n // b]
    kv.write(x, x.flip(0), slots_for(n, b, blocks))
    assert kv.overflow.runs_in_use > 0 and int((table[:need] >= 0).sum()) == kv.overflow.runs_in_use
    assert table[need:].tolist() == [7] * 5
    k, v = kv.read(blocks)  # a tile a block: [blocks, H, 16, D] in slot order
    assert same_bits(k.transpose(1, 2).reshape(n, h, d), x) and same_bits(v.transpose(1, 2).reshape(n, h, d), x.flip(0))
    for bad in (torch.zeros(need, dtype=torch.int64), torch.zeros(need - 1, dtype=torch.int32)):
        with pytest.raises(ValueError, match="overflow pointer table is int32"):
            kv_page.OverflowStore(nb * lay.tiles, h, table=bad)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 40), st.integers(1, 96), st.sampled_from([16, 32, 64, 128, 256]), st.integers(1, 64),
       st.sampled_from([(64, 3), (64, 4), (128, 3), (128, 4), (256, 4)]))
def test_the_pointer_reserve_holds_the_pointers_of_every_block_a_budget_buys(budget, layers, block, heads, code):
    """vLLM splits its KV budget into blocks of L layers' pages; each layer's pointer table must fit the reserve
    taken before that split, and the reserve wastes less than one block's pointers."""
    from glyd_kernels import kv_overflow

    d, bits = code
    c = token_bytes(d, page_reserve(d, 12, bits), bits)
    blocks = budget // (layers * heads * block * c)
    need = blocks * (block // 16) * heads * 2
    bound = kv_overflow.pointer_entries_bound(budget, layers, c)
    assert need <= bound < need + (block // 16) * heads * 2 + 1


def test_an_arena_limit_below_the_first_arena_is_the_first_arena():
    """GLYD_KV_ARENA_MB under the usual first arena: the engine reserves the limit (whole runs, at least one), so
    the limit holds from the first write; a larger limit leaves the usual first arena."""
    from glyd_kernels import kv_overflow

    h, d = 3, 64
    fresh = kv_overflow.fresh_entries(h, d)
    cpu = torch.device("cpu")
    assert kv_overflow.reserve_arena(h, d, cpu, 2_000).numel() == 2_000
    assert kv_overflow.reserve_arena(h, d, cpu, 2_005).numel() == 2_000  # whole 8-entry runs
    assert kv_overflow.reserve_arena(h, d, cpu, 1).numel() == kv_page.OVERFLOW_MIN_RUN
    assert kv_overflow.reserve_arena(h, d, cpu, 10 * fresh).numel() == fresh
    assert kv_overflow.reserve_arena(h, d, cpu).numel() == fresh


@pytest.mark.parametrize(("h", "d"), [(1, 64), (8, 128), (3, 256)])
def test_a_fresh_arena_is_what_a_compaction_with_no_live_runs_leaves(h: int, d: int):
    """What the engine reserves a layer is the room the host's bound asks of an empty arena for any decode step of up
    to HEADROOM_TOKENS sequences, so such steps never move it; live runs ask for more."""
    from glyd_kernels import kv_overflow as ko

    fresh = ko.fresh_entries(h, d)
    for tokens in (1, 64, ko.HEADROOM_TOKENS, 4 * ko.HEADROOM_TOKENS):
        assert ko.arena_target(0, tokens, h, d) == fresh
        assert ko.worst_after(ko.worst_after(0, min(tokens, ko.HEADROOM_TOKENS), h, d),
                              min(tokens, ko.HEADROOM_TOKENS), h, d) <= fresh
    assert ko.arena_target(1000, 1, h, d) > fresh and ko.arena_target(1000, 1, h, d) >= ko.worst_after(1000, 1, h, d)


@st.composite
def kv_case(draw):
    h = draw(st.integers(1, 3))
    d = draw(st.sampled_from([64, 128]))
    b = draw(st.sampled_from([16, 32]))
    n = draw(st.integers(1, 70))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["model-like", "random-bits", "constant", "rare-exponent", "specials"]))
    if kind == "model-like":
        k = (torch.randn(n, h, d, generator=g) * torch.rand(1, 1, d, generator=g) * 8).to(torch.bfloat16)
        v = (torch.randn(n, h, d, generator=g) * 0.5).to(torch.bfloat16)
    elif kind == "random-bits":
        k = torch.randint(-32768, 32768, (n, h, d), generator=g, dtype=torch.int16).view(torch.bfloat16)
        v = torch.randint(-32768, 32768, (n, h, d), generator=g, dtype=torch.int16).view(torch.bfloat16)
    elif kind == "constant":
        c = draw(st.integers(-32768, 32767))
        k = v = torch.full((n, h, d), c, dtype=torch.int16).view(torch.bfloat16)
    elif kind == "rare-exponent":
        sm = torch.randint(0, 256, (n, h, d), generator=g, dtype=torch.int32)
        bits = ((sm & 0x80) << 8) | (draw(st.sampled_from([0, 255, 1])) << 7) | (sm & 0x7F)
        k = v = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)
    else:
        sp = torch.tensor([0, -0x8000, 0x7F80, -0x80, 0x7FC0, 0x7F81, -1, 1], dtype=torch.int16)
        k = sp[torch.randint(0, 8, (n, h, d), generator=g)].view(torch.bfloat16)
        v = sp[torch.randint(0, 8, (n, h, d), generator=g)].view(torch.bfloat16)
    # Tables from other data than the pages hold, sometimes: escapes and overflow get exercised.
    use_own = draw(st.booleans())
    tables = tops_for(k, v) if use_own else tops_for(*(
        (torch.randn(8, h, d, generator=g) * 0.1).to(torch.bfloat16) for _ in range(2)))
    runs = []
    left = n
    while left:
        r = draw(st.integers(1, left))
        runs.append(r)
        left -= r
    reserve = draw(st.sampled_from([4, 12, 36]))
    return k, v, tables, kv_page.KVPageLayout(d, b, reserve), runs


@settings(max_examples=60, deadline=None)
@given(kv_case())
def test_hypothesis_pages_round_trip(case):
    k, v, tables, lay, runs = case
    n, b = k.shape[0], lay.block_size
    codec = kv_page.KVPageCodec(lay, tables)
    nb = (n + b - 1) // b + 3
    blocks = torch.randperm(nb)[: (n + b - 1) // b]
    slots = slots_for(n, b, blocks)
    # One write, runs (chunked prefill), and one token at a time (decode) must all read back the same
    # values, and leave the same page bytes: appends never re-encode what is already there.
    caches = []
    for split in ([n], runs, [1] * n):
        cache, ovf = codec.new_cache(nb), codec.new_overflow(nb)
        cache.random_(0, 256, generator=torch.Generator().manual_seed(1))  # same stale bytes each time
        write_in_runs(codec, cache, ovf, k, v, slots, split)
        rk, rv = read_tokens(codec, cache, ovf, blocks, n)
        assert same_bits(rk, k) and same_bits(rv, v)
        caches.append(cache)
    full = n // b  # whole pages hold identical bytes whatever the write pattern
    if full:
        for c in caches[1:]:
            assert torch.equal(c[blocks[:full]], caches[0][blocks[:full]])


def test_padding_slots_are_ignored_and_order_does_not_matter():
    h, d, b, n = 2, 64, 16, 40
    k = (torch.randn(n, h, d)).to(torch.bfloat16)
    v = (torch.randn(n, h, d)).to(torch.bfloat16)
    codec = kv_page.KVPageCodec(kv_page.KVPageLayout(d, b, 12), tops_for(k, v))
    blocks = torch.tensor([5, 2, 7])
    slots = slots_for(n, b, blocks)
    perm = torch.randperm(n)
    pad = torch.full((3,), -1)
    cache, ovf = codec.new_cache(8), codec.new_overflow(8)
    codec.write(cache, ovf, torch.cat([k[perm], k[:3]]), torch.cat([v[perm], v[:3]]), torch.cat([slots[perm], pad]))
    rk, rv = read_tokens(codec, cache, ovf, blocks, n)
    assert same_bits(rk, k) and same_bits(rv, v)


def test_best_windows_hold_the_most_and_never_zero_or_inf():
    counts = torch.zeros(256, dtype=torch.int64)
    counts[[0, 3, 130, 131, 137]] = torch.tensor([50, 50, 10, 10, 9])
    # no window holds exponent 0 (tops >= 8): the one holding 3 (50) beats those holding 130..137 (29)
    assert int(kv_page.best_windows(counts)) == 10  # ties go to the highest top: 3..10
    counts = torch.zeros(256, dtype=torch.int64)
    counts[[130, 131, 137, 255]] = torch.tensor([10, 10, 9, 100])
    assert int(kv_page.best_windows(counts)) == 137  # 255 (inf, NaN) never in a window: 130..137
    assert int(kv_page.best_windows(torch.zeros(256, dtype=torch.int64))) == kv_page.UNSEEN_TOP
    with pytest.raises(ValueError, match="8..254"):
        kv_page.KVPageCodec(kv_page.KVPageLayout(64, 16, 12), torch.full((2, 1, 64), 7, dtype=torch.uint8))
    assert kv_page.OverflowStore(1, 1, initial_entries=10).arena.numel() == 16  # whole 8-entry runs


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("code_bits", CODE_BITS)
def test_page_reserve_gives_whole_bf16_tokens(head_size, code_bits):
    """vLLM views a page as bf16: an odd C would be padded, leaving pages that are not one run of bytes."""
    for entries in range(0, 200):
        r = page_reserve(head_size, entries, code_bits)
        assert r >= entries and r == valid_reserve(r) and r - valid_reserve(entries) in (0, RESERVE_STEP)
        assert token_bytes(head_size, r, code_bits) % 2 == 0


def test_codec_on_strided_pages():
    """Pages at vLLM's strides (each block padded, or other layers' pages between blocks) hold the same bytes."""
    lay = KVPageLayout(64, 32, page_reserve(64, 20, 3), 3)
    codec = KVPageCodec(lay, torch.full((2, 2, 64), 127, dtype=torch.uint8))
    dense = codec.new_cache(6)
    backing = torch.zeros(6, 3, 2, lay.page_bytes + 48, dtype=torch.uint8)  # 3 layers interleaved, padded pages
    strided = backing[:, 1, :, : lay.page_bytes]
    assert not strided.is_contiguous()
    g = torch.Generator().manual_seed(0)
    key = (torch.randn(40, 2, 64, generator=g) * 3).to(torch.bfloat16)
    value = torch.randn(40, 2, 64, generator=g).to(torch.bfloat16)
    key[3, 0, 5] = float("inf")
    value[7, 1, 9] = 1e-40
    slots = torch.cat([torch.arange(32, 52), torch.arange(128, 148)])
    overflow = {}
    for name, cache in (("dense", dense), ("strided", strided)):
        overflow[name] = codec.new_overflow(6)
        codec.write(cache, overflow[name], key, value, slots)
    assert torch.equal(strided, dense)
    held = kv_page.escapes_held(strided, lay)  # the writer counted both writes
    assert held == kv_page.escapes_held(dense, lay) == (codec.stats.escapes // 2, codec.stats.overflow // 2)
    assert int(backing[:, 0].count_nonzero()) == 0 and int(backing[:, 2].count_nonzero()) == 0
    assert int(backing[:, 1, :, lay.page_bytes :].count_nonzero()) == 0  # nothing past a page's bytes
    k, v = codec.read(strided, overflow["strided"], torch.tensor([1, 4]))  # the blocks the slots fall in
    for got, want in ((k, key), (v, value)):
        rows = torch.cat([got[0, :, :20], got[1, :, :20]], dim=1).transpose(0, 1)  # [40, H, D]
        assert torch.equal(rows.contiguous().view(torch.int16), want.view(torch.int16))


def test_page_view_of_vllm_layouts():
    """The backend's view of vLLM's per-layer cache: dense, padded per block, or with other layers' pages between
    blocks (a block-outermost layout), each page one run of bytes; a view that splits a page is refused."""
    from glyd_engine.vllm_plugin.state import page_view
    from glyd_kernels.kv_layer import KVLayer

    lay = KVPageLayout(64, 16, page_reserve(64, 20, 3), 3)
    c = lay.token_bytes // 2  # bf16 elements a token
    tops = torch.full((2, 2, 64), 127, dtype=torch.uint8)
    key = (torch.randn(16, 2, 64) * 4).to(torch.bfloat16)
    value = torch.randn(16, 2, 64).to(torch.bfloat16)
    slots = torch.arange(48, 64)  # block 3
    layouts = {
        "dense": torch.zeros(5, 2, 16, c, dtype=torch.bfloat16),
        "interleaved": torch.zeros(5, 4, 2, 16, c, dtype=torch.bfloat16)[:, 2],  # [B, L, H, N, C]: layer 2
        "padded": torch.zeros(5, 2 * 16 * c + 32, dtype=torch.bfloat16)[:, : 2 * 16 * c].view(5, 2, 16, c),
    }
    read = {}
    for name, cache in layouts.items():
        pages = page_view(cache, lay.page_bytes)
        assert pages.shape == (5, 2, lay.page_bytes) and pages.untyped_storage().data_ptr() == \
            cache.untyped_storage().data_ptr()
        kv = KVLayer(lay, tops, pages, impl="torch")
        kv.write(key, value, slots)
        k, v = kv.read(torch.tensor([3]))
        read[name] = (k, v)
        assert torch.equal(k[0].transpose(0, 1).contiguous().view(torch.int16), key.view(torch.int16))
        assert torch.equal(v[0].transpose(0, 1).contiguous().view(torch.int16), value.view(torch.int16))
    assert int(layouts["interleaved"].count_nonzero()) > 0
    split = torch.zeros(5, 2, c, 16, dtype=torch.bfloat16).transpose(2, 3)  # a page's tokens not one run
    with pytest.raises(ValueError, match="not one run of bytes"):
        page_view(split, lay.page_bytes)
