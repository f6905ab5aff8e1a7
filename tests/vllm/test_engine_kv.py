"""The real engine (vLLM CPU build, demo model, eager) with the Glyd KV cache against vLLM's own.

Three engines at the same fixed KV memory (off; lossless and exact with the read-back check: every value a
forward reads is compared bit for bit with a bf16 shadow of what was written), and a lossless one under a
small cache for the stress workload. The CPU path decodes every page a step reads in plain torch (~4 ms a
128-token page of one layer on this machine), so workloads are kept small.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from glyd_engine.bench.kv import bits_equal
from tests.vllm.conftest import CHUNK, GREEDY, LONG, MAX_LEN, PREFIX, engine

pytestmark = pytest.mark.slow

# More than a 5-block cache holds at once: preemption, chunked prefill (64-token steps), prefix hits.
STRESS = {"n": 6, "prefix": 150, "tail": 100, "extra": [560, 300], "max_tokens": 16}  # 250 + 16 crosses a block
SMALL = {"kv_bytes": 12 * 1024 * 1024, "max_model_len": 640, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def lossless(demo_model_dir: Path) -> dict[str, Any]:
    return engine({"model": demo_model_dir, "mode": "lossless", "check": True, "max_model_len": MAX_LEN,
                   "max_num_batched_tokens": CHUNK, "work": {"logprobs": [LONG], "greedy": GREEDY}})


@pytest.fixture(scope="module")
def stressed(demo_model_dir: Path) -> dict[str, Any]:
    return engine({"model": demo_model_dir, "mode": "lossless", "check": True, **SMALL,
                   "work": {"stress": STRESS}})


@pytest.fixture(scope="module")
def exact(demo_model_dir: Path) -> dict[str, Any]:
    return engine({"model": demo_model_dir, "mode": "exact", "check": True, "max_model_len": MAX_LEN,
                   "work": {"prefix": PREFIX}})


def _logged_tokens(log: str) -> int:
    m = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    assert m, "vLLM did not log its KV cache size"
    return int(m.group(1).replace(",", ""))


def test_capacity_ratio(off: dict, lossless: dict, demo_model_dir: Path) -> None:
    """vLLM's own accounting (num_gpu_blocks x block size, and its log line) holds >= 1.40x the tokens."""
    for run in (off, lossless):  # vLLM's log line reports one token less than blocks x block size
        assert _logged_tokens(run["log"]) in (run["kv_tokens"] - 1, run["kv_tokens"])
    assert lossless["kv_tokens"] / off["kv_tokens"] >= 1.40, (off["kv_tokens"], lossless["kv_tokens"])
    # bytes a token as the status reports them (`glyd bench kv`): bf16's, and C a KV head for the pages
    from glyd_engine.vllm_plugin import settings, state

    assert off["kv_bytes_per_token"] == 30 * 3 * (64 + 64) * 2
    c = state.load_tables(str(demo_model_dir)).token_bytes(settings.code_bits())
    assert lossless["kv_bytes_per_token"] == 30 * 3 * c < off["kv_bytes_per_token"] / 1.4
    assert "Glyd KV cache: lossless" in lossless["log"]


def test_prompt_logprobs_bit_identical(off: dict, lossless: dict) -> None:
    assert len(off["prompt_logprobs"][0]) == LONG - 1
    assert bits_equal(off, lossless)


def test_greedy_tokens_equal(off: dict, lossless: dict) -> None:
    assert lossless["greedy"] == off["greedy"]


def test_every_value_read_is_the_value_written(lossless: dict) -> None:
    s = lossless["stats"]
    # the second and third chunks of the LONG prompt read the CHUNK and 2 CHUNK tokens before them from the pages
    assert s["values_checked"] >= 3 * CHUNK * 30 * 3 * 64 * 2 and LONG > 2 * CHUNK, s
    assert s["values_differing"] == 0, s
    assert s["escapes"] > 0 and s["layers"] == 30, s
    assert 0 < s["escapes_held"] <= s["escapes"], s  # the pages' trailers hold what the writer wrote, less rewrites


def test_stress_completes_and_reads_back_exact(stressed: dict) -> None:
    s = stressed["stats"]
    assert s["values_checked"] > 0 and s["values_differing"] == 0, s
    st, metrics = stressed["stress"], stressed["metrics"]
    assert st["completed"] == st["requests"] == STRESS["n"] + len(STRESS["extra"])
    preempted = sum(v for k, v in metrics.items() if "preempt" in k)
    hits = sum(v for k, v in metrics.items() if "prefix_cache_hits" in k)
    assert preempted > 0, metrics
    assert hits > 0, metrics


def test_exact_prefix_hits_equal_off(off: dict, exact: dict) -> None:
    assert len(exact["prefix_greedy"]) == PREFIX["n"]
    assert exact["prefix_greedy"] == off["prefix_greedy"]
    assert exact["stats"]["values_differing"] == 0
    hits = sum(v for k, v in exact["metrics"].items() if "prefix_cache_hits" in k)
    assert hits > 0, exact["metrics"]
