"""The real engine (vLLM CPU build, eager) under tensor and pipeline parallelism, size 2: a tiny model the test makes
(4 layers, 4 query and 2 KV heads of size 64, the demo tokenizer; the demo model's 3 KV heads do not split in two).

Four engines, each started once: bf16 with vLLM's own cache at TP=2 and at PP=2 (the references), and the Glyd
checkpoint with the lossless cache and the read-back check at TP=2 and at PP=2 (the eager Glyd matmul gives the bf16
model's products, and the lossless cache off's values, so the pair must equal the reference bit for bit). Each is
compared with the reference of its own layout (TP and PP sum in different orders, so their logprobs differ from each
other in the last bits).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from glyd_engine.bench.kv import bits_equal
from glyd_engine.format.checkpoint import read_header
from tests.conftest import TEST_HOME
from tests.tiny_models import make_tiny_engine_llama
from tests.vllm.conftest import engine

pytestmark = pytest.mark.slow

KV_BYTES = 16 * 1024 * 1024  # a worker's: 128 blocks of 128 tokens of bf16 (4 layers x 1 KV head, or 2 x 2)
WORK = {"logprobs": [300], "greedy": {"prompts": [40], "max_tokens": 8}}
TP, PP = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}


def _bind_two_workers() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for two workers: vLLM's default binds a worker a NUMA node and refuses two
    workers on one node (`Not enough allowed NUMA nodes`), so each gets half the cores (both the one core if one)."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    first, second = cores[:half], cores[half:] or cores[:half]
    return "|".join(",".join(map(str, c)) for c in (first, second))


@pytest.fixture(scope="module")
def models(demo_model_dir: Path) -> dict[str, Path]:
    from glyd_engine.cli import main

    bf16 = TEST_HOME / "cache" / "tiny-parallel"
    if not (bf16 / "model.safetensors").exists():
        make_tiny_engine_llama(bf16, demo_model_dir)
    packed = TEST_HOME / "cache" / "tiny-parallel-glyd"
    assert main(["pack", str(bf16), str(packed), "--force"]) == 0
    return {"bf16": bf16, "glyd": packed}


def _run(model: Path, mode: str, layout: dict[str, int], **extra: Any) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", _bind_two_workers())
        return engine({"model": model, "mode": mode, "kv_bytes": KV_BYTES, "max_model_len": 1024, "work": WORK,
                       **layout, **extra})


@pytest.fixture(scope="module")
def off_tp(models: dict[str, Path]) -> dict[str, Any]:
    return _run(models["bf16"], "off", TP)


@pytest.fixture(scope="module")
def glyd_lossless_tp(models: dict[str, Path]) -> dict[str, Any]:
    return _run(models["glyd"], "lossless", TP, check=True, quantization="glyd")


@pytest.fixture(scope="module")
def off_pp(models: dict[str, Path]) -> dict[str, Any]:
    return _run(models["bf16"], "off", PP)


@pytest.fixture(scope="module")
def glyd_lossless_pp(models: dict[str, Path]) -> dict[str, Any]:
    return _run(models["glyd"], "lossless", PP, check=True, quantization="glyd")


def _tops_digest(tables: Any, layers: range, heads: range) -> str:
    part = tables.select(layers, heads)
    h = hashlib.sha256()
    for bits in sorted(part.tops):
        h.update(part.tops[bits].contiguous().numpy().tobytes())
    return h.hexdigest()


def test_tp_glyd_checkpoint_and_lossless_equal_bf16_and_off(off_tp: dict, glyd_lossless_tp: dict,
                                                           models: dict[str, Path]) -> None:
    run = glyd_lossless_tp
    assert len(off_tp["prompt_logprobs"][0]) == WORK["logprobs"][0] - 1
    assert bits_equal(off_tp, run)
    assert run["greedy"] == off_tp["greedy"]
    assert run["kv_tokens"] / off_tp["kv_tokens"] >= 1.40, (off_tp["kv_tokens"], run["kv_tokens"])
    s = run["stats"]
    assert s["values_checked"] > 0 and s["values_differing"] == 0, s
    assert s["layers"] == 2 * 4 and s["escapes"] > 0, s  # both ranks' 4 attention layers wrote and were read
    header = read_header(next(models["glyd"].glob("glyd-*.safetensors")))
    packed = sum(info["shape"][0] for name, info in header.items() if name.endswith("_glyd_sm"))
    ranks = run["weights_by_rank"]
    # every packed tensor is split in two (2 KV heads: none replicated), held compressed, none as bf16
    assert sum(r["glyd_weight_values"] for r in ranks) == packed
    assert all(r["glyd_weight_tensors"] == 1 + 4 * 4 for r in ranks)  # embedding (tied head) + qkv/o/gate_up/down


def test_tp_ranks_hold_their_kv_heads_tables(glyd_lossless_tp: dict, models: dict[str, Path]) -> None:
    """The checkpoint answers with its source's fingerprint: each rank selects its KV heads from the same tables."""
    from glyd_engine.tables import ensure_tables

    whole = ensure_tables(models["bf16"])
    shares = glyd_lossless_tp["kv_shares"]
    assert [(s["layers"], s["kv_heads"]) for s in shares] == [([0, 4], [0, 1]), ([0, 4], [1, 2])]
    for s in shares:
        assert s["tops_sha256"] == _tops_digest(whole, range(*s["layers"]), range(*s["kv_heads"]))
        assert s["token_bytes"]["3"] == whole.token_bytes(3)  # the same page size on every rank


def test_pp_glyd_checkpoint_and_lossless_equal_bf16_and_off(off_pp: dict, glyd_lossless_pp: dict,
                                                           models: dict[str, Path]) -> None:
    run = glyd_lossless_pp
    assert bits_equal(off_pp, run)
    assert run["greedy"] == off_pp["greedy"]
    assert run["kv_tokens"] / off_pp["kv_tokens"] >= 1.40
    s = run["stats"]
    assert s["values_checked"] > 0 and s["values_differing"] == 0 and s["layers"] == 4, s
    from glyd_engine.tables import ensure_tables

    whole = ensure_tables(models["bf16"])  # the checkpoint answers with its source's fingerprint: the same tables
    shares = run["kv_shares"]
    assert [(s["layers"], s["kv_heads"]) for s in shares] == [([0, 2], [0, 2]), ([2, 4], [0, 2])]
    for s in shares:
        assert s["tops_sha256"] == _tops_digest(whole, range(*s["layers"]), range(*s["kv_heads"]))
    # each stage holds its 2 layers' 4 weights and the embedding (the first looks up, the last's tied head reads it)
    assert [r["glyd_weight_tensors"] for r in run["weights_by_rank"]] == [1 + 2 * 4, 1 + 2 * 4]
