"""The bench commands' verdicts: what crosses from an engine child to the parent, and the exit codes.

No engine runs here: the child's entry point and the commands' verdicts are exercised on results made up for
the purpose (a NaN payload, outputs that differ); tests/vllm runs the real engines through the same code."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from glyd_engine.bench import kv
from glyd_engine.cli import main


def _nan(payload: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000 | payload))[0]


def _through_child(capsys: pytest.CaptureFixture[str], logprobs: list[list[float]]) -> dict[str, Any]:
    """What `run_engine` gets back from a child whose prompt logprobs were `logprobs`."""
    kv.child_main(["--child", json.dumps({"mode": "off"})], run=lambda spec: {"prompt_logprobs": logprobs})
    out = kv.parse_result(capsys.readouterr().out)
    assert out is not None
    return out


def test_a_nan_payload_difference_survives_the_child_boundary(capsys: pytest.CaptureFixture[str]) -> None:
    a = _through_child(capsys, [[-1.25, _nan(1), -0.0]])
    b = _through_child(capsys, [[-1.25, _nan(2), -0.0]])
    # JSON gives the parent one NaN for both: the floats cannot tell them apart, the bit patterns can.
    assert struct.pack("<d", a["prompt_logprobs"][0][1]) == struct.pack("<d", b["prompt_logprobs"][0][1])
    assert not kv.bits_equal(a, b)
    assert kv.bits_equal(a, _through_child(capsys, [[-1.25, _nan(1), -0.0]]))
    assert not kv.bits_equal(a, _through_child(capsys, [[-1.25, _nan(1), 0.0]]))  # -0.0 is not 0.0
    assert not kv.bits_equal({}, {})  # no logprobs is no evidence


def _rare_result(outputs_equal_off: bool) -> dict[str, Any]:
    lossless = {"requests": 2, "completed": 2, "values_checked": 10, "values_differing": 0}
    return {"off": {"requests": 2, "completed": 2}, "lossless": lossless, "read_back_check": True,
            "outputs_equal_off": outputs_equal_off}


@pytest.mark.parametrize(("equal", "code"), [(True, 0), (False, 1)])
def test_bench_rare_fails_when_outputs_differ_from_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str], equal: bool,
                                                       code: int) -> None:
    import glyd_engine.bench.rare_tokens as rare
    import glyd_engine.models as models

    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: tmp_path)
    monkeypatch.setattr(rare, "run_rare_bench", lambda *a, **k: _rare_result(equal))
    assert main(["bench", "rare", "--json"]) == code
    assert json.loads(capsys.readouterr().out)["outputs_equal_off"] is equal


def test_bench_rare_fails_when_the_engines_were_served_other_prompts(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    import glyd_engine.bench.rare_tokens as rare
    import glyd_engine.models as models

    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: tmp_path)
    monkeypatch.setattr(rare, "run_rare_bench", lambda *a, **k: {**_rare_result(True), "prompts_equal": False})
    assert main(["bench", "rare", "--json"]) == 1


def _top2(a: int, la: float, b: int, lb: float) -> list[list]:
    return [[a, la, struct.pack("<d", la).hex()], [b, lb, struct.pack("<d", lb).hex()]]


def test_rare_comparison_lists_the_differing_tokens_with_their_margins() -> None:
    from glyd_engine.bench.rare_tokens import compare_outputs

    off = {"outputs": [[5, 6], [7, 8], [9, 9]],
           "top2": [[_top2(5, -1.0, 4, -1.5), _top2(6, -2.0, 3, -2.0)], [_top2(7, -1.0, 2, -3.0)] * 2,
                    [_top2(9, -0.5, 1, -2.5)] * 2]}
    glyd = {"outputs": [[5, 3], [2, 8], [9, 9]],
            "top2": [[_top2(5, -1.0, 4, -1.5), _top2(3, -2.0, 6, -2.0)], [_top2(2, -1.5, 7, -1.5)] * 2,
                     [_top2(9, -0.5, 1, -2.5)] * 2]}
    c = compare_outputs(off, glyd, n_rare=1)
    assert (c["tokens_compared"], c["tokens_differing"], c["prompts_differing"]) == (6, 2, [0, 1])
    assert c["differing"][0] == {"prompt": 0, "kind": "rare", "step": 1, "off": 6, "lossless": 3,
                                 "after_diff": False, "off_margin": 0.0, "lossless_margin": 0.0}
    assert c["differing"][1]["kind"] == "ordinary" and c["differing"][1]["off_margin"] == 2.0
    assert c["logprobs_equal_off"] is False
    same = compare_outputs(off, off, n_rare=1)
    assert same["tokens_differing"] == 0 and same["logprobs_equal_off"] is True
    assert compare_outputs({"outputs": [[1]]}, {"outputs": [[1]]}, 1)["logprobs_equal_off"] is None


def test_rare_tokens_do_not_depend_on_the_random_state(tmp_path: Path) -> None:
    """The list (and its order, which rare_prompts draws by) is the same in every process: no randomized PCA."""
    import torch
    from safetensors.torch import save_file

    from glyd_engine.bench.rare_tokens import find_rare_tokens

    g = torch.Generator().manual_seed(1)
    rows = torch.randn(64, 16, generator=g)
    rows[:4] = rows[0] + 0.01 * torch.randn(4, 16, generator=g)  # the never-trained special tokens
    rows[40:44] = rows[0]  # untrained ordinary tokens: identical rows, exact ties
    save_file({"model.embed_tokens.weight": rows.to(torch.bfloat16)}, str(tmp_path / "model.safetensors"))

    class Tok:
        all_special_ids = [0, 1, 2, 3]
        added_tokens_decoder: dict = {}

        def __len__(self) -> int:
            return 64

        def convert_ids_to_tokens(self, i: int) -> str:
            return f"t{i}"

        def decode(self, ids: list[int]) -> str:
            return f"t{ids[0]}"

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            return {"input_ids": [int(text[1:])]}

    lists = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        lists.append([t["id"] for t in find_rare_tokens(tmp_path, 8, Tok())])
    assert lists[0] == lists[1] == lists[2]
    assert lists[0][:4] == [40, 41, 42, 43]  # ties in id order


def _engine_gpu() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "engine_gpu.py"
    spec = importlib.util.spec_from_file_location("engine_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_engine_gpu_verdicts_count_every_differing_bit() -> None:
    """The GPU engine bench compares logprobs by their bits (-0.0 is not 0.0) and fails a mode that promised
    equality for any differing logprob, token or value, or for comparing nothing."""
    eg = _engine_gpu()
    d = eg._diff([[0.0, -1.5, -2.25]], [[-0.0, -1.5, -2.0]])
    assert d == {"positions": 3, "differing": 2, "max_abs_diff": 0.25}
    ref = {"kv_tokens": 100, "prompt_logprobs": [[-1.0, -2.0]], "greedy": [[1, 2], [3]], "prefix_greedy": [[4]]}
    same = eg.compare(ref, {**ref, "kv_tokens": 133, "stats": {"values_checked": 9, "values_differing": 0}})
    assert same["capacity_vs_ref"] == 1.33 and same["greedy_equal"] == "2/2"
    promise = {"name": "m", "expect": ["logprobs", "greedy", "values"]}
    assert eg.verdict(promise, same) == []
    off_by_one = eg.compare(ref, {**ref, "greedy": [[1, 2], [4]], "stats": {"values_checked": 9,
                                                                              "values_differing": 1}})
    assert eg.verdict(promise, off_by_one) == ["m: greedy_equal 1/2", "m: 1 of 9 values read back differ"]
    nothing = eg.compare(ref, {"kv_tokens": 1})
    assert len(eg.verdict(promise, nothing)) == 4  # no logprobs, no tokens, no values compared: all fail
    eager = eg.compare({**ref, "compilation_mode": "VLLM_COMPILE"}, {**ref, "compilation_mode": "NONE"})
    assert eager["prompt_logprobs"]["not_compared"] == "NONE against the reference's VLLM_COMPILE"
    assert eager["greedy_equal"] == "0/0" and len(eg.verdict(promise, eager)) == 4  # a promise across builds fails
    stress = {"name": "s", "expect": ["values", "preempted"]}
    ran = {"kv_tokens": 1, "stats": {"values_checked": 9, "values_differing": 0},
           "stress": {"requests": 3, "completed": 3}, "metrics": {"vllm:num_preemptions": 2}}
    assert eg.verdict(stress, eg.compare(ref, ran)) == []
    calm = eg.compare(ref, {**ran, "metrics": {"vllm:num_preemptions": 0}})
    assert eg.verdict(stress, calm) == ["s: no preemption or unfinished requests (0 preempted, 3 of 3 completed)"]


def test_engine_gpu_writes_its_json_after_every_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU call killed at its time limit keeps the engines that finished: the JSON is rewritten after each."""
    eg = _engine_gpu()
    seen: list[list[str]] = []

    def fake_run(spec: dict, timeout: float, log: Path) -> dict:
        if spec["name"] == "exact":
            raise RuntimeError("engine child killed after 9 s")
        path = tmp_path / "engine_demo.json"
        seen.append(sorted(json.loads(path.read_text())["results"]) if path.exists() else [])
        return {"kv_tokens": 100, "start_s": 1.0}

    monkeypatch.setattr(eg, "run_engine", fake_run)
    assert eg.main(["--model", "m", "--only", "lossless,exact,lossless-check", "--out", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "engine_demo.json").read_text())
    assert seen == [[], ["off"], ["lossless", "off"]] and doc["complete"] is True
    assert sorted(doc["results"]) == ["lossless", "lossless-check", "off"]
    assert any("exact: engine child killed" in f for f in doc["failures"])


def test_an_engine_child_killed_at_its_timeout_leaves_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that outlives its timeout is killed; what it printed before is in the log and in the error (the GPU
    runs' slow starts were otherwise lost)."""
    (tmp_path / "slow_child.py").write_text("import sys, time\nprint('loading weights', flush=True)\n"
                                            "print('compiling graphs', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError, match=r"killed after 2 s(.|\n)*loading weights(.|\n)*compiling graphs"):
        kv.run_engine({"model": "m", "mode": "off"}, timeout=2, log=log, module="slow_child")
    assert "loading weights" in log.read_text() and "compiling graphs" in log.read_text()


def test_kernel_times_puts_the_largest_first_and_sums_the_rest() -> None:
    """The profile of a decode cell: kernels by total time, shares of the whole, the tail summed in one row."""
    import torch

    from glyd_engine.bench.kernel_times import format_kernel_times, kernel_times

    a = torch.randn(768, 768)  # the matmul ~50x its relu's time: first even on a busy 2-core machine
    prof = kernel_times(lambda: [(a @ a).relu_().sum() + torch.ones(3).cos().sum() for _ in range(4)], top=2)
    names = [r["name"] for r in prof["kernels"]]
    assert prof["device"] == "cpu" and names[0] == "aten::mm" and prof["kernels"][0]["calls"] == 4
    assert len(names) == 3 and names[2].endswith(" others)")
    assert abs(sum(r["share"] for r in prof["kernels"]) - 1) < 1e-3
    assert format_kernel_times("cell", prof).splitlines()[1].endswith("aten::mm")


class _Tok:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


class _Engine:
    """Stands in for vLLM's LLM in the sweep's bookkeeping: each prompt gets `max_tokens` tokens."""

    def generate(self, prompts: list[Any], sp: Any, use_tqdm: bool = False) -> list[Any]:
        from types import SimpleNamespace

        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * sp.max_tokens)]) for _ in prompts]


def test_the_sweep_profiles_the_cells_asked_and_marks_what_does_not_fit() -> None:
    pytest.importorskip("vllm")
    sweep = {"contexts": [64, 512], "batches": [1, 4], "max_tokens": 8, "largest": [64],
             "profile": [[64, 4], [64, "max"]]}
    rows = kv.decode_sweep(_Engine(), _Tok(), sweep, kv_tokens=1200)
    cells = [(r["context"], r["batch"], r["fits"], "profile" in r) for r in rows]
    # a sequence takes context + 8 new + 16 tokens: 1200 hold one of 536, not four; the largest batch at 64 is 13
    assert cells == [(64, 1, True, False), (64, 4, True, True), (64, 13, True, True), (512, 1, True, False),
                     (512, 4, False, False)]
    assert all(r["decode_tokens_per_s"] > 0 and len(r["runs_tokens_per_s"]) == 3 for r in rows if r["fits"])
    assert rows[1]["profile"]["device"] == "cpu" and rows[1]["profile"]["total_ms"] >= 0


def test_engine_gpu_profile_cells_reach_the_sweeps_and_bad_ones_are_refused() -> None:
    eg = _engine_gpu()
    specs = eg.plans("/m", 2, 64)["speed"]
    got = eg.with_cells(specs, "8192x32,8192xmax", "profile")
    assert all(s["work"]["sweep"]["profile"] == [[8192, 32], [8192, "max"]] for s in got)
    assert "profile" not in specs[0]["work"]["sweep"]  # the plan itself is left as it was
    demo = eg.plans("/m", 2, 64, "/p")["demo"]
    assert eg.with_cells(demo, "1024x1", "cells") == demo  # no sweep, nothing to restrict
    with pytest.raises(SystemExit, match="--cells .*CONTEXTxBATCH"):
        eg.with_cells(specs, "8192-32", "cells")


def test_the_sweep_runs_only_the_cells_asked() -> None:
    pytest.importorskip("vllm")
    sweep = {"contexts": [64, 512], "batches": [1, 4], "max_tokens": 8, "largest": [64], "cells": [[64, "max"],
                                                                                                  [512, 1]]}
    rows = kv.decode_sweep(_Engine(), _Tok(), sweep, kv_tokens=1200)
    assert [(r["context"], r["batch"], r["largest"]) for r in rows] == [(64, 13, True), (512, 1, False)]


def test_the_stress_cache_is_short_of_its_requests_on_any_model(tmp_path: Path) -> None:
    """The stress engine's KV memory follows the model's bf16 token size, so an 8B-shaped model gets ~720 tokens
    too, not a cache smaller than one request."""
    eg = _engine_gpu()
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 36, "num_attention_heads": 32,
                                                      "num_key_value_heads": 8, "head_dim": 128,
                                                      "hidden_size": 4096}))
    stress = next(s for s in eg.plans(str(tmp_path), 2, 64, "")["demo"] if s["name"] == "lossless-stress")
    assert stress["kv_bytes"] == 540 * 36 * 8 * 128 * 4
    demo = next(s for s in eg.plans("/no/such/model", 2, 64, "")["demo"] if s["name"] == "lossless-stress")
    assert demo["kv_bytes"] == 540 * 23040 and demo["kv_bytes"] // 17460 >= demo["max_model_len"]


def test_an_earlier_reference_is_taken_only_from_the_same_plan_and_gpu(tmp_path: Path) -> None:
    """The speed plan's engines do not fit one GPU call: a later call takes the reference row an earlier call wrote,
    on a GPU of the same name only."""
    import torch

    eg = _engine_gpu()
    here = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    row = {"kv_tokens": 100, "sweep": []}
    doc = tmp_path / "engine_speed.json"
    doc.write_text(json.dumps({"plan": "speed", "device": here, "date": "d", "results": {"off": row}}))
    got = eg.earlier_reference(doc, "speed", "off")
    assert got["kv_tokens"] == 100 and got["reference_from"].endswith("(d)")
    with pytest.raises(SystemExit, match="no 'off' engine of plan 'demo'"):
        eg.earlier_reference(doc, "demo", "off")
    doc.write_text(json.dumps({"plan": "speed", "device": "another GPU", "results": {"off": row}}))
    with pytest.raises(SystemExit, match="run the reference here"):
        eg.earlier_reference(doc, "speed", "off")
