"""The bars of the GPU benchmarks as data, and their verdicts: functions from result rows to failure strings.

Pure Python (no torch, no GPU) so that tests/test_gpu_bars.py runs the same judgement on the CPU that bench/gpu.py
runs on the device at the end of its run (it exits 1 on any failure). Issue 29 sets the bars: decode attention ahead
of FlashAttention 3 (vLLM's default on Hopper) at every batch x context for each page code, well ahead where the
bytes dominate, near the read-only rate of the card; every decoded value bit for bit; the error against fp32 no worse
than FlashAttention 3's on the same inputs; a high-escape regime timed and checked. A value that is missing, NaN or
an error counts as a failure: a benchmark that measured nothing must not pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

GRID_BATCHES = (1, 8, 32, 64, 128)
GRID_CONTEXTS = (1024, 8192, 32768)
GRID_CODES = (3, 4)
LINEAR_SHAPES = ("qkv", "o", "gate_up", "down")  # Qwen3-8B's linears (bench/gpu_linear.py)
LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
FA3_COLUMNS = ("fa3_ms", "fa3_sched_ms")  # the call of the issue; vLLM's full-graph decode call (AOT schedule)
Cell = tuple[int, int]  # (batch, context)
Row = Mapping[str, object]


@dataclass(frozen=True)
class Bars:
    """Issue 29's bars. Ratios are FlashAttention 3's time over ours (> 1: ours faster)."""

    vs_fa3: float = 1.05  # every cell, each code
    vs_fa3_heavy: float = 1.30  # batch >= heavy_batch and context >= heavy_context
    heavy_batch: int = 32
    heavy_context: int = 8192
    of_read_only: float = 0.92  # compressed bytes a second over the read-only stream's rate
    read_batch: int = 64
    read_context: int = 8192
    high_escape_min_rate: float = 0.01  # a regime below this escape rate is no high-escape regime
    sched_err_factor: float = 2.0  # vLLM's scheduled FA3 call must compute what the plain call computes
    linear_few: float = 1.25  # the Glyd matmul over cuBLAS on bf16 at 1..linear_few_rows rows of x
    linear_few_rows: int = 16
    linear_many: float = 1.0  # ... and above, up to linear_max_rows (larger: prefill, not judged)
    linear_max_rows: int = 128


BARS = Bars()
GRID: tuple[Cell, ...] = tuple((b, c) for b in GRID_BATCHES for c in GRID_CONTEXTS)


# --- small helpers ---------------------------------------------------------------------------------------------------
def parse_cells(text: str) -> list[Cell]:
    """'1x8192,64x8192' -> [(1, 8192), (64, 8192)]; '' -> []."""
    cells = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        b, sep, c = part.lower().partition("x")
        if not sep or not b.strip().isdigit() or not c.strip().isdigit() or int(b) < 1 or int(c) < 1:
            raise ValueError(f"a cell is BATCHxCONTEXT, e.g. 1x8192: not {part!r}")
        cells.append((int(b), int(c)))
    return cells


def number(row: Row, key: str) -> float | None:
    """row[key] where it is a finite positive number, else None (missing, NaN, an error string)."""
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        return None
    return float(v)


def fa3_ms(row: Row) -> float | None:
    """The faster of the FlashAttention 3 calls timed in the row: the baseline the bars compare with."""
    times = [t for k in FA3_COLUMNS if (t := number(row, k)) is not None]
    return min(times) if times else None


def bf16_attention_ms(row: Row) -> float | None:
    """The bf16 cache's attention time a user would get: FlashAttention 3 where timed, else vLLM's Triton kernel."""
    return fa3_ms(row) or number(row, "vllm_ms")


def full_grid(codes: Iterable[int], cells: Iterable[Cell]) -> bool:
    """Whether a run covers every code and every cell of issue 29's grid (a subset can miss no bar it did not run)."""
    return set(GRID_CODES) <= set(codes) and set(GRID) <= set(cells)


def column_errors(row: Row, where: str) -> list[str]:
    """A column that failed while the others were timed (`fa3_sched_error`, say): still a failure."""
    return [f"{where}: {k[:-6]} failed: {v}" for k, v in row.items() if k.endswith("_error")]


def find_row(rows: Sequence[Row], cell: Cell) -> Row | None:
    return next((r for r in rows if (r.get("batch"), r.get("context")) == cell), None)


# --- the verdicts ----------------------------------------------------------------------------------------------------
def attention_failures(rows: Sequence[Row], codes: Iterable[int], cells: Iterable[Cell], read_only_tbps: float | None,
                       has_fa3: bool = True, bars: Bars = BARS, label: str = "") -> list[str]:
    """Speed bars of each cell and code: ours / FA3 and the compressed-bytes rate over the read-only rate."""
    fails: list[str] = []
    if read_only_tbps is None or not math.isfinite(read_only_tbps) or read_only_tbps <= 0:
        fails.append(f"{label}no read-only rate measured: the bandwidth bar cannot be judged")
        read_only_tbps = None
    for b, c in cells:
        where = f"{label}batch {b} x context {c}"
        row = find_row(rows, (b, c))
        if row is None:
            fails.append(f"{where}: missing cell (not timed)")
            continue
        if "error" in row:
            fails.append(f"{where}: error {row['error']}")
            continue
        fails += column_errors(row, where)
        base = fa3_ms(row)
        if has_fa3 and base is None:
            fails.append(f"{where}: no FlashAttention 3 time")
        heavy = b >= bars.heavy_batch and c >= bars.heavy_context
        bar = bars.vs_fa3_heavy if heavy else bars.vs_fa3
        for cb in codes:
            ms = number(row, f"code{cb}_ms")
            if ms is None:
                fails.append(f"{where}: {cb}-bit code not timed")
                continue
            if has_fa3 and base is not None and not base / ms >= bar:
                fails.append(f"{where}: {cb}-bit {base / ms:.4f}x FlashAttention 3, bar {bar:.2f}x")
            if read_only_tbps is not None and b >= bars.read_batch and c >= bars.read_context:
                tbps = number(row, f"code{cb}_TBps")
                frac = None if tbps is None else tbps / read_only_tbps
                if frac is None or not frac >= bars.of_read_only:
                    shown = "no rate" if frac is None else f"{frac:.2%}"
                    fails.append(f"{where}: {cb}-bit reads compressed bytes at {shown} of the read-only rate, "
                                 f"bar {bars.of_read_only:.0%}")
    return fails


def read_back_failures(name: str, info: Mapping[str, object] | None) -> list[str]:
    """Every value decoded from the pages equals the bf16 value written, and something was compared."""
    rb = None if info is None else info.get("read_back")
    if not isinstance(rb, Mapping):
        return [f"{name}: tiles not read back"]
    if "error" in rb:
        return [f"{name}: read-back error {rb['error']}"]
    fails = []
    if not isinstance(rb.get("tiles_checked"), int) or rb["tiles_checked"] <= 0:
        fails.append(f"{name}: no tiles read back")
    differing = rb.get("values_differing")
    if differing != 0:
        fails.append(f"{name}: {differing} values read back differ from the bf16 written")
    return fails


def accuracy_failures(label: str, acc: Sequence[Row], codes: Iterable[int], has_fa3: bool = True,
                      bars: Bars = BARS) -> list[str]:
    """Each case: every code's error against fp32 at most FA3's (plain call), no NaN, the same bits twice; the
    scheduled FA3 call (where run) the same bits each time and an error near the plain call's."""
    if not acc:
        return [f"{label}: no accuracy cases run"]
    fails = []
    for row in acc:
        where = f"{label} {row.get('batch')} x {row.get('context')}"
        if "error" in row:
            fails.append(f"{where}: error {row['error']}")
            continue
        ref = number(row, "fa3_rel_err")
        if has_fa3 and (ref is None or row.get("fa3_nan") is not False):
            fails.append(f"{where}: no FlashAttention 3 error to compare with")
            ref = None
        for cb in codes:
            err = number(row, f"code{cb}_rel_err")
            if err is None or row.get(f"code{cb}_nan") is not False:
                fails.append(f"{where}: {cb}-bit output has NaN or no error measured")
                continue
            if row.get(f"code{cb}_same_bits_twice") is not True:
                fails.append(f"{where}: {cb}-bit output differs between two runs")
            if ref is not None and not err <= ref:
                fails.append(f"{where}: {cb}-bit error {err:.4e} above FlashAttention 3's {ref:.4e}")
        if "fa3_sched_error" in row:
            fails.append(f"{where}: scheduled FlashAttention 3 call failed: {row['fa3_sched_error']}")
        elif "fa3_sched_rel_err" in row:
            sched = number(row, "fa3_sched_rel_err")
            if row.get("fa3_sched_same_bits") is not True:
                fails.append(f"{where}: scheduled FlashAttention 3 output differs between runs")
            if sched is None or (ref is not None and not sched <= bars.sched_err_factor * ref):
                fails.append(f"{where}: scheduled FlashAttention 3 error {sched} far from the plain call's {ref}: "
                             "its timings are not of the same function")
    return fails


def high_escape_failures(regimes: Sequence[Mapping[str, object]], codes: Iterable[int], cells: Sequence[Cell],
                         has_fa3: bool = True, bars: Bars = BARS) -> list[str]:
    """Each high-escape regime: escapes high enough to be one, tiles bit for bit, accuracy as above, every cell
    timed for every code and FlashAttention 3 (no speed bar: the issue asks for the figures)."""
    if not cells:
        return []
    if not regimes:
        return ["no high-escape regime run"]
    codes = list(codes)
    fails = []
    for reg in regimes:
        name = f"high-escape {reg.get('name')}"
        if "error" in reg:
            fails.append(f"{name}: error {reg['error']}")
            continue
        infos = reg.get("codes")
        infos = infos if isinstance(infos, Mapping) else {}
        refused = reg.get("refused")
        refused = refused if isinstance(refused, Mapping) else {}
        fails += [f"{name}: {cb}-bit code refused by the overflow arena ({refused[f'code{cb}']})"
                  for cb in codes if f"code{cb}" in refused]
        timed = [cb for cb in codes if f"code{cb}" not in refused]
        for cb in timed:
            info = infos.get(f"code{cb}")
            rate = number(info, "escape_rate") if isinstance(info, Mapping) else None
            if rate is None or not rate >= bars.high_escape_min_rate:
                fails.append(f"{name}: {cb}-bit escape rate {rate} under {bars.high_escape_min_rate:.0%}: "
                             "not a high-escape regime")
            fails += read_back_failures(f"{name} {cb}-bit", info if isinstance(info, Mapping) else None)
        acc = reg.get("accuracy")
        fails += accuracy_failures(name, acc if isinstance(acc, list) else [], timed, has_fa3, bars)
        rows = reg.get("rows")
        rows = rows if isinstance(rows, list) else []
        for cell in cells:
            row = find_row(rows, cell)
            where = f"{name} batch {cell[0]} x context {cell[1]}"
            if row is None or "error" in row:
                fails.append(f"{where}: " + ("missing cell (not timed)" if row is None else f"error {row['error']}"))
                continue
            fails += column_errors(row, where)
            fails += [f"{where}: {cb}-bit code not timed" for cb in timed if number(row, f"code{cb}_ms") is None]
            if has_fa3 and fa3_ms(row) is None:
                fails.append(f"{where}: no FlashAttention 3 time")
    return fails


def judge(result: Mapping[str, object], codes: Sequence[int], cells: Sequence[Cell],
          high_escape_cells: Sequence[Cell], bars: Bars = BARS) -> list[str]:
    """Every failure of a bench/gpu.py run's result (its gpu_bench.json): [] is a pass."""
    fa3 = result.get("fa3")
    has_fa3 = isinstance(fa3, Mapping) and fa3.get("available") is True
    fails = [] if has_fa3 else ["FlashAttention 3 was not run (--no-fa3 or unavailable): the bars against it "
                                "are not judged"]
    if full_grid(codes, cells) and not high_escape_cells:
        fails.append("no high-escape regime timed (--high-escape-cells empty) in a full-grid run")
    ro = result.get("read_only")
    read_tbps = number(ro, "TBps") if isinstance(ro, Mapping) else None
    if isinstance(ro, Mapping) and "error" in ro:
        fails.append(f"read-only stream: {ro['error']}")
    for cb in codes:
        info = result.get(f"code{cb}")
        fails += read_back_failures(f"{cb}-bit code", info if isinstance(info, Mapping) else None)
    acc = result.get("attention_accuracy")
    fails += accuracy_failures("accuracy", acc if isinstance(acc, list) else [], codes, has_fa3, bars)
    rows = result.get("rows")
    fails += attention_failures(rows if isinstance(rows, list) else [], codes, cells, read_tbps, has_fa3, bars)
    regimes = result.get("high_escape")
    fails += high_escape_failures(regimes if isinstance(regimes, list) else [], codes, high_escape_cells, has_fa3,
                                  bars)
    return fails


def linear_failures(result: Mapping[str, object], shapes: Iterable[str], rows: Iterable[int],
                    bars: Bars = BARS) -> list[str]:
    """bench/gpu_linear.py's run (its gpu_linear.json): the default CUDA build over cuBLAS at each shape and row count
    up to linear_max_rows, and every check it logged (`*_ok`, `*_bit_exact`: decoded bits equal) true."""
    fails = []
    for key, checks in result.items():
        if key.startswith("checks_") and isinstance(checks, Mapping):
            fails += [f"{key[7:]}: {k} failed" for k, v in checks.items()
                      if (k.endswith("_ok") or k.endswith("_bit_exact")) and v is not True]
    table = result.get("table")
    table = table if isinstance(table, list) else []
    for name in shapes:
        checks = result.get(f"checks_{name}")
        if not isinstance(checks, Mapping) or checks.get("fragment_decode_bit_exact") is not True:
            fails.append(f"{name}: fragment decode not checked bit for bit")
        for m in rows:
            if m > bars.linear_max_rows:
                continue
            row = next((r for r in table if r.get("shape") == name and r.get("M") == m), None)
            ref = None if row is None else number(row, "cublas_ms")
            ms = None if row is None else number(row, "cuda_ms")
            if ref is None or ms is None:
                fails.append(f"{name} at {m} rows: not timed")
                continue
            bar = bars.linear_few if m <= bars.linear_few_rows else bars.linear_many
            if not ref / ms >= bar:
                fails.append(f"{name} at {m} rows: {ref / ms:.4f}x cuBLAS, bar {bar:.2f}x")
    return fails
