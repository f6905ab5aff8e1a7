"""The GPU benchmarks' bars and checks (bench/gpu_bars.py), judged on made-up results: no GPU runs here.

bench/gpu.py calls the same `judge` on its own results at the end of a device run and exits 1 on any failure, so
what these tests pin down is what that run can and cannot pass with: every bar missed by a hair fails, a value read
back wrong fails, an error above FlashAttention 3's fails, and a cell, a column or a regime that was not measured
fails rather than passing by omission.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_test_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gb = _load("gpu_bars")
READ = 4.5  # TB/s of the read-only stream
HIGH_CELLS = [(1, 8192), (64, 8192)]


def _row(b: int, c: int, margin: float = 1.01) -> dict[str, Any]:
    """A cell that clears every bar by `margin`: FA3 takes 1 ms, ours 1 / (bar x margin)."""
    bars = gb.BARS
    heavy = b >= bars.heavy_batch and c >= bars.heavy_context
    ratio = (bars.vs_fa3_heavy if heavy else bars.vs_fa3) * margin
    row: dict[str, Any] = {"batch": b, "context": c, "fa3_ms": 1.0, "fa3_sched_ms": 1.02, "vllm_ms": 1.5,
                           "sdpa_ms": 1.2}
    for cb in gb.GRID_CODES:
        row[f"code{cb}_ms"] = 1.0 / ratio
        row[f"code{cb}_TBps"] = READ * bars.of_read_only * margin
    return row


def _acc() -> list[dict[str, Any]]:
    row: dict[str, Any] = {"batch": 8, "context": 1024, "fa3_rel_err": 1.75e-3, "fa3_nan": False,
                           "fa3_sched_rel_err": 1.75e-3, "fa3_sched_same_bits": True, "vllm_rel_err": 1.76e-3}
    for cb in gb.GRID_CODES:
        row |= {f"code{cb}_rel_err": 1.74e-3, f"code{cb}_nan": False, f"code{cb}_same_bits_twice": True}
    return [row, {**row, "batch": 2, "context": 32768}]


def _code_info(rate: float = 0.005) -> dict[str, Any]:
    return {"escape_rate": rate, "k_escape_rate": rate, "v_escape_rate": rate,
            "read_back": {"tiles_checked": 8192, "overflow_tiles_checked": 100, "values_differing": 0}}


def passing() -> dict[str, Any]:
    """A full-grid result of bench/gpu.py that passes everything."""
    result: dict[str, Any] = {"fa3": {"available": True}, "read_only": {"TBps": READ},
                              "attention_accuracy": _acc(), "rows": [_row(b, c) for b, c in gb.GRID]}
    for cb in gb.GRID_CODES:
        result[f"code{cb}"] = _code_info()
    result["high_escape"] = [{"name": n, "codes": {f"code{cb}": _code_info(0.2) for cb in gb.GRID_CODES},
                              "accuracy": _acc(), "rows": [_row(b, c, 0.5) for b, c in HIGH_CELLS]}
                             for n in ("other-tables", "scaled-x16")]
    return result


def judge(result: dict[str, Any], cells: list[tuple[int, int]] | None = None,
          high: list[tuple[int, int]] | None = None) -> list[str]:
    return gb.judge(result, list(gb.GRID_CODES), list(gb.GRID) if cells is None else cells,
                    HIGH_CELLS if high is None else high)


def _cell(result: dict[str, Any], b: int, c: int) -> dict[str, Any]:
    return next(r for r in result["rows"] if (r["batch"], r["context"]) == (b, c))


def test_a_result_that_clears_every_bar_passes() -> None:
    assert judge(passing()) == []
    assert gb.full_grid(gb.GRID_CODES, gb.GRID)
    # the high-escape regime has no speed bar: it is timed (here at half the bars) and passes


@pytest.mark.parametrize(("cell", "bar"), [((1, 8192), 1.05), ((8, 32768), 1.05), ((32, 1024), 1.05),
                                           ((32, 8192), 1.30), ((128, 32768), 1.30)])
@pytest.mark.parametrize("cb", gb.GRID_CODES)
def test_a_hair_under_the_fa3_bar_fails_that_cell_and_code_alone(cell: tuple[int, int], bar: float, cb: int) -> None:
    result = passing()
    _cell(result, *cell)[f"code{cb}_ms"] = 1.0 / (bar * 0.9999)
    assert judge(result) == [f"batch {cell[0]} x context {cell[1]}: {cb}-bit {bar * 0.9999:.4f}x FlashAttention 3, "
                             f"bar {bar:.2f}x"]


def test_the_fa3_bar_takes_the_faster_fa3_call() -> None:
    """The scheduled call (vLLM's full-graph decode) faster than the plain one sets the bar's baseline."""
    result = passing()
    _cell(result, 1, 1024)["fa3_sched_ms"] = 0.9  # ours at 1 / 1.0605 ms: 0.954x the scheduled call
    fails = judge(result)
    assert len(fails) == 2 and all(f.startswith("batch 1 x context 1024: ") and "0.954" in f for f in fails)


@pytest.mark.parametrize("cell", [(64, 8192), (128, 32768)])
def test_a_hair_under_the_read_only_bar_fails(cell: tuple[int, int]) -> None:
    result = passing()
    _cell(result, *cell)["code4_TBps"] = READ * 0.9199
    fails = judge(result)
    assert fails == [f"batch {cell[0]} x context {cell[1]}: 4-bit reads compressed bytes at 91.99% of the read-only "
                     "rate, bar 92%"]


def test_the_read_only_bar_applies_only_from_batch_64_and_8k() -> None:
    result = passing()
    for cell in ((32, 32768), (128, 1024)):
        _cell(result, *cell)["code3_TBps"] = READ * 0.5
    assert judge(result) == []


def test_no_read_only_rate_fails() -> None:
    result = passing()
    result["read_only"] = {"error": "RuntimeError('sums differ')"}
    fails = judge(result)
    assert any("no read-only rate" in f for f in fails) and any("sums differ" in f for f in fails)


@pytest.mark.parametrize(("read_back", "expect"), [
    ({"tiles_checked": 8192, "values_differing": 1}, "1 values read back differ"),
    ({"tiles_checked": 0, "values_differing": 0}, "no tiles read back"),
    ({"error": "RuntimeError('illegal address')"}, "read-back error"),
    (None, "tiles not read back"),
])
def test_a_failed_read_back_fails(read_back: dict[str, Any] | None, expect: str) -> None:
    result = passing()
    if read_back is None:
        del result["code3"]["read_back"]
    else:
        result["code3"]["read_back"] = read_back
    fails = judge(result)
    assert len(fails) == 1 and fails[0].startswith("3-bit code") and expect in fails[0]


def test_a_failed_read_back_in_a_high_escape_regime_fails() -> None:
    result = passing()
    result["high_escape"][1]["codes"]["code4"]["read_back"]["values_differing"] = 3
    assert judge(result) == ["high-escape scaled-x16 4-bit: 3 values read back differ from the bf16 written"]


def test_an_error_above_fa3s_fails() -> None:
    result = passing()
    result["attention_accuracy"][1]["fa3_rel_err"] = 1.7399e-3  # ours 1.74e-3
    fails = judge(result)
    assert len(fails) == 2 and all("above FlashAttention 3's" in f and "2 x 32768" in f for f in fails)


@pytest.mark.parametrize(("key", "value", "expect"), [
    ("code4_nan", True, "NaN"), ("code4_rel_err", math.nan, "NaN"), ("code4_same_bits_twice", False, "differs"),
    ("fa3_rel_err", None, "no FlashAttention 3 error"), ("fa3_sched_same_bits", False, "scheduled"),
    ("fa3_sched_rel_err", 9e-3, "not of the same function"), ("error", "OOM", "error OOM"),
])
def test_each_accuracy_check_fails_on_its_own(key: str, value: object, expect: str) -> None:
    result = passing()
    row = result["attention_accuracy"][0]
    if value is None:
        del row[key]
    else:
        row[key] = value
    fails = judge(result)
    assert len(fails) == 1 and expect in fails[0], fails


def test_no_accuracy_cases_fail() -> None:
    result = passing()
    result["attention_accuracy"] = []
    assert judge(result) == ["accuracy: no accuracy cases run"]


def test_a_missing_cell_or_column_fails() -> None:
    result = passing()
    result["rows"] = [r for r in result["rows"] if (r["batch"], r["context"]) != (8, 8192)]
    assert judge(result) == ["batch 8 x context 8192: missing cell (not timed)"]
    result = passing()
    del _cell(result, 128, 1024)["code3_ms"]
    _cell(result, 1, 32768)["code4_ms"] = math.nan
    assert judge(result) == ["batch 1 x context 32768: 4-bit code not timed",
                             "batch 128 x context 1024: 3-bit code not timed"]
    result = passing()
    for k in gb.FA3_COLUMNS:
        del _cell(result, 32, 1024)[k]
    assert judge(result) == ["batch 32 x context 1024: no FlashAttention 3 time"]


def test_an_errored_row_or_column_fails() -> None:
    result = passing()
    _cell(result, 64, 1024)["error"] = "RuntimeError('capture')"
    _cell(result, 8, 1024)["fa3_sched_error"] = "RuntimeError('no metadata')"
    assert judge(result) == ["batch 8 x context 1024: fa3_sched failed: RuntimeError('no metadata')",
                             "batch 64 x context 1024: error RuntimeError('capture')"]


def test_a_run_without_fa3_cannot_pass() -> None:
    result = passing()
    result["fa3"] = {"available": False, "reason": "--no-fa3"}
    for row in result["rows"] + [r for reg in result["high_escape"] for r in reg["rows"]]:
        for k in gb.FA3_COLUMNS:
            row.pop(k)
    for acc in [result["attention_accuracy"]] + [reg["accuracy"] for reg in result["high_escape"]]:
        for row in acc:
            for k in ("fa3_rel_err", "fa3_nan", "fa3_sched_rel_err", "fa3_sched_same_bits"):
                row.pop(k)
    fails = judge(result)
    assert fails == ["FlashAttention 3 was not run (--no-fa3 or unavailable): the bars against it are not judged"]


def test_the_high_escape_regime_must_be_high_run_and_timed() -> None:
    result = passing()
    result["high_escape"][0]["codes"]["code4"]["escape_rate"] = 0.0099
    assert judge(result) == ["high-escape other-tables: 4-bit escape rate 0.0099 under 1%: not a high-escape regime"]
    result = passing()
    result["high_escape"][0]["rows"].pop()
    assert judge(result) == ["high-escape other-tables batch 64 x context 8192: missing cell (not timed)"]
    result = passing()
    result["high_escape"] = []
    assert judge(result) == ["no high-escape regime run"]
    result = passing()
    result["high_escape"][1] = {"name": "scaled-x16", "error": "ArenaFullError()"}
    assert judge(result) == ["high-escape scaled-x16: error ArenaFullError()"]
    result = passing()  # a code the arena refuses fails once, by name; the other code is still judged in full
    reg = result["high_escape"][0]
    reg["refused"] = {"code3": "after 458752 of 524288 tokens: MemoryError"}
    del reg["codes"]["code3"]
    for row in [*reg["rows"], *reg["accuracy"]]:
        for k in [k for k in row if k.startswith("code3")]:
            row.pop(k)
    assert judge(result) == ["high-escape other-tables: 3-bit code refused by the overflow arena "
                             "(after 458752 of 524288 tokens: MemoryError)"]
    reg["rows"][0].pop("code4_ms")
    assert judge(result)[1:] == ["high-escape other-tables batch 1 x context 8192: 4-bit code not timed"]
    assert judge(passing(), high=[]) == ["no high-escape regime timed (--high-escape-cells empty) in a full-grid run"]


def test_a_subset_run_is_judged_on_its_cells_and_is_no_full_grid() -> None:
    result = passing()
    result["rows"] = [_cell(result, 1, 8192)]
    result["high_escape"] = [{**reg, "rows": reg["rows"][:1]} for reg in result["high_escape"]]
    assert judge(result, cells=[(1, 8192)], high=[(1, 8192)]) == []
    assert not gb.full_grid(gb.GRID_CODES, [(1, 8192)]) and not gb.full_grid([4], gb.GRID)
    bad = copy.deepcopy(result)
    _cell(bad, 1, 8192)["code3_ms"] = 1.0  # 1.00x FA3
    assert judge(bad, cells=[(1, 8192)], high=[(1, 8192)]) == [
        "batch 1 x context 8192: 3-bit 1.0000x FlashAttention 3, bar 1.05x"]


def test_cells_parse_and_refuse_what_is_not_a_cell() -> None:
    assert gb.parse_cells("1x8192, 64X8192") == [(1, 8192), (64, 8192)]
    assert gb.parse_cells("") == []
    for bad in ("8192", "1x", "0x1024", "ax8"):
        with pytest.raises(ValueError, match="BATCHxCONTEXT"):
            gb.parse_cells(bad)


def test_the_bf16_cache_attention_time_prefers_fa3() -> None:
    assert gb.bf16_attention_ms({"fa3_ms": 0.5, "fa3_sched_ms": 0.4, "vllm_ms": 0.7}) == 0.4
    assert gb.bf16_attention_ms({"fa3_ms": math.nan, "vllm_ms": 0.7}) == 0.7
    assert gb.bf16_attention_ms({}) is None


def test_the_bench_parses_its_options_without_a_gpu() -> None:
    """`bench/gpu.py --help` and its option parsing run on a machine without a GPU; --quick is one cell."""
    help_text = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--help"], capture_output=True,
                               text=True, check=True, timeout=300).stdout
    assert "--quick" in help_text and "--no-fa3" in help_text
    gpu = _load("gpu")
    quick = gpu.parse_args(["--quick"])
    assert quick.cells == [(1, 8192)] and quick.high_escape_cells == [(1, 8192)]
    assert quick.no_model and quick.no_writes and quick.graph_batches == []
    full = gpu.parse_args([])
    assert gb.full_grid(full.codes, full.cells) and full.high_escape_cells == HIGH_CELLS
    assert gpu.parse_args(["--cells", "64x8192,128x32768"]).cells == [(64, 8192), (128, 32768)]
    with pytest.raises(SystemExit):
        gpu.parse_args(["--cells", "64"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--codes", "5"])


def test_the_benchmarks_time_this_trees_kernels_and_refuse_others() -> None:
    """bench/tree.py binds glyd_kernels to this tree's kernels/ whether installed or not, and refuses a glyd_kernels
    already imported from elsewhere (an older install on the device)."""
    code = ("import sys, types; sys.path.insert(0, {root!r}); from bench.tree import bind_kernels; {pre}"
            "bind_kernels(); import glyd_kernels.nvrtc as n; print(n.__file__)")
    ok = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), pre="")], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and Path(ok.stdout.strip()) == ROOT / "kernels" / "nvrtc.py", ok.stderr
    stale = ("m = types.ModuleType('glyd_kernels'); m.__file__ = '/tmp/site/glyd_kernels/__init__.py'; "
             "sys.modules['glyd_kernels'] = m; ")
    bad = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), pre=stale)], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "not from this tree's" in bad.stderr


def _linear(margin: float = 1.01) -> dict[str, Any]:
    """A gpu_linear.json that clears the matmul bars by `margin` at every shape and row count."""
    result: dict[str, Any] = {"table": []}
    for name in gb.LINEAR_SHAPES:
        result[f"checks_{name}"] = {"fragment_decode_bit_exact": True, "resident_decode_bit_exact": True,
                                    **{f"cuda_m{m}_ok": True for m in gb.LINEAR_ROWS}}
        for m in gb.LINEAR_ROWS:
            bar = gb.BARS.linear_few if m <= gb.BARS.linear_few_rows else gb.BARS.linear_many
            result["table"].append({"shape": name, "M": m, "cublas_ms": 0.05, "cuda_ms": 0.05 / (bar * margin)})
        result["table"].append({"shape": name, "M": 512, "cublas_ms": 0.5, "cuda_ms": 1.0})  # prefill: not judged
    result["checks_embedding"] = {"gather_m1_bit_exact": True, "gather_m1_ms": 0.01}
    return result


def _linear_row(result: dict[str, Any], name: str, m: int) -> dict[str, Any]:
    return next(r for r in result["table"] if (r["shape"], r["M"]) == (name, m))


def test_the_matmul_bars() -> None:
    shapes, rows = gb.LINEAR_SHAPES, gb.LINEAR_ROWS
    assert gb.linear_failures(_linear(), shapes, rows) == []
    result = _linear()
    _linear_row(result, "down", 16)["cuda_ms"] = 0.05 / (1.25 * 0.9999)
    _linear_row(result, "qkv", 17 if 17 in rows else 32)["cuda_ms"] = 0.05 / 0.9999
    assert gb.linear_failures(result, shapes, rows) == ["qkv at 32 rows: 0.9999x cuBLAS, bar 1.00x",
                                                        "down at 16 rows: 1.2499x cuBLAS, bar 1.25x"]
    result = _linear()
    result["checks_o"]["cuda_m8_ok"] = False
    result["checks_embedding"]["gather_m1_bit_exact"] = False
    result["table"] = [r for r in result["table"] if (r["shape"], r["M"]) != ("gate_up", 128)]
    assert gb.linear_failures(result, shapes, rows) == ["o: cuda_m8_ok failed", "embedding: gather_m1_bit_exact failed",
                                                        "gate_up at 128 rows: not timed"]
    del result["checks_qkv"]
    assert "qkv: fragment decode not checked bit for bit" in gb.linear_failures(result, shapes, rows)
