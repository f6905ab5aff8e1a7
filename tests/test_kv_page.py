"""The KV page code: every value written comes back bit for bit, however the page was filled."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glyd_engine.errors import UnsupportedModelError
from glyd_engine.format import bf16, kv_page
from tests.test_bf16_planes import all_patterns


def window_tables_for(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode tables [2, H, D, 7] from the data itself (what the table build does per model)."""
    out = []
    for x in (k, v):
        e, _ = bf16.split(x)
        out.append(kv_page.best_windows(torch.nn.functional.one_hot(e.to(torch.int64), 256).sum(0)))
    return torch.stack(out)


def layout(d: int, b: int, e: int | None = None) -> kv_page.KVPageLayout:
    e = kv_page.default_escapes(d) if e is None else e
    return kv_page.KVPageLayout(d, b, e, e)


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


def test_layout_sizes():
    lay = layout(64, 16, 3)
    assert lay.token_bytes == 2 * (64 + 24) + 6 == 182
    assert lay.page_bytes == 16 * 182
    assert lay.bits_per_value(0) == pytest.approx(11.375)
    # C does not depend on the block size (vLLM also asks with block_size=1).
    assert layout(64, 1, 3).token_bytes == lay.token_bytes
    with pytest.raises(UnsupportedModelError, match="multiple of 8"):
        layout(60, 16)


def test_all_patterns_as_k_and_v_with_overflow():
    h, d, b = 3, 64, 16
    x = torch.cat([all_patterns()[torch.randperm(65536)], all_patterns()[:128]]).reshape(-1, h, d)
    n = x.shape[0]
    codec = kv_page.KVPageCodec(layout(d, b), window_tables_for(x, x.flip(0)))
    nb = (n + b - 1) // b + 2
    cache, ovf = codec.new_cache(nb), codec.new_overflow(nb)
    cache.random_(0, 256)  # pages are reused without being zeroed
    blocks = torch.randperm(nb)[: (n + b - 1) // b]
    slots = slots_for(n, b, blocks)
    codec.write(cache, ovf, x, x.flip(0), slots)
    k, v = read_tokens(codec, cache, ovf, blocks, n)
    assert same_bits(k, x) and same_bits(v, x.flip(0))
    assert codec.stats.overflow > 0 and ovf.runs_in_use > 0
    # Rewriting the blocks from offset 0 gives their overflow chunks back before taking new ones.
    held_before, arena_before = ovf.bytes_held, ovf.arena.numel()
    codec.write(cache, ovf, x, x, slots)
    assert ovf.bytes_held == held_before and ovf.arena.numel() == arena_before
    k, v = read_tokens(codec, cache, ovf, blocks, n)
    assert same_bits(k, x) and same_bits(v, x)


@st.composite
def kv_case(draw):
    h = draw(st.integers(1, 3))
    d = draw(st.sampled_from([8, 16, 64, 80, 128]))  # 80: whole words and a tail
    b = draw(st.sampled_from([1, 2, 16, 32]))
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
    tables = window_tables_for(k, v) if use_own else window_tables_for(*(
        (torch.randn(8, h, d, generator=g) * 0.1).to(torch.bfloat16) for _ in range(2)))
    runs = []
    left = n
    while left:
        r = draw(st.integers(1, left))
        runs.append(r)
        left -= r
    e = draw(st.sampled_from([None, 0, 1]))
    return k, v, tables, layout(d, b, e), runs


@settings(max_examples=80, deadline=None)
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
    h, d, b, n = 2, 16, 4, 10
    k = (torch.randn(n, h, d)).to(torch.bfloat16)
    v = (torch.randn(n, h, d)).to(torch.bfloat16)
    codec = kv_page.KVPageCodec(layout(d, b), window_tables_for(k, v))
    blocks = torch.tensor([5, 2, 7])
    slots = slots_for(n, b, blocks)
    perm = torch.randperm(n)
    pad = torch.full((3,), -1)
    cache, ovf = codec.new_cache(8), codec.new_overflow(8)
    codec.write(cache, ovf, torch.cat([k[perm], k[:3]]), torch.cat([v[perm], v[:3]]), torch.cat([slots[perm], pad]))
    rk, rv = read_tokens(codec, cache, ovf, blocks, n)
    assert same_bits(rk, k) and same_bits(rv, v)


def test_code_bits_sit_where_the_format_says():
    """Channel 32k + 4j + b's code bit p is bit 8b + j of plane p's little-endian word k; a tail keeps bit c."""
    for d in (64, 80):
        for c in range(d):
            codes = torch.zeros(1, d, dtype=torch.int64)
            codes[0, c] = 5  # planes 0 and 2
            planes = kv_page._pack_codes(codes)[0]  # [3, D/8] bytes
            k, i = divmod(c, 32)
            q = 32 * k + 8 * (i % 4) + i // 4 if c < d - d % 32 else c
            want = torch.zeros(d // 8, dtype=torch.uint8)
            want[q // 8] = 1 << (q % 8)
            assert torch.equal(planes[0], want) and torch.equal(planes[2], want) and not planes[1].any()
            assert torch.equal(kv_page._unpack_codes(planes.unsqueeze(0))[0], codes[0])


def test_window_tables_are_what_the_codec_takes():
    tops = torch.tensor([[7, 126, 255]], dtype=torch.uint8)
    dec = kv_page.window_tables(tops)
    assert dec[0, 1].tolist() == [126, 125, 124, 123, 122, 121, 120]
    assert torch.equal(kv_page.window_bases(dec), tops)
    with pytest.raises(ValueError, match="at least 7"):
        kv_page.window_tables(torch.tensor([6], dtype=torch.uint8))
    with pytest.raises(ValueError, match="windows"):
        kv_page.window_bases(dec.flip(-1))
    counts = torch.zeros(256, dtype=torch.int64)
    counts[[0, 3, 130, 131, 136]] = torch.tensor([50, 50, 10, 10, 9])
    # no window holds exponent 0 (tops >= 7); those holding 3 (50) beat 130..136 (29); ties go to the highest top
    assert kv_page.best_windows(counts).tolist() == [9, 8, 7, 6, 5, 4, 3]
    assert kv_page.best_windows(torch.zeros(256, dtype=torch.int64)).tolist() == list(range(126, 119, -1))
    assert kv_page.OverflowStore(1, 1, initial_bytes=10).arena.numel() == 16  # whole runs: 32-bit words on a GPU
