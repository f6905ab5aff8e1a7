"""The plugin's page reader equals the codec's reference reader bit for bit (escapes, overflow, garbage)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glyd_engine.format import bf16
from glyd_engine.format.kv_page import MIN_WINDOW_TOP, KVPageCodec, KVPageLayout, window_tables
from glyd_engine.vllm_plugin.fast_read import read_pages


def _codec(heads: int = 2, d: int = 16, b: int = 16, esc: int = 1) -> KVPageCodec:
    g = torch.Generator().manual_seed(1)
    tops = torch.randint(MIN_WINDOW_TOP, 256, (2, heads, d), generator=g, dtype=torch.uint8)
    return KVPageCodec(KVPageLayout(d, b, esc, esc), window_tables(tops))


def _values(codec: KVPageCodec, n: int, p_escape: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h, d = codec.num_heads, codec.layout.head_size
    exp = codec.dec[0, :, :, :7][..., torch.randint(0, 7, (1,), generator=g)].squeeze(-1)
    exp = exp.unsqueeze(0).expand(n, h, d).clone()
    wild = torch.rand(n, h, d, generator=g) < p_escape
    exp[wild] = torch.randint(0, 256, (int(wild.sum()),), generator=g, dtype=torch.uint8)
    return bf16.join(exp, torch.randint(0, 256, (n, h, d), generator=g, dtype=torch.uint8))


@settings(max_examples=25, deadline=None)
@given(p_escape=st.sampled_from([0.0, 0.05, 0.5, 1.0]), seed=st.integers(0, 10**6),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=4), d=st.sampled_from([16, 64, 80]))
def test_read_pages_equals_reference(p_escape: float, seed: int, chunks: list[int], d: int) -> None:
    codec = _codec(d=d)  # 16: a tail word only; 64: transposed words; 80: both
    blocks = 4
    cache = torch.randint(0, 256, (blocks, codec.num_heads, codec.layout.page_bytes), dtype=torch.uint8)
    overflow = codec.new_overflow(blocks)
    pos = 0
    for i, n in enumerate(chunks):  # appends across steps, as chunked prefill and decode do
        n = min(n, blocks * codec.layout.block_size - pos)
        if n <= 0:
            break
        slots = torch.arange(pos, pos + n)
        codec.write(cache, overflow, _values(codec, n, p_escape, seed + i), _values(codec, n, p_escape, seed - i),
                    slots)
        pos += n
    ids = torch.tensor([3, 0, 2, 1, 0])
    k0, v0 = codec.read(cache, overflow, ids)
    k1, v1 = read_pages(codec, cache, overflow, ids)
    assert torch.equal(k0.view(torch.int16), k1.view(torch.int16))
    assert torch.equal(v0.view(torch.int16), v1.view(torch.int16))
