"""`glyd bench codec`: bits a value and speed of both codes on a real model, every value checked.

Weights: every tensor `glyd pack` would pack, encoded and decoded in memory. KV: post-RoPE K/V recorded
from the model on held-out text (not the calibration text), written into pages at vLLM's block size
with the model's cached tables, read back and compared bit for bit. Bits count everything stored: page
bytes (escape reserve included), overflow chunks taken, and the tables.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from glyd_engine.format import bf16, weights
from glyd_engine.format.checkpoint import check_source, is_packable, source_files
from glyd_engine.model_shape import AttentionShape
from glyd_engine.progress import PhaseTimer, ProgressCallback, no_progress
from glyd_engine.tables.kv_tables import KVTables

JOB = "bench-codec"


def bench_weights(model_dir: Path, progress: ProgressCallback = no_progress) -> dict[str, object]:
    from safetensors import safe_open

    tensors = check_source(model_dir)
    names = [n for n, (_, i) in tensors.items() if is_packable(i["dtype"], i["shape"])]
    timer = PhaseTimer(JOB, "weights", len(names), progress)
    values = stored = 0
    hist = []
    enc_s = dec_s = 0.0
    exact = True
    for path in source_files(model_dir):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name not in names:
                    continue
                t = f.get_tensor(name)
                t0 = time.perf_counter()
                p = weights.encode(t, name)
                t1 = time.perf_counter()
                back = weights.decode(p, name, check=False)
                t2 = time.perf_counter()
                enc_s, dec_s = enc_s + t1 - t0, dec_s + t2 - t1
                exact &= torch.equal(back.view(torch.int16), t.view(torch.int16))
                values += p.numel
                stored += p.nbytes
                exp, _ = bf16.split(t)
                hist.append((p.numel, bf16.entropy_bits(bf16.exponent_histogram(exp))))
                timer.update(len(hist), name)
    floor = 8 + sum(n * h for n, h in hist) / max(1, values)
    mb = 2 * values / 1e6
    return {"weights_bits_per_value": round(8 * stored / max(1, values), 4),
            "weights_floor_bits": round(floor, 4), "weights_values": values, "weights_tensors": len(hist),
            "weights_encode_MBps": round(mb / max(enc_s, 1e-9), 2),
            "weights_decode_MBps": round(mb / max(dec_s, 1e-9), 2), "weights_exact": bool(exact)}


def record_kv(model_dir: Path, text: str, max_tokens: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Post-RoPE K and V of every layer, [T, H, D] bf16, for the first `max_tokens` tokens of `text`."""
    from glyd_engine.tables import capture

    model = capture.load_model(model_dir)
    tok = capture.load_tokenizer(model_dir)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:max_tokens], dtype=torch.int64)
    keys: dict[int, torch.Tensor] = {}
    vals: dict[int, torch.Tensor] = {}

    def keep(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        keys[layer], vals[layer] = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()

    with capture.capturing(keep):
        capture.run(model, ids)
    return keys, vals


def channel_floor(x: torch.Tensor) -> float:
    """Mean over (head, channel) of the order-0 exponent entropy, for x [T, H, D]."""
    e, _ = bf16.split(x)
    counts = torch.nn.functional.one_hot(e.to(torch.int64), 256).sum(0).to(torch.float64)  # [H, D, 256]
    p = counts / counts.sum(-1, keepdim=True)
    return float(-(torch.where(p > 0, p * torch.log2(p), torch.zeros_like(p))).sum(-1).mean())


def head_floor(x: torch.Tensor) -> float:
    e, _ = bf16.split(x)
    return sum(bf16.entropy_bits(bf16.exponent_histogram(e[:, h])) for h in range(x.shape[1])) / x.shape[1]


def _tokens(pages: torch.Tensor, n: int) -> torch.Tensor:
    """[N, H, B, D] pages in block order -> the first n tokens, [n, H, D]."""
    return pages.permute(0, 2, 1, 3).reshape(-1, pages.shape[1], pages.shape[3])[:n]


def bench_kv(tables: KVTables, keys: dict[int, torch.Tensor], vals: dict[int, torch.Tensor],
             block_size: int, progress: ProgressCallback = no_progress) -> dict[str, object]:
    lay = tables.layout(block_size)
    timer = PhaseTimer(JOB, f"KV pages (block size {block_size})", len(keys), progress)
    n_tok = next(iter(keys.values())).shape[0]
    n_blocks = (n_tok + block_size - 1) // block_size
    exact = True
    values = 0
    overflow_bytes = 0
    escapes = overflow = 0
    enc_s = dec_s = 0.0
    floors = {"k": [], "v": [], "v_chan": []}
    for layer in sorted(keys):
        codec = tables.codec(layer, block_size)
        cache, ovf = codec.new_cache(n_blocks), codec.new_overflow(n_blocks)
        blocks = torch.randperm(n_blocks)
        slots = blocks[torch.arange(n_tok) // block_size] * block_size + torch.arange(n_tok) % block_size
        k, v = keys[layer], vals[layer]
        t0 = time.perf_counter()
        codec.write(cache, ovf, k, v, slots)
        t1 = time.perf_counter()
        rk, rv = codec.read(cache, ovf, blocks)  # blocks in token order
        t2 = time.perf_counter()
        enc_s, dec_s = enc_s + t1 - t0, dec_s + t2 - t1
        exact &= torch.equal(_tokens(rk, n_tok).view(torch.int16), k.view(torch.int16))
        exact &= torch.equal(_tokens(rv, n_tok).view(torch.int16), v.view(torch.int16))
        overflow_bytes += ovf.bytes_held + 4 * ovf.ptr.numel()  # the runs held plus a tile's two run pointers
        values += k.numel()
        escapes += codec.stats.escapes
        overflow += codec.stats.overflow
        floors["k"].append(channel_floor(k))
        floors["v"].append(head_floor(v))
        floors["v_chan"].append(channel_floor(v))
        timer.update(layer + 1)
    out: dict[str, object] = {"block_size": block_size, "kv_tokens": n_tok, "kv_values_checked": 2 * values}
    # everything included: pages, overflow runs and their pointers, the window tops
    out["kv_bits_per_value"] = round(lay.bits_per_value() + (8 * (overflow_bytes + tables.nbytes)) / (2 * values), 4)
    out["page_bits_per_value"] = round(lay.bits_per_value(), 4)
    out["k_floor_bits"] = round(8 + sum(floors["k"]) / len(floors["k"]), 4)
    out["v_floor_bits"] = round(8 + sum(floors["v"]) / len(floors["v"]), 4)
    out["v_floor_bits_per_channel"] = round(8 + sum(floors["v_chan"]) / len(floors["v_chan"]), 4)
    out["kv_token_bytes"] = lay.token_bytes
    out["kv_capacity_vs_bf16"] = round(4 * lay.head_size / lay.token_bytes, 4)
    out["kv_token_bytes_4bit"] = tables.token_bytes(4)  # the 4-bit code (GPUs' default): fewer escapes, less capacity
    out["kv_capacity_vs_bf16_4bit"] = round(4 * lay.head_size / tables.token_bytes(4), 4)
    out["kv_escape_rate"] = round(escapes / (2 * values), 5)
    out["kv_overflow_values"] = overflow
    mb = 2 * 2 * values / 1e6
    out["kv_encode_MBps"] = round(mb / max(enc_s, 1e-9), 2)
    out["kv_decode_MBps"] = round(mb / max(dec_s, 1e-9), 2)
    out["kv_exact"] = bool(exact)
    return out


def run_codec_bench(model_dir: Path, text: str, text_name: str, max_tokens: int, block_sizes: list[int],
                    window: int | None = None, progress: ProgressCallback = no_progress) -> dict[str, object]:
    from glyd_engine.tables import ensure_tables

    model_dir = Path(model_dir)
    shape = AttentionShape.from_model_dir(model_dir)
    result: dict[str, object] = {"model": str(model_dir), "text": text_name}
    result.update(bench_weights(model_dir, progress))
    tables = ensure_tables(model_dir, window, progress=progress)
    keys, vals = record_kv(model_dir, text, min(max_tokens, shape.max_positions))
    runs = [bench_kv(tables, keys, vals, b, progress) for b in block_sizes]
    main = runs[0]
    result.update(main)
    if len(runs) > 1:
        result["by_block_size"] = {str(r["block_size"]): {k: r[k] for k in (
            "kv_bits_per_value", "kv_overflow_values")} for r in runs}
    result["tables"] = tables.describe()
    result["exact"] = bool(result["weights_exact"]) and all(bool(r["kv_exact"]) for r in runs)
    return result
