"""The GPU path of the KV backend (`kernels.kv_layer.TritonKVLayer`) driven step by step as vLLM drives it.

Under TRITON_INTERPRET=1 on the CPU: a mixed prefill step, a decode step, a step mixing a prefill chunk with a
decode token, and a decode step again, over blocks handed out out of order; once with the number of leading decodes
given (the mixed step split between the two kernels, as the backend runs it), once without. After every step the
pages, read back through the attention kernels' decoder, hold every value written bit for bit (the overflow path
included), and the step's attention output (poisoned with NaN first) is within bf16 tolerance of fp32. With
GLYD_TEST_DEVICE=cuda and TRITON_INTERPRET=0 the same test runs natively on a GPU (bench/gpu.py's device runs do),
at the small shape and at Qwen3-8B's head shape, so the inline-asm paths run too.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernel_helpers import layout, make_kv, tables_from  # noqa: E402

from kernels.kv_layer import TritonKVLayer  # noqa: E402
from kernels.kv_prefill_attention import reference_prefill_attention  # noqa: E402

DEV = os.environ.get("GLYD_TEST_DEVICE", "cpu")
# (KV heads, query heads a KV head, D, whether the caller says how many decodes lead the batch, whether it
# passes the step's own K/V as the backend does)
SHAPES = [(2, 2, 64, True, True), (2, 2, 64, False, False)] + ([(8, 4, 128, True, True)] if DEV != "cpu" else [])


@pytest.mark.parametrize("H,G,D,split,fresh", SHAPES)
def test_layer_steps_like_vllm_and_reads_back_every_value(H: int, G: int, D: int, split: bool, fresh: bool) -> None:
    g = torch.Generator().manual_seed(5)
    B, nb = 16, 9
    lay = layout(D, B, 1, 1)  # a small reserve: pages overflow
    k_all, v_all = make_kv(120, H, D, g, spread=1.5)
    dec = tables_from(k_all[:16], v_all[:16])
    k_all, v_all = k_all.to(DEV), v_all.to(DEV)
    pages = torch.randint(0, 256, (nb, H, lay.page_bytes), dtype=torch.uint8, generator=g)  # unzeroed, as vLLM's
    layer = TritonKVLayer(lay, dec, pages.to(DEV))
    block_table = torch.tensor([[6, 2, 8, 0], [1, 7, 3, 0]], dtype=torch.int32, device=DEV)
    scale = D ** -0.5
    # (tokens each sequence adds this step); both sequences start empty
    steps = [(20, 18), (1, 1), (1, 5), (1, 1)]
    written: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    lens = [0, 0]
    used = 0
    for n0, n1 in steps:
        qs, ks, vs, slots, starts = [], [], [], [], [0]
        for s, n in enumerate((n0, n1)):
            k, v = k_all[used : used + n], v_all[used : used + n]
            used += n
            pos = torch.arange(lens[s], lens[s] + n, device=DEV)
            slots.append(block_table[s, pos // B].long() * B + pos % B)
            written[s].append((k, v))
            lens[s] += n
            qs.append(torch.randn(n, H * G, D, generator=g).to(torch.bfloat16).to(DEV))
            ks.append(k)
            vs.append(v)
            starts.append(starts[-1] + n)
        step_k, step_v = torch.cat(ks), torch.cat(vs)
        layer.write(step_k, step_v, torch.cat(slots))
        query = torch.cat(qs)
        out = torch.full_like(query, float("nan"))
        qsl = torch.tensor(starts, dtype=torch.int32, device=DEV)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        decodes = (1 if n0 == 1 else 0) + (1 if n0 == n1 == 1 else 0)  # leading one-token sequences
        own = {"key": step_k, "value": step_v} if fresh else {}
        layer.attend(query, out, block_table, seq_lens, qsl, max(n0, n1), max(lens), scale,
                     decodes if split else None, **own)
        keys = [torch.cat([k for k, _ in w]) for w in written]
        values = [torch.cat([v for _, v in w]) for w in written]
        ref = reference_prefill_attention(query, qsl, keys, values, scale)
        assert not out.isnan().any()
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < 1e-2, (n0, n1, err)
        for s in (0, 1):
            blocks = block_table[s, : (lens[s] + B - 1) // B]
            k_read, v_read = layer.read(blocks)  # [N, H, B, D]
            for got, want in ((k_read, keys[s]), (v_read, values[s])):
                flat = got.permute(0, 2, 1, 3).reshape(-1, H, D)[: lens[s]]
                assert torch.equal(flat.view(torch.int16), want.view(torch.int16)), (s, lens[s])
    assert layer.overflow.values_written > 0, "the test must exercise the overflow path"
    assert layer.writer.counters.calls == len(steps)
