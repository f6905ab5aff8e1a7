"""Decode-only speed of candidate KV page layouts (docs/gpu-layout-probe.md).

Each kernel reads pages of B=16 tokens x D=128 channels (one tensor, one KV head), decodes every value to
bf16 bits and adds them into a per-program int32 accumulator (nothing bf16 is written). Layouts:

  a  current format: sm [B,D] | 3 bit planes [B,3,D/8] | escapes [B*E] by page prefix count (code 7)
  b  as a, no escape handling (code 7 looked up like the others): upper bound of a
  c  sm [B,D] | 4-bit nibble codes [B,D/2] | row escape starts [B] | escapes [B*E] (code 15)
  d  byte-aligned: per 8 channels 8 sm bytes + 4 nibble-code bytes; row escape starts [B] | escapes [B*E]
  n  as c, no escape handling (code 15 looked up like the others): upper bound of c
  e  plain bf16 [B,D] (reference ceiling)

Tiles are [B, D/4] 32-bit words (4 channels a word); tables sit in registers (prmt lookup). Synthetic
data: 2.5% escapes, at most B*E = 64 a page (the few past the reserve are dropped, not overflowed).

GPU:  PYTHONUNBUFFERED=1 python3 bench/layout_probe.py --out $OUT
CPU:  TRITON_INTERPRET=1 .venv/bin/python bench/layout_probe.py --pages 64 --check-only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

B, D, W = 16, 128, 32  # tokens a page, channels, 32-bit words a row (4 channels a word)
ESC = 64  # escape bytes a page (E = 4 a token)
PAGE_BYTES = {"a": 2048 + 768 + ESC, "b": 2048 + 768 + ESC, "c": 2048 + 1024 + 16 + ESC,
              "d": 3072 + 16 + ESC, "n": 2048 + 1024 + 16 + ESC, "e": 4096}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _lut8(lo, hi, code, ASM: tl.constexpr):
    if ASM:
        e = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, code],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        e = tl.where(code < 4, lo, hi) >> ((code & 3) * 8)
    return e & 0xFF


@triton.jit
def _lut16(t0, t1, t2, t3, code, ASM: tl.constexpr):
    if ASM:
        e = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b, s; .reg .pred p; and.b32 s, $5, 7; prmt.b32 a, $1, $2, s; "
            "prmt.b32 b, $3, $4, s; setp.gt.u32 p, $5, 7; selp.b32 $0, b, a, p; }",
            "=r,r,r,r,r,r", [t0, t1, t2, t3, code], dtype=tl.int32, is_pure=True, pack=1)
    else:
        e = tl.where(code < 8, tl.where(code < 4, t0, t1), tl.where(code < 12, t2, t3)) >> ((code & 3) * 8)
    return e & 0xFF


@triton.jit
def _bf16(sm, e):
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


@triton.jit
def _emit(acc, out_ptr, page, r, w, v0, v1, v2, v3, WRITE: tl.constexpr):
    if WRITE:
        o = out_ptr + page * 2048 + r * 128 + w * 4
        tl.store(o, v0)
        tl.store(o + 1, v1)
        tl.store(o + 2, v2)
        tl.store(o + 3, v3)
    return acc + (v0 + v1 + v2 + v3)


@triton.jit
def _tables(tbl_ptr, r, w, j: tl.constexpr, N: tl.constexpr):
    """Words 0..N-1 of channel 4w+j's 16-byte table, as [B, W] tiles (loaded once a program)."""
    base = tbl_ptr + (w * 4 + j) * 4 + r * 0
    if N == 2:
        return tl.load(base), tl.load(base + 1), tl.load(base), tl.load(base)
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)


@triton.jit
def k_planes(buf_ptr, tbl_ptr, out_ptr, acc_ptr, PPP: tl.constexpr, ESCAPES: tl.constexpr,
             WRITE: tl.constexpr, ASM: tl.constexpr):
    """Layouts a (ESCAPES) and b: sm | 3 bit planes | escapes by page prefix count."""
    PB: tl.constexpr = 2048 + 768 + 64
    pid = tl.program_id(0)
    r = tl.arange(0, 16)[:, None]
    w = tl.arange(0, 32)[None, :]
    lo0, hi0, _, _ = _tables(tbl_ptr, r, w, 0, 2)
    lo1, hi1, _, _ = _tables(tbl_ptr, r, w, 1, 2)
    lo2, hi2, _, _ = _tables(tbl_ptr, r, w, 2, 2)
    lo3, hi3, _, _ = _tables(tbl_ptr, r, w, 3, 2)
    acc = tl.zeros((16, 32), tl.int32)
    for i in range(PPP):
        page = (pid * PPP + i).to(tl.int64)
        pb = buf_ptr + page * PB
        smw = tl.load(pb.to(tl.pointer_type(tl.int32), bitcast=True) + r * 32 + w)
        cb = pb + 2048 + r * 48 + w // 2
        sh = (w & 1) * 4
        n0 = (tl.load(cb).to(tl.int32) >> sh) & 0xF
        n1 = (tl.load(cb + 16).to(tl.int32) >> sh) & 0xF
        n2 = (tl.load(cb + 32).to(tl.int32) >> sh) & 0xF
        c0 = (n0 & 1) | ((n1 & 1) << 1) | ((n2 & 1) << 2)
        c1 = ((n0 >> 1) & 1) | (n1 & 2) | ((n2 & 2) << 1)
        c2 = ((n0 >> 2) & 1) | ((n1 >> 1) & 2) | (n2 & 4)
        c3 = ((n0 >> 3) & 1) | ((n1 >> 2) & 2) | ((n2 >> 1) & 4)
        e0 = _lut8(lo0, hi0, c0, ASM)
        e1 = _lut8(lo1, hi1, c1, ASM)
        e2 = _lut8(lo2, hi2, c2, ASM)
        e3 = _lut8(lo3, hi3, c3, ASM)
        if ESCAPES:
            f0 = (c0 == 7).to(tl.int32)
            f1 = (c1 == 7).to(tl.int32)
            f2 = (c2 == 7).to(tl.int32)
            f3 = (c3 == 7).to(tl.int32)
            cnt = f0 + f1 + f2 + f3
            rowtot = tl.sum(cnt, axis=1)
            rowstart = tl.cumsum(rowtot, axis=0) - rowtot
            rk = rowstart[:, None] + tl.cumsum(cnt, axis=1) - cnt
            eb = pb + 2816 + rk
            e0 = tl.where(f0 != 0, tl.load(eb, mask=f0 != 0, other=0).to(tl.int32), e0)
            e1 = tl.where(f1 != 0, tl.load(eb + f0, mask=f1 != 0, other=0).to(tl.int32), e1)
            e2 = tl.where(f2 != 0, tl.load(eb + f0 + f1, mask=f2 != 0, other=0).to(tl.int32), e2)
            e3 = tl.where(f3 != 0, tl.load(eb + f0 + f1 + f2, mask=f3 != 0, other=0).to(tl.int32), e3)
        acc = _emit(acc, out_ptr, page, r, w, _bf16(smw & 0xFF, e0), _bf16((smw >> 8) & 0xFF, e1),
                    _bf16((smw >> 16) & 0xFF, e2), _bf16((smw >> 24) & 0xFF, e3), WRITE)
    tl.store(acc_ptr + pid, tl.sum(acc))


@triton.jit
def k_nibbles(buf_ptr, tbl_ptr, out_ptr, acc_ptr, PPP: tl.constexpr, INTERLEAVED: tl.constexpr,
              ESCAPES: tl.constexpr, WRITE: tl.constexpr, ASM: tl.constexpr):
    """Layouts c (sections) and d (INTERLEAVED per 8 channels): 4-bit codes, per-row escape starts."""
    PB: tl.constexpr = 3072 + 16 + 64
    pid = tl.program_id(0)
    r = tl.arange(0, 16)[:, None]
    w = tl.arange(0, 32)[None, :]
    a0, b0, g0, h0 = _tables(tbl_ptr, r, w, 0, 4)
    a1, b1, g1, h1 = _tables(tbl_ptr, r, w, 1, 4)
    a2, b2, g2, h2 = _tables(tbl_ptr, r, w, 2, 4)
    a3, b3, g3, h3 = _tables(tbl_ptr, r, w, 3, 4)
    acc = tl.zeros((16, 32), tl.int32)
    for i in range(PPP):
        page = (pid * PPP + i).to(tl.int64)
        pb = buf_ptr + page * PB
        if INTERLEAVED:  # offsets in 4-byte / 2-byte units: a 12-byte group holds 2 sm words + 2 code halves
            sm_off = r * 48 + (w // 2) * 3 + (w & 1)
            cd_off = r * 96 + (w // 2) * 6 + 4 + (w & 1)
        else:
            sm_off = r * 32 + w
            cd_off = 1024 + r * 32 + w
        smw = tl.load(pb.to(tl.pointer_type(tl.int32), bitcast=True) + sm_off)
        cw = tl.load(pb.to(tl.pointer_type(tl.int16), bitcast=True) + cd_off).to(tl.int32)
        c0 = cw & 0xF
        c1 = (cw >> 4) & 0xF
        c2 = (cw >> 8) & 0xF
        c3 = (cw >> 12) & 0xF
        e0 = _lut16(a0, b0, g0, h0, c0, ASM)
        e1 = _lut16(a1, b1, g1, h1, c1, ASM)
        e2 = _lut16(a2, b2, g2, h2, c2, ASM)
        e3 = _lut16(a3, b3, g3, h3, c3, ASM)
        if ESCAPES:
            f0 = (c0 == 15).to(tl.int32)
            f1 = (c1 == 15).to(tl.int32)
            f2 = (c2 == 15).to(tl.int32)
            f3 = (c3 == 15).to(tl.int32)
            cnt = f0 + f1 + f2 + f3
            rs = tl.load(pb + 3072 + r + w * 0).to(tl.int32)
            rk = rs + tl.cumsum(cnt, axis=1) - cnt
            eb = pb + 3088 + rk
            e0 = tl.where(f0 != 0, tl.load(eb, mask=f0 != 0, other=0).to(tl.int32), e0)
            e1 = tl.where(f1 != 0, tl.load(eb + f0, mask=f1 != 0, other=0).to(tl.int32), e1)
            e2 = tl.where(f2 != 0, tl.load(eb + f0 + f1, mask=f2 != 0, other=0).to(tl.int32), e2)
            e3 = tl.where(f3 != 0, tl.load(eb + f0 + f1 + f2, mask=f3 != 0, other=0).to(tl.int32), e3)
        acc = _emit(acc, out_ptr, page, r, w, _bf16(smw & 0xFF, e0), _bf16((smw >> 8) & 0xFF, e1),
                    _bf16((smw >> 16) & 0xFF, e2), _bf16((smw >> 24) & 0xFF, e3), WRITE)
    tl.store(acc_ptr + pid, tl.sum(acc))


@triton.jit
def k_bf16(buf_ptr, tbl_ptr, out_ptr, acc_ptr, PPP: tl.constexpr, WRITE: tl.constexpr, ASM: tl.constexpr):
    """Layout e: plain bf16 pages, two values a word."""
    pid = tl.program_id(0)
    r = tl.arange(0, 16)[:, None]
    w = tl.arange(0, 64)[None, :]
    acc = tl.zeros((16, 64), tl.int32)
    for i in range(PPP):
        page = (pid * PPP + i).to(tl.int64)
        x = tl.load((buf_ptr + page * 4096).to(tl.pointer_type(tl.int32), bitcast=True) + r * 64 + w)
        v0 = x & 0xFFFF
        v1 = (x >> 16) & 0xFFFF
        if WRITE:
            o = out_ptr + page * 2048 + r * 128 + w * 2
            tl.store(o, v0)
            tl.store(o + 1, v1)
        acc += v0 + v1
    tl.store(acc_ptr + pid, tl.sum(acc))


# ----------------------------------------------------------------------------------------------------
# Synthetic pages and the torch reference


def make_pool(n: int, dev: str, seed: int = 0) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    sm = torch.randint(0, 256, (n, B, D), generator=g, device=dev, dtype=torch.int32)
    flag = torch.rand((n, B, D), generator=g, device=dev) < 0.025
    flat = flag.reshape(n, -1).to(torch.int32)
    rank = torch.cumsum(flat, 1) - flat
    flag = flag & (rank < ESC).reshape(n, B, D)  # past the reserve: dropped (the probe ignores overflow)
    flat = flag.reshape(n, -1).to(torch.int32)
    rank = (torch.cumsum(flat, 1) - flat).reshape(n, B, D)
    escb = torch.randint(0, 256, (n, ESC), generator=g, device=dev, dtype=torch.int32)
    table = torch.randint(90, 140, (D, 16), generator=g, device=dev, dtype=torch.int32)
    c7 = torch.where(flag, 7, torch.randint(0, 7, (n, B, D), generator=g, device=dev, dtype=torch.int32))
    c15 = torch.where(flag, 15, torch.randint(0, 15, (n, B, D), generator=g, device=dev, dtype=torch.int32))
    ch = torch.arange(D, device=dev)
    esc_e = torch.gather(escb, 1, rank.reshape(n, -1).clamp(max=ESC - 1)).reshape(n, B, D)

    def bf(e):
        return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)

    ref = {
        "a": bf(torch.where(flag, esc_e, table[ch, c7])),
        "b": bf(table[ch, c7]),
        "c": bf(torch.where(flag, esc_e, table[ch, c15])),
    }
    ref["d"] = ref["c"]
    ref["n"] = bf(table[ch, c15])
    ref["e"] = ref["a"]
    u8 = torch.uint8
    rowstart = (flag.sum(2).cumsum(1) - flag.sum(2)).to(u8)  # [n, B]
    bits = torch.tensor([1 << b for b in range(8)], device=dev, dtype=torch.int32)
    planes = torch.stack([(((c7 >> p) & 1).reshape(n, B, D // 8, 8) * bits).sum(-1) for p in range(3)], 2)
    nib = (c15[..., 0::2] | (c15[..., 1::2] << 4)).to(u8)  # [n, B, 64]
    inter = torch.cat([sm.to(u8).reshape(n, B, 16, 8), nib.reshape(n, B, 16, 4)], 3).reshape(n, -1)
    pages = {
        "a": torch.cat([sm.to(u8).reshape(n, -1), planes.to(u8).reshape(n, -1), escb.to(u8)], 1),
        "c": torch.cat([sm.to(u8).reshape(n, -1), nib.reshape(n, -1), rowstart, escb.to(u8)], 1),
        "d": torch.cat([inter, rowstart, escb.to(u8)], 1),
        "e": ref["a"].to(torch.int16).reshape(n, -1).view(u8),
    }
    pages["b"] = pages["a"]
    pages["n"] = pages["c"]
    for k, v in pages.items():
        assert v.shape[1] == PAGE_BYTES[k], (k, v.shape)
    tbl = table.to(u8).contiguous().view(torch.int32).reshape(-1)  # [D*4] words, 16 table bytes a channel
    return {"pages": pages, "ref": ref, "tbl": tbl, "esc_rate": flag.float().mean().item()}


def launch(layout: str, buf, tbl, out, acc, n_pages: int, ppp: int, warps: int, write: bool, asm: bool):
    grid = (n_pages // ppp,)
    kw = dict(PPP=ppp, WRITE=write, ASM=asm, num_warps=warps)
    if layout in "ab":
        k_planes[grid](buf, tbl, out, acc, ESCAPES=layout == "a", **kw)
    elif layout in "cdn":
        k_nibbles[grid](buf, tbl, out, acc, INTERLEAVED=layout == "d", ESCAPES=layout != "n", **kw)
    else:
        k_bf16[grid](buf, tbl, out, acc, **kw)


def measure_copy(dev: str) -> tuple[float, float]:
    src = torch.empty(4 << 30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(functools.partial(dst.copy_, src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / ms / 1e6, ms  # GB/s counting read + write


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=1 << 20, help="pages in the timed buffer")
    ap.add_argument("--pool", type=int, default=4096, help="distinct pages (checked bit for bit)")
    ap.add_argument("--layouts", default="abcdne")
    ap.add_argument("--configs", default="4x8,4x32,8x16", help="warps x pages-a-program")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = "cpu" if INTERPRET else "cuda"
    asm = not INTERPRET
    pool = min(a.pool, a.pages)
    out_dir = Path(a.out) if a.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    P = make_pool(pool, dev)
    print(f"pool {pool} pages, escape rate {P['esc_rate'] * 100:.2f}% ({time.time() - t0:.1f} s)", flush=True)
    configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")]
    out = torch.zeros(pool * B * D, device=dev, dtype=torch.int32)
    acc = torch.zeros(a.pages, device=dev, dtype=torch.int32)
    for lay in a.layouts:  # correctness: the pool, every config, bit for bit
        for warps, ppp in configs:
            out.zero_()
            buf = P["pages"][lay].reshape(-1)
            launch(lay, buf, P["tbl"], out, acc, pool, ppp, warps, True, asm)
            got = out.reshape(pool, B, D)
            bad = (got != P["ref"][lay]).sum().item()
            print(f"check {lay} w{warps} p{ppp}: {'ok' if bad == 0 else f'{bad} MISMATCHES'}", flush=True)
            assert bad == 0
    if a.check_only:
        return
    n = a.pages // pool * pool
    rows, log = [], {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "pages": n, "esc_rate": P["esc_rate"], "runs": []}
    copy_bw, ms = measure_copy(dev)
    print(f"copy 4 GiB: {ms:.3f} ms, {copy_bw:.0f} GB/s (read + write)", flush=True)
    log["copy_GBps"] = copy_bw
    for lay in a.layouts:
        big = P["pages"][lay].repeat(n // pool, 1).reshape(-1)
        nbytes = big.numel()
        best = None
        for warps, ppp in configs:
            f = functools.partial(launch, lay, big, P["tbl"], out, acc, n, ppp, warps, False, asm)
            f()
            ms = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
            gbs = nbytes / ms / 1e6
            log["runs"].append({"layout": lay, "warps": warps, "ppp": ppp, "ms": ms, "GBps": gbs})
            print(f"  {lay} w{warps} p{ppp}: {ms:.3f} ms {gbs:.0f} GB/s", flush=True)
            if best is None or ms < best[0]:
                best = (ms, gbs, warps, ppp)
        ms, gbs, warps, ppp = best
        bits = PAGE_BYTES[lay] * 8 / (B * D)
        rows.append((lay, bits, nbytes / 1e9, ms, gbs, 100 * gbs / copy_bw, n * B * D / ms / 1e6, f"w{warps}p{ppp}"))
        del big
    hdr = "| layout | bits/value | GB read | ms | GB/s read | % of copy | G values/s | config |"
    lines = [hdr, "|---|---|---|---|---|---|---|---|"]
    for lay, bits, gb, ms, gbs, pct, gv, cfg in rows:
        lines.append(f"| {lay} | {bits:.2f} | {gb:.2f} | {ms:.3f} | {gbs:.0f} | {pct:.0f}% | {gv:.0f} | {cfg} |")
    table = "\n".join(lines)
    print(table, flush=True)
    if out_dir:
        (out_dir / "layout_probe.json").write_text(json.dumps(log, indent=1))
        (out_dir / "layout_probe.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
