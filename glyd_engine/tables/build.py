"""The table build: calibration text through the model, exponent statistics, tables on disk.

Runs once per model (keyed by its fingerprint) and is reused by every later start. A file lock keeps
two engines starting at once from building twice or reading a half-written file; a damaged file is
detected by its checksum and rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from glyd_engine import options as opt
from glyd_engine.errors import CorruptFileError
from glyd_engine.format import bf16
from glyd_engine.format.kv_page import CODE_BITS, TILE, best_windows, check_head_size, valid_reserve, window
from glyd_engine.model_shape import AttentionShape
from glyd_engine.models.tables_here import tables_file
from glyd_engine.progress import CancelToken, PhaseTimer, ProgressCallback, no_progress
from glyd_engine.tables.kv_tables import KVTables

log = logging.getLogger("glyd.tables")

JOB = "kv-tables"
SEQ_LEN = 512  # tokens a forward pass; positions still span the whole window (see capture.py)
TOKENS = 24 * 1024  # calibration tokens a build reads by default
RESERVE_SIGMAS = 1.0  # escape-list entries a tile = mean + this many standard deviations (Poisson); see docs


def tables_path(fingerprint: str) -> Path:
    return tables_file(fingerprint)  # named in one place, read there without torch by the app


def calibration_ids(tokenizer, seq_len: int, budget: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Runs of `seq_len` tokens from the calibration corpus, taken round-robin across its texts."""
    from glyd_engine.corpus import calibration_texts

    per_text = []
    for text in calibration_texts():
        ids = torch.tensor(tokenizer(text.text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
        per_text.append([ids[i : i + seq_len] for i in range(0, ids.numel() - seq_len + 1, seq_len)])
    runs: list[torch.Tensor] = []
    while len(runs) * seq_len < budget and any(per_text):
        for pieces in per_text:
            if pieces and len(runs) * seq_len < budget:
                runs.append(pieces.pop(0))
    if not runs:
        raise RuntimeError("the calibration corpus is empty or shorter than one run")
    return runs


def counts_to_tables(counts: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor, dict[int, int]]:
    """[L, 2, H, D, 256] exponent counts -> window tops and escape-list reserves (entries a tile) of each code,
    and the per-channel entropy."""
    c = counts.to(torch.float64)
    total = c.sum(-1, keepdim=True).clamp(min=1)
    p = c / total
    floor = -(torch.where(p > 0, p * torch.log2(p), torch.zeros_like(p))).sum(-1).to(torch.float32)
    e = torch.arange(256, dtype=torch.int64)
    tops, reserve = {}, {}
    for bits in CODE_BITS:
        tops[bits] = best_windows(counts, bits)
        low = tops[bits].to(torch.int64).unsqueeze(-1) - (window(bits) - 1)
        inside = (e >= low) & (e < low + window(bits))
        miss = 1.0 - (c * inside).sum(-1) / total.squeeze(-1)  # [L, 2, H, D]: escape share of each channel
        mean = float((TILE * miss.sum(-1).sum(1)).mean())  # entries a 16-token tile, K and V together
        reserve[bits] = valid_reserve(math.ceil(mean + RESERVE_SIGMAS * math.sqrt(mean)))
    return tops, floor, reserve


def build_device(model_dir: Path) -> torch.device:
    """Where the calibration runs: a CUDA GPU with room for the bf16 weights and a margin, else the CPU (an 8B model's
    build: 18 s on an H100, about 8 minutes on 16 CPU cores; docs/benchmarks.md). `GLYD_KV_BUILD_DEVICE` overrides."""
    from glyd_engine.errors import RefusedError
    from glyd_engine.format.checkpoint import is_glyd_checkpoint

    asked = opt.TABLE_BUILD_DEVICE.read()
    if asked == "cuda" and not torch.cuda.is_available():
        raise RefusedError(f"{opt.TABLE_BUILD_DEVICE.env}=cuda, but torch sees no CUDA GPU",
                           f"unset {opt.TABLE_BUILD_DEVICE.env} (or set it to cpu) to build the KV tables on the CPU")
    if asked != "auto":
        return torch.device(asked)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info()
    # file sizes, not engine.report.weights_report (which would import the engine into the tables: a circle)
    stored = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    bf16_bytes = 2 * stored if is_glyd_checkpoint(model_dir) else stored  # packed: ~11 bits a weight
    need = bf16_bytes * 5 // 4 + (2 << 30)  # bf16 weights, activations of 512-token runs, a margin
    return torch.device("cuda", torch.cuda.current_device()) if free >= need else torch.device("cpu")


def build_tables(model_dir: Path, window: int | None = None, tokens: int = TOKENS, seq_len: int = SEQ_LEN,
                 progress: ProgressCallback = no_progress, cancel: CancelToken | None = None) -> KVTables:
    """Build (not cache) the tables for a bf16 model directory."""
    from glyd_engine.format.fingerprint import model_fingerprint
    from glyd_engine.tables import capture

    start = time.monotonic()
    shape = AttentionShape.from_model_dir(model_dir)
    check_head_size(shape.head_size)  # refused before minutes of calibration, not after
    window = min(window or shape.max_positions, shape.max_positions)
    seq_len = min(seq_len, window)
    fingerprint = model_fingerprint(model_dir)
    device = build_device(model_dir)
    PhaseTimer(JOB, f"loading the model ({'GPU' if device.type == 'cuda' else 'CPU'})", None, progress, cancel)
    model = capture.load_model(model_dir, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    tokenizer = capture.load_tokenizer(model_dir)
    runs = calibration_ids(tokenizer, seq_len, tokens)
    L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_size
    counts = torch.zeros(L, 2, H, D, 256, dtype=torch.int64, device=device)
    chan = (torch.arange(H, device=device).view(H, 1, 1) * D + torch.arange(D, device=device).view(1, 1, D)) * 256

    def collect(layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        for kv, x in ((0, key), (1, value)):
            e, _ = bf16.split(x)  # [H, T, D]
            idx = (chan + e.to(torch.int64)).reshape(-1)
            counts[layer, kv] += torch.bincount(idx, minlength=H * D * 256).view(H, D, 256)

    timer = PhaseTimer(JOB, f"calibrating over a {window:,}-token window", len(runs), progress, cancel)
    span = max(0, window - seq_len)
    with capture.capturing(collect):
        for i, ids in enumerate(runs):
            offset = round(i * span / max(1, len(runs) - 1))
            capture.run(model, ids, offset)
            timer.update(i + 1)
    del model
    counts = counts.cpu()
    if device.type == "cuda":  # an engine starting next in this process gets the GPU's memory back
        torch.cuda.empty_cache()
    tops, floor, reserve = counts_to_tables(counts)
    tables = KVTables(tops, floor, reserve, fingerprint, window, sum(r.numel() for r in runs),
                      time.monotonic() - start)
    log.info("KV tables for %s built in %.1f s on the %s: %s", model_dir, tables.build_seconds,
             "GPU" if device.type == "cuda" else "CPU", tables.describe())
    return tables


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_tables(model_dir: Path, window: int | None = None, progress: ProgressCallback = no_progress,
                  cancel: CancelToken | None = None, rebuild: bool = False, tokens: int = TOKENS) -> KVTables:
    """The model's tables from the cache, built first if missing, damaged, or for a shorter window."""
    from glyd_engine.format.fingerprint import model_fingerprint

    fingerprint = model_fingerprint(model_dir)
    path = tables_path(fingerprint)
    with _locked(path):
        if path.exists() and not rebuild:
            try:
                tables = KVTables.load(path, fingerprint)
                if window is None or tables.window >= window:
                    return tables
                log.info("KV tables at %s cover %d positions; rebuilding for %d", path, tables.window, window)
            except CorruptFileError as exc:
                log.warning("%s; rebuilding", exc)
        from glyd_engine.tables import isolated

        if isolated.wanted():  # no CUDA context left in a process that starts vLLM next
            check_head_size(AttentionShape.from_model_dir(model_dir).head_size)  # refusals keep their kind
            tables = isolated.build_in_child(model_dir, fingerprint, window, tokens, progress, cancel)
        else:  # a plugin builds while vLLM constructs the model, whose default device is the GPU: the build's
            with torch.device("cpu"):  # tensors say where they go, the rest is the CPU's
                tables = build_tables(model_dir, window, tokens, progress=progress, cancel=cancel)
        tables.save(path)
        return tables
