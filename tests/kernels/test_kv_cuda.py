"""The CUDA page-code kernels against the torch reference (runs where a CUDA GPU is; the device runs it natively).

Pages written by the CUDA writer hold the same bytes as the reference writer's, in one write, in runs and a token
at a time, escapes and overflow included; the tile reader returns every value bit for bit; decode attention over
those pages is within bf16 tolerance of fp32 on the exact values, for 1-8 query heads a KV head, short and long
sequences, with and without a context split, gives the same bits twice, and the same bits whether the splits are
merged inside the decode launch or by a second one.
"""

from __future__ import annotations

import math

import pytest
import torch

from glyd_engine.format import kv_page as kp
from tests.test_bf16_planes import all_patterns

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"


def model_like(n: int, h: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K with per-channel scales (channels differ by orders of magnitude), V near unit scale, a few zeros."""
    k = torch.randn(n, h, d, generator=g) * torch.exp2(torch.randint(-4, 5, (1, h, d), generator=g).float())
    v = torch.randn(n, h, d, generator=g) * 0.5
    k[torch.rand(n, h, d, generator=g) < 0.003] = 0.0
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def tops_for(k: torch.Tensor, v: torch.Tensor, code_bits: int = 3) -> torch.Tensor:
    counts = []
    for x in (k, v):
        e = (x.view(torch.int16).to(torch.int32) >> 7) & 0xFF
        counts.append(torch.nn.functional.one_hot(e.to(torch.int64), 256).sum(0))
    return kp.best_windows(torch.stack(counts), code_bits)  # [2, H, D]


def slots_for(lens: list[int], block_size: int, blocks: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each sequence's slots over its own blocks (a block table), and the table [S, max_blocks]."""
    per_seq, table, used = [], [], 0
    nbs = [math.ceil(n / block_size) for n in lens]
    for n, nb in zip(lens, nbs, strict=True):
        b = blocks[used : used + nb]
        used += nb
        t = torch.arange(n)
        per_seq.append(b[t // block_size] * block_size + t % block_size)
        table.append(torch.nn.functional.pad(b, (0, max(nbs) - nb)))
    return per_seq, torch.stack(table).to(torch.int32)


def write_both(codec: kp.KVPageCodec, cache_cpu: torch.Tensor, cache_gpu: torch.Tensor, ovf_cpu, ovf_gpu,
               tops_gpu, k, v, slots, runs, strided: bool = False) -> None:
    """The same runs through the reference and the CUDA writer; `strided`: the CUDA writer reads K and V as views
    into wider rows (as vLLM hands them, sliced out of the qkv projection), one of them misaligned."""
    from glyd_kernels import kv_cuda

    i = 0
    for r in runs:
        codec.write(cache_cpu, ovf_cpu, k[i : i + r], v[i : i + r], slots[i : i + r])
        kg, vg = k[i : i + r].to(DEV), v[i : i + r].to(DEV)
        if strided:
            kg = torch.cat([kg, kg], dim=-1)[..., : kg.shape[-1]]
            vg = torch.cat([vg.new_zeros(vg.shape[0], vg.shape[1], 1), vg], dim=-1)[..., 1:]
        kv_cuda.write(cache_gpu, codec.layout, tops_gpu, ovf_gpu, kg, vg, slots[i : i + r].to(DEV))
        i += r


@pytest.mark.parametrize("code_bits", [3, 4])
@pytest.mark.parametrize("d,h,block,reserve,kind", [
    (128, 8, 16, 68, "model"), (64, 3, 32, 36, "model"), (128, 2, 16, 4, "patterns"), (64, 2, 16, 4, "patterns")])
def test_writer_bytes_and_reader_bits_equal_the_reference(d: int, h: int, block: int, reserve: int, kind: str,
                                                         code_bits: int) -> None:
    from glyd_kernels import kv_cuda

    g = torch.Generator().manual_seed(d + h + reserve)
    if kind == "model":
        k, v = model_like(700, h, d, g)
        tops = tops_for(k[:200], v[:200], code_bits)
    else:  # every bf16 pattern, against windows that most of them miss: the overflow path
        x = all_patterns()[torch.randperm(65536, generator=g)]
        n = 65536 // (h * d)
        k, v = x[: n * h * d].reshape(n, h, d), x.flip(0)[: n * h * d].reshape(n, h, d)
        tops = torch.randint(100, 150, (2, h, d), generator=g).to(torch.uint8)
    n = k.shape[0]
    lay = kp.KVPageLayout(d, block, reserve, code_bits)
    codec = kp.KVPageCodec(lay, tops)
    nb = math.ceil(n / block) + 3
    blocks = torch.randperm(nb, generator=g)[: math.ceil(n / block)]
    t = torch.arange(n)
    slots = blocks[t // block] * block + t % block
    tops_gpu = tops.to(DEV)
    splits = ([n], [1] * 40 + [n - 40], [13, 1, 1, 30, n - 45])
    for j, runs in enumerate(splits):
        cache_cpu = torch.randint(0, 256, (nb, h, lay.page_bytes), dtype=torch.uint8, generator=g)  # stale bytes
        cache_gpu = cache_cpu.to(DEV)
        ovf_cpu = codec.new_overflow(nb)
        ovf_gpu = kp.OverflowStore(nb * lay.tiles, h, device=DEV)
        write_both(codec, cache_cpu, cache_gpu, ovf_cpu, ovf_gpu, tops_gpu, k, v, slots, runs, strided=j == 2)
        assert torch.equal(cache_gpu.cpu(), cache_cpu), f"page bytes differ (runs {runs[:3]}...)"
        tiles = (blocks.view(-1, 1) * lay.tiles + torch.arange(lay.tiles)).reshape(-1)
        rk, rv = kv_cuda.read_tiles(cache_gpu, lay, tops_gpu, tiles.to(DEV), ovf_gpu)
        flat = lambda x: x.cpu().permute(0, 2, 1, 3).reshape(-1, h, d)[:n]  # noqa: E731
        assert torch.equal(flat(rk).view(torch.int16), k.view(torch.int16))
        assert torch.equal(flat(rv).view(torch.int16), v.view(torch.int16))
    if kind == "patterns":
        assert ovf_gpu.runs_in_use > 0


def reference_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float) -> torch.Tensor:
    out = []
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        g = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(g, dim=1)
        vv = v.double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].double(), kk) * scale
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv))
    return torch.stack(out).float()


@pytest.mark.parametrize("code_bits", [3, 4])
@pytest.mark.parametrize("d,h,group,reserve", [(128, 8, 4, 68), (64, 3, 3, 36), (128, 2, 8, 12), (64, 4, 1, 4)])
def test_decode_attention_matches_fp32_and_repeats_its_bits(d: int, h: int, group: int, reserve: int,
                                                           code_bits: int) -> None:
    from glyd_kernels import kv_cuda

    g = torch.Generator().manual_seed(7 * d + group)
    lens = [1, 15, 16, 17, 300, 1500, 4100]
    block = 16
    k, v = model_like(sum(lens), h, d, g)
    tops = tops_for(k[:300], v[:300], code_bits)
    lay = kp.KVPageLayout(d, block, reserve, code_bits)
    nb = sum(math.ceil(n / block) for n in lens) + 5
    blocks = torch.randperm(nb, generator=g)
    per_seq, table = slots_for(lens, block, blocks)
    cache = torch.randint(0, 256, (nb, h, lay.page_bytes), dtype=torch.uint8, generator=g).to(DEV)
    ovf = kp.OverflowStore(nb, h, device=DEV)
    tops_gpu = tops.to(DEV)
    ks, vs, i = [], [], 0
    for sl in per_seq:
        n = sl.numel()
        kv_cuda.write(cache, lay, tops_gpu, ovf, k[i : i + n].to(DEV), v[i : i + n].to(DEV), sl.to(DEV))
        ks.append(k[i : i + n])
        vs.append(v[i : i + n])
        i += n
    q = (torch.randn(len(lens), h * group, d, generator=g) * 2).to(torch.bfloat16)
    ref = reference_attention(q, ks, vs, d ** -0.5)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for splits in (None, 1, 3, 37, 70):  # 70: past MERGE_SPLITS, merged by kv_merge
        out = torch.full((len(lens), h * group, d), float("nan"), dtype=torch.bfloat16, device=DEV)
        kv_cuda.decode_attention(q.to(DEV), cache, lay, tops_gpu, table.to(DEV), seq_lens.to(DEV), max(lens),
                                 d ** -0.5, ovf, out=out, num_splits=splits)
        got = out.float().cpu()
        assert not torch.isnan(got).any()
        err = (got - ref).norm() / ref.norm()
        assert err < 1e-2, f"relative error {err:.2e} with {splits} splits"
        again = kv_cuda.decode_attention(q.to(DEV), cache, lay, tops_gpu, table.to(DEV), seq_lens.to(DEV), max(lens),
                                         d ** -0.5, ovf, num_splits=splits)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16))
        # the splits merged by the last block of each (sequence, KV head) and by kv_merge in a second launch: the
        # same order, the same bits; the counters are back at zero for the next launch
        merged = kv_cuda.decode_attention(q.to(DEV), cache, lay, tops_gpu, table.to(DEV), seq_lens.to(DEV),
                                          max(lens), d ** -0.5, ovf, num_splits=splits, variant=(("FUSED_MERGE", 0),))
        assert torch.equal(merged.view(torch.int16), out.view(torch.int16))
        counts = kv_cuda.split_counts(out.device, len(lens) * h)
        assert counts is not None and int(counts.count_nonzero()) == 0


@pytest.mark.parametrize("code_bits,reserve", [(3, 68), (4, 4)])
def test_decode_attention_where_escapes_carry_the_output(code_bits: int, reserve: int) -> None:
    """Escapes that decide the result: small in-window values, 1% large outliers and 0.5% zeros (patched into the
    MMA operands), and in some tiles subnormals (not exact when scaled, so those tiles take the corrections); a
    wrong patch or correction moves the output far past bf16 tolerance."""
    from glyd_kernels import kv_cuda

    d, h, group, block = 128, 2, 4, 16
    g = torch.Generator().manual_seed(11 + code_bits)
    lens = [700, 33, 2048]
    n = sum(lens)
    base = lambda: torch.randn(n, h, d, generator=g) * 2.0 ** -6  # noqa: E731
    k, v = base(), base()
    tops = tops_for(k.to(torch.bfloat16), v.to(torch.bfloat16), code_bits)  # windows around the small values
    for x in (k, v):
        u = torch.rand(n, h, d, generator=g)
        x[u < 0.01] = torch.randn(int((u < 0.01).sum()), generator=g) * 4.0
        x[(u >= 0.01) & (u < 0.015)] = 0.0
        sub = (u >= 0.015) & (u < 0.0152) & (torch.arange(n).view(n, 1, 1) % 160 < 16)  # a tile in ten
        x[sub] = 1e-39
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    lay = kp.KVPageLayout(d, block, reserve, code_bits)
    nb = sum(math.ceil(x / block) for x in lens)
    per_seq, table = slots_for(lens, block, torch.randperm(nb, generator=g))
    cache = torch.zeros(nb, h, lay.page_bytes, dtype=torch.uint8, device=DEV)
    ovf = kp.OverflowStore(nb, h, device=DEV)
    tops_gpu = tops.to(DEV)
    ks, vs, i = [], [], 0
    for sl in per_seq:
        m = sl.numel()
        kv_cuda.write(cache, lay, tops_gpu, ovf, k[i : i + m].to(DEV), v[i : i + m].to(DEV), sl.to(DEV))
        ks.append(k[i : i + m])
        vs.append(v[i : i + m])
        i += m
    q = torch.randn(len(lens), h * group, d, generator=g).to(torch.bfloat16)
    ref = reference_attention(q, ks, vs, d ** -0.5)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for splits in (None, 1):
        out = kv_cuda.decode_attention(q.to(DEV), cache, lay, tops_gpu, table.to(DEV), seq_lens, max(lens), d ** -0.5,
                                       ovf, num_splits=splits)
        err = float((out.float().cpu() - ref).norm() / ref.norm())
        assert err < 1e-2, f"relative error {err:.2e} with {splits} splits"
        again = kv_cuda.decode_attention(q.to(DEV), cache, lay, tops_gpu, table.to(DEV), seq_lens, max(lens),
                                         d ** -0.5, ovf, num_splits=splits)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16))


def decode_steps(seqs: int, steps: int, block: int, blocks: torch.Tensor) -> list[torch.Tensor]:
    """Each step's slots: a token for each sequence, the sequences' blocks taken in turn from `blocks`."""
    per_seq = math.ceil(steps / block)
    return [blocks[torch.arange(seqs) * per_seq + s // block] * block + s % block for s in range(steps)]


def test_decode_steps_wait_for_the_device_only_when_the_arena_fills() -> None:
    """Model-like values into a short list (most tiles overflow): the first write sizes the arena, and later steps
    wait only the few times the live runs outgrow it (compaction into a larger one), never step by step."""
    from glyd_kernels import kv_cuda, kv_overflow

    d, h, block, seqs, steps = 128, 8, 16, 64, 48
    g = torch.Generator().manual_seed(3)
    k0, v0 = model_like(256, h, d, g)
    tops = tops_for(k0, v0, 3).to(DEV)
    lay = kp.KVPageLayout(d, block, 4, 3)  # a short list: some tiles overflow
    nb = seqs * math.ceil(steps / block)
    cache = torch.zeros(nb, h, lay.page_bytes, dtype=torch.uint8, device=DEV)
    ovf = kp.OverflowStore(nb * lay.tiles, h, device=DEV)
    ks, vs, slots = [], [], decode_steps(seqs, steps, block, torch.randperm(nb, generator=g))
    for sl in slots:
        k, v = model_like(seqs, h, d, g)
        kv_cuda.write(cache, lay, tops, ovf, k.to(DEV), v.to(DEV), sl.to(DEV))
        ks.append(k), vs.append(v)
    runs = kv_overflow.device_runs(ovf, d)
    assert 1 <= runs.checked <= steps // 8 and ovf.runs_in_use > 0
    check_tokens(cache, lay, tops, ovf, torch.cat(slots), torch.cat(ks), torch.cat(vs))


def test_decode_steps_write_into_the_arena_reserved_before_the_cache() -> None:
    """The engine's first arena and run-pointer memory (taken before vLLM profiles memory) take decode steps' runs
    where they are: a layer that adopted them writes its first step's overflow there without a compaction and its
    pointers into the reserve's first entries (the rest untouched), later steps move the arena only as the live runs
    ask (arena_target), and every value reads back."""
    from glyd_kernels import kv_overflow
    from glyd_kernels.kv_layer import KVLayer

    d, h, block, seqs, steps = 128, 8, 16, 64, 32
    g = torch.Generator().manual_seed(4)
    k0, v0 = model_like(256, h, d, g)
    lay = kp.KVPageLayout(d, block, 4, 3)  # a short list: some tiles overflow
    nb = seqs * math.ceil(steps / block)
    arena = kv_overflow.reserve_arena(h, d, torch.device(DEV))
    need = nb * lay.tiles * h * 2
    pointers = kv_overflow.reserve_pointers(need + 64, torch.device(DEV))
    pointers[need:] = 7
    layer = KVLayer(lay, tops_for(k0, v0, 3), torch.zeros(nb, h, lay.page_bytes, dtype=torch.uint8, device=DEV),
                    arena=arena, pointers=pointers)
    assert layer.overflow.ptr.data_ptr() == pointers.data_ptr()
    ks, vs, slots = [], [], decode_steps(seqs, steps, block, torch.randperm(nb, generator=g))
    for i, sl in enumerate(slots):
        k, v = model_like(seqs, h, d, g)
        layer.reserve(seqs)
        layer.write(k.to(DEV), v.to(DEV), sl.to(DEV))
        ks.append(k), vs.append(v)
        if i == 0:
            torch.cuda.synchronize()
            assert layer.overflow.arena.data_ptr() == arena.data_ptr() and layer.overflow.grows == 0
            assert int(kv_overflow.device_runs(layer.overflow, d).counters[0]) > 0  # runs taken in it
    check_tokens(layer.pages, lay, layer.tops, layer.overflow, torch.cat(slots), torch.cat(ks), torch.cat(vs))
    assert pointers[need:].tolist() == [7] * 64 and int((pointers[:need] >= 0).sum()) == layer.overflow.runs_in_use > 0


def check_tokens(cache, lay, tops, ovf, slots, k, v) -> None:
    """Every token at `slots` reads back as k, v [N, H, D], bit for bit."""
    from glyd_kernels import kv_cuda

    tiles = torch.unique(slots // kp.TILE)
    rk, rv = kv_cuda.read_tiles(cache, lay, tops, tiles.to(DEV), ovf)
    pos = torch.searchsorted(tiles, slots // kp.TILE)
    assert torch.equal(rk.cpu()[pos, :, slots % kp.TILE].view(torch.int16), k.view(torch.int16))
    assert torch.equal(rv.cpu()[pos, :, slots % kp.TILE].view(torch.int16), v.view(torch.int16))


@pytest.mark.parametrize("code_bits", [3, 4])
def test_overflow_runs_taken_on_the_device_lose_nothing(code_bits: int) -> None:
    """Values that mostly miss their windows, into an arena with no room at first: a long prefill that finds no room
    runs again for those tiles, then decode steps (a token for each of 24 sequences) take and double runs on the
    device while the arena is compacted and grown as the host's bound requires. The bound stays above the device's
    top after every write; pages equal the reference writer's; every value reads back bit for bit."""
    from glyd_kernels import kv_cuda, kv_overflow

    d, h, block, reserve = 64, 2, 16, 4
    g = torch.Generator().manual_seed(5 + code_bits)
    lay = kp.KVPageLayout(d, block, reserve, code_bits)
    codec = kp.KVPageCodec(lay, torch.randint(110, 140, (2, h, d), generator=g).to(torch.uint8))
    seqs, steps, prefill = 24, 40, 4096
    nb = seqs * math.ceil(steps / block) + prefill // block
    cache_cpu = torch.zeros(nb, h, lay.page_bytes, dtype=torch.uint8)
    cache_gpu = cache_cpu.to(DEV)
    ovf_cpu, ovf_gpu = codec.new_overflow(nb), kp.OverflowStore(nb * lay.tiles, h, device=DEV)
    tops_gpu = codec.tops.to(DEV)
    wild = lambda n: (torch.randn(n, h, d, generator=g) * torch.exp2(torch.randint(-40, 40, (n, h, d), generator=g)  # noqa: E731
                                                                     .float())).to(torch.bfloat16)
    blocks = torch.randperm(nb, generator=g)
    pb = blocks[seqs * math.ceil(steps / block) :]
    t = torch.arange(prefill)
    sl = pb[t // block] * block + t % block
    k, v = wild(prefill), wild(prefill)
    codec.write(cache_cpu, ovf_cpu, k, v, sl)
    # the arena's first size keeps room for decode steps, not for a prefill this long: it runs again
    assert kv_cuda.write(cache_gpu, lay, tops_gpu, ovf_gpu, k.to(DEV), v.to(DEV), sl.to(DEV)) >= 1
    runs = kv_overflow.device_runs(ovf_gpu, d)
    ks, vs, all_slots = [k], [v], [sl]
    for sl in decode_steps(seqs, steps, block, blocks):
        k, v = wild(seqs), wild(seqs)
        codec.write(cache_cpu, ovf_cpu, k, v, sl)
        kv_cuda.write(cache_gpu, lay, tops_gpu, ovf_gpu, k.to(DEV), v.to(DEV), sl.to(DEV))
        top = int(runs.counters[0]) * kp.OVERFLOW_MIN_RUN
        assert top <= runs.bound <= runs.capacity, (top, runs.bound, runs.capacity)
        ks.append(k), vs.append(v), all_slots.append(sl)
    assert runs.checked < steps // 2, runs.checked  # most decode steps ran unchecked
    assert ovf_gpu.compactions >= 2 and ovf_gpu.grows >= 1 and int(runs.counters[1]) == 0
    assert torch.equal(cache_gpu.cpu(), cache_cpu)
    check_tokens(cache_gpu, lay, tops_gpu, ovf_gpu, torch.cat(all_slots), torch.cat(ks), torch.cat(vs))


def test_decode_steps_replayed_from_a_cuda_graph_equal_eager_steps() -> None:
    """A decode step (page write + decode attention, as vLLM's full graph holds them) captured once and replayed for
    40 steps: sequences of different lengths under a split count fixed for 4,096 tokens, room reserved before each
    replay, values that mostly escape into overflow runs, and the arena compacted into a new one between replays
    (forced twice, and as the runs grow). Pages and outputs equal a layer stepped eagerly with the same split count,
    bit for bit; outputs are within bf16 tolerance of fp32; every value reads back; no write found no room."""
    from glyd_kernels import kv_overflow
    from glyd_kernels.kv_layer import KVLayer

    d, h, group, block, seqs, steps, split_len = 128, 2, 4, 16, 32, 40, 4096
    g = torch.Generator().manual_seed(13)
    lay = kp.KVPageLayout(d, block, 4, 3)  # a short list: most tiles take overflow runs
    tops = torch.randint(110, 140, (2, h, d), generator=g).to(torch.uint8)
    wild = lambda n: (torch.randn(n, h, d, generator=g) * torch.exp2(torch.randint(-40, 40, (n, h, d), generator=g)  # noqa: E731
                                                                     .float())).to(torch.bfloat16)
    starts = torch.randint(0, 300, (seqs,), generator=g)
    per = math.ceil((300 + steps) / block)
    table = torch.randperm(seqs * per, generator=g).view(seqs, per)
    slot = lambda s, pos: table[s, pos // block] * block + pos % block  # noqa: E731
    graphed, eager = (KVLayer(lay, tops, torch.zeros(seqs * per, h, lay.page_bytes, dtype=torch.uint8, device=DEV))
                      for _ in range(2))
    ks, vs = [[] for _ in range(seqs)], [[] for _ in range(seqs)]
    for s in range(seqs):
        n = int(starts[s])
        if n:
            k, v = wild(n), wild(n)
            for layer in (graphed, eager):
                layer.write(k.to(DEV), v.to(DEV), slot(s, torch.arange(n)).to(DEV))
            ks[s].append(k), vs[s].append(v)
    kb = torch.zeros(seqs, h, d, dtype=torch.bfloat16, device=DEV)
    vb, qb = torch.zeros_like(kb), torch.zeros(seqs, h * group, d, dtype=torch.bfloat16, device=DEV)
    sb, lb = torch.zeros(seqs, dtype=torch.int64, device=DEV), torch.zeros(seqs, dtype=torch.int32, device=DEV)
    tb, qsl = table.to(torch.int32).to(DEV), torch.arange(seqs + 1, dtype=torch.int32, device=DEV)
    out_g, out_e = torch.zeros_like(qb), torch.zeros_like(qb)
    all_slots = [slot(s, torch.arange(int(starts[s]))) for s in range(seqs)]

    def inputs(step: int) -> torch.Tensor:
        k, v, q = wild(seqs), wild(seqs), (torch.randn(seqs, h * group, d, generator=g) * 2).to(torch.bfloat16)
        sl = slot(torch.arange(seqs), starts + step)
        kb.copy_(k), vb.copy_(v), qb.copy_(q), sb.copy_(sl), lb.copy_((starts + step + 1).to(torch.int32))
        for s in range(seqs):
            ks[s].append(k[s : s + 1]), vs[s].append(v[s : s + 1])
        all_slots.append(sl)
        return q

    def step(layer: KVLayer, out: torch.Tensor) -> None:
        layer.write(kb, vb, sb)
        layer.attend(qb, out, tb, lb, qsl, split_len, d ** -0.5, seqs)

    inputs(0)
    step(graphed, out_g), step(eager, out_e)  # kernels loaded, arenas sized outside the capture
    runs = kv_overflow.device_runs(graphed.overflow, d)
    graph = torch.cuda.CUDAGraph()
    graphed.reserve(seqs)
    with torch.cuda.graph(graph):
        step(graphed, out_g)
    grows = graphed.overflow.grows
    for i in range(1, steps):
        q = inputs(i)
        if i in (5, 20):  # the arena moves between replays
            runs.wait()
            where = graphed.overflow.arena.data_ptr()
            runs.make_room(0, extra=runs.capacity)
            assert graphed.overflow.arena.data_ptr() != where
        graphed.reserve(seqs)
        graph.replay()
        step(eager, out_e)
        assert torch.equal(out_g.view(torch.int16), out_e.view(torch.int16)), f"step {i}"
        top = int(runs.counters[0]) * kp.OVERFLOW_MIN_RUN
        assert top <= runs.bound <= runs.capacity and int(runs.counters[1]) == 0, (i, top, runs.bound)
    assert graphed.overflow.grows >= grows + 2, (graphed.overflow.grows, grows)
    assert torch.equal(graphed.pages, eager.pages)
    ref = reference_attention(q, [torch.cat(x) for x in ks], [torch.cat(x) for x in vs], d ** -0.5)
    err = float((out_g.float().cpu() - ref).norm() / ref.norm())
    assert err < 1e-2, err
    slots = torch.cat(all_slots)
    k_all = torch.cat([torch.cat(x) for x in ks])
    order = torch.cat([slot(s, torch.arange(int(starts[s]) + steps)) for s in range(seqs)])
    pos = {int(x): i for i, x in enumerate(order)}
    idx = torch.tensor([pos[int(x)] for x in slots])
    v_all = torch.cat([torch.cat(x) for x in vs])
    check_tokens(graphed.pages, lay, graphed.tops, graphed.overflow, slots, k_all[idx], v_all[idx])


def test_a_store_ignores_the_bank_snapshot_taken_before_it_had_its_slot() -> None:
    """The counter bank copies every store's counters in one go. A store made while a copy is in flight (in a dead
    store's slot or a new one) must not take that copy's value for its slot (a dead store's, or zeros) as its top:
    its bound stays above its real top."""
    import gc

    from glyd_kernels import kv_overflow

    d, h = 64, 2
    dead = kp.OverflowStore(4, h, device=DEV)
    runs = kv_overflow.device_runs(dead, d)
    torch.cuda._sleep(1 << 26)  # the bank's copy below lands only after this
    runs.bank.land()
    runs.bank.snapshot()  # a copy of the bank in flight
    runs.launched_unchecked(1)
    del runs, dead
    gc.collect()
    store = kp.OverflowStore(64, h, device=DEV)
    store.reserve_entries(torch.arange(64, device=DEV), torch.zeros(64, dtype=torch.int64, device=DEV), 0,
                          torch.full((64,), 200, device=DEV))
    fresh = kv_overflow.device_runs(store, d)
    assert fresh.bound == store._top > 0
    fresh.launched_unchecked(1)  # counted against the copy in flight, which predates the slot's new values
    torch.cuda.synchronize()
    fresh.refresh()
    assert fresh.bank.event is None and fresh.bound >= store._top


def test_a_reserved_write_counts_after_a_bank_copy_taken_before_it_runs() -> None:
    """The builder reserves a step's write before the step; another store may copy the bank back before that write
    runs. The copy must count the reserved write as coming after it: the store's bound stays above its top once the
    write has run and the copy has landed."""
    from glyd_kernels import kv_cuda, kv_overflow

    d, h, block, n = 64, 2, 16, 64
    g = torch.Generator().manual_seed(17)
    lay = kp.KVPageLayout(d, block, 4, 3)  # a short list: the writes take overflow runs
    tops = torch.randint(110, 140, (2, h, d), generator=g).to(torch.uint8).to(DEV)
    wild = lambda: (torch.randn(n, h, d, generator=g) * torch.exp2(torch.randint(-40, 40, (n, h, d), generator=g)  # noqa: E731
                                                                   .float())).to(torch.bfloat16).to(DEV)
    stores = [(torch.zeros(2 * n // block, h, lay.page_bytes, dtype=torch.uint8, device=DEV),
               kp.OverflowStore(2 * n // block, h, device=DEV)) for _ in range(2)]
    first, second = torch.arange(n, device=DEV), torch.arange(n, 2 * n, device=DEV)
    for cache, ovf in stores:
        kv_cuda.write(cache, lay, tops, ovf, wild(), wild(), first)
    (cache_x, ovf_x), (_, ovf_y) = stores
    rx, ry = kv_overflow.device_runs(ovf_x, d), kv_overflow.device_runs(ovf_y, d)
    torch.cuda.synchronize()
    rx.reserve(n)  # the builder's reservation for x's next write
    torch.cuda.synchronize()
    ry.refresh()  # whatever copy was in flight has landed
    assert ry.bank.event is None
    ry.bank.snapshot()  # another store's copy, after the reservation and before x's write
    torch.cuda.synchronize()
    ry.refresh()
    top_before = int(rx.counters[0])
    kv_cuda.write(cache_x, lay, tops, ovf_x, wild(), wild(), second)  # takes the reservation: no count, no check
    torch.cuda.synchronize()
    rx.refresh()
    top = int(rx.counters[0]) * kp.OVERFLOW_MIN_RUN
    assert int(rx.counters[0]) > top_before and top <= rx.bound <= rx.capacity, (top, rx.bound)
    assert int(rx.counters[1]) == 0


def test_a_reservation_stays_counted_when_the_host_waits_for_the_top() -> None:
    """A wait replaces the bound with the device's exact top; a write reserved before it and not yet launched runs
    after that top, so it stays counted: the bound covers the top once it has run."""
    from glyd_kernels import kv_cuda, kv_overflow

    d, h, block, n = 64, 2, 16, 64
    g = torch.Generator().manual_seed(23)
    lay = kp.KVPageLayout(d, block, 4, 3)
    tops = torch.randint(110, 140, (2, h, d), generator=g).to(torch.uint8).to(DEV)
    wild = lambda: (torch.randn(n, h, d, generator=g) * torch.exp2(torch.randint(-40, 40, (n, h, d), generator=g)  # noqa: E731
                                                                   .float())).to(torch.bfloat16).to(DEV)
    cache = torch.zeros(2 * n // block, h, lay.page_bytes, dtype=torch.uint8, device=DEV)
    ovf = kp.OverflowStore(2 * n // block, h, device=DEV)
    kv_cuda.write(cache, lay, tops, ovf, wild(), wild(), torch.arange(n, device=DEV))
    runs = kv_overflow.device_runs(ovf, d)
    runs.reserve(n)
    runs.wait()  # e.g. another write's check between the reservation and its write
    kv_cuda.write(cache, lay, tops, ovf, wild(), wild(), torch.arange(n, 2 * n, device=DEV))  # takes it
    torch.cuda.synchronize()
    runs.refresh()
    top = int(runs.counters[0]) * kp.OVERFLOW_MIN_RUN
    assert top <= runs.bound, (top, runs.bound)


@pytest.mark.parametrize("limit", ["range", "memory"])
def test_an_arena_that_cannot_grow_leaves_no_misses_behind(monkeypatch: pytest.MonkeyPatch, limit: str) -> None:
    """When the arena cannot grow (past its address range, or the GPU is full), the error says why and what to do, and
    the misses of the write that asked are that failure's: the next snapshot must not report them as a wrong bound
    (ArenaFullError)."""
    from glyd_kernels import kv_overflow

    ovf = kp.OverflowStore(4, 2, device=DEV)
    runs = kv_overflow.device_runs(ovf, 64)
    runs.counters[1] = 3  # tiles of a checked write that found no room
    if limit == "range":
        monkeypatch.setattr(kv_overflow, "MAX_UNITS", 1)
    else:
        def full(capacity: int) -> int:
            raise torch.OutOfMemoryError("CUDA out of memory")
        monkeypatch.setattr(ovf, "compact", full)
    why = "overflow arena would pass" if limit == "range" else "Lower gpu_memory_utilization"
    with pytest.raises(MemoryError, match=why):
        runs.make_room(256, extra=1 << 20)
    assert int(runs.counters[1]) == 0
    runs.wait()  # no ArenaFullError


def test_a_limited_arena_stores_every_tile_that_fits_and_names_the_slots_that_do_not() -> None:
    """The CUDA writer under an arena limit of 16,384 entries: ordinary values are stored whole; then values that
    mostly miss their windows, in one write: it raises OverflowRoomError naming the slots it could not store
    (`kv_page.write_by_block` hands them back), every block without one reads back bit for bit, the device's counters
    hold no misses. With the refused blocks' runs given back (as the engine's scheduler does), the next ordinary
    write is stored whole."""
    from glyd_kernels import kv_cuda, kv_overflow

    d, h, block, reserve, limit = 64, 2, 16, 4, 16384
    g = torch.Generator().manual_seed(11)
    lay = kp.KVPageLayout(d, block, reserve, 4)
    plain_k, plain_v = model_like(512, h, d, g)
    tops = tops_for(plain_k, plain_v, 4).to(DEV)
    wild = (torch.randn(2048, h, d, generator=g) * torch.exp2(torch.randint(-40, 40, (2048, h, d), generator=g)
                                                                .float())).to(torch.bfloat16)
    nb = (512 + 2048 + 64) // block
    cache = torch.zeros(nb, h, lay.page_bytes, dtype=torch.uint8, device=DEV)
    ovf = kp.OverflowStore(nb * lay.tiles, h, device=DEV, limit=limit)
    ovf.adopt(torch.zeros(limit, dtype=torch.int16, device=DEV))
    write = lambda k, v, s: kv_cuda.write(cache, lay, tops, ovf, k.to(DEV), v.to(DEV), s.to(DEV))  # noqa: E731
    first = torch.arange(512)
    assert kp.write_by_block(write, plain_k, plain_v, first, block).numel() == 0
    wild_slots = torch.arange(512, 512 + 2048)
    lost = kp.write_by_block(write, wild, wild.flip(0), wild_slots, block).cpu()
    assert lost.numel() > 0 and bool(((lost >= 512) & (lost < 512 + 2048)).all()), lost[:8]
    assert ovf.arena.numel() <= limit and int(kv_overflow.device_runs(ovf, d).counters[1]) == 0
    kept = ~torch.isin(wild_slots // block, lost // block)  # the engine refuses whole blocks
    check_tokens(cache, lay, tops, ovf, first, plain_k, plain_v)
    if bool(kept.any()):
        check_tokens(cache, lay, tops, ovf, wild_slots[kept], wild[kept], wild.flip(0)[kept])
    refused = torch.unique(lost // block)
    ovf.release((refused.view(-1, 1) * lay.tiles + torch.arange(lay.tiles)).reshape(-1).to(DEV))
    more_k, more_v = model_like(64, h, d, g)
    more = torch.arange(512 + 2048, 512 + 2048 + 64)
    assert kp.write_by_block(write, more_k, more_v, more, block).numel() == 0
    check_tokens(cache, lay, tops, ovf, more, more_k, more_v)
    check_tokens(cache, lay, tops, ovf, first, plain_k, plain_v)
