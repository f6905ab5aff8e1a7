"""Rare prompts, CI-sized: prompts made of the demo model's least-trained tokens (glyd_engine.bench.rare_tokens) served
beside ordinary ones by the real engine, lossless, with the read-back check on (every value a forward reads is
compared bit for bit with a bf16 shadow of what was written), and the overflow arena limited (GLYD_KV_ARENA_MB) so
that a short rare prompt fits it and long ones do not. One engine, three phases: the short rare prompt completes
through the overflow path; the long ones are refused alone; ordinary prompts complete after them. The worker runs in
a process of its own (vLLM's `mp` executor, as the CPU build's `vllm serve` runs its worker), so its reports and the
scheduler's releases cross processes (refusals.py); the engine core stays in the child (`vllm serve` runs it in one
more), so the schedule is the same run to run. The full-size run (40 x ~1,400 + 8 ordinary, off against lossless, no
limit) is `glyd bench rare`; docs/benchmarks.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import KV_BYTES

pytestmark = pytest.mark.slow

RARE = {"n": 5, "length": 400, "ordinary": 4, "ordinary_length": 400, "max_tokens": 4}  # prompts 0-4 rare, 5-8 not
ARENA_MB = "0.004"  # 2,000 entries a layer: a 96-token rare prompt's overflow fits beside two ordinary prompts' own,
SHORT = 96  # and a 400-token one's does not
PLAN = [[5, 6], [[0, SHORT]], [1, 2, 3, 4], [7, 8, 1]]  # ordinary, the short rare one, the long ones, ordinary again


@pytest.fixture(scope="module")
def rare_run(demo_model_dir: Path) -> dict[str, Any]:
    from glyd_engine.bench.rare_tokens import run_engine

    return run_engine({"model": demo_model_dir, "mode": "lossless", "check": True, "kv_bytes": KV_BYTES,
                       "max_model_len": 1024, "arena_mb": ARENA_MB, "executor": "mp",
                       "rare": {**RARE, "phases": PLAN}}, timeout=600)


def test_rare_tokens_found(demo_model_dir: Path) -> None:
    from glyd_engine.bench.rare_tokens import find_rare_tokens

    rare = find_rare_tokens(demo_model_dir, 64)
    assert len(rare) == 64
    ids = [t["id"] for t in rare]
    assert len(set(ids)) == 64 and all(i > 16 for i in ids)  # no special or control token
    tokens = {t["token"] for t in rare[:20]}
    assert {"ManagementPlaneProtection", "MetaInfoClass", "swigfaiss"} <= tokens, tokens


def _completed(requests: list[dict[str, Any]]) -> bool:
    return all(r["finish_reason"] == "length" and len(r["tokens"]) == RARE["max_tokens"] for r in requests)


def test_a_rare_prompt_that_fits_completes_exact_through_the_overflow_path(rare_run: dict) -> None:
    ordinary, short = rare_run["phases"][:2]
    assert _completed(ordinary["requests"]) and _completed(short["requests"]), (ordinary, short)
    before, s = ordinary["stats"], short["stats"]
    assert s["values_checked"] > before["values_checked"] and s["values_differing"] == 0, s
    # rare-token text escapes more than a page's reserve holds: the overflow path ran for the rare prompt's own
    # values, and only for some escapes
    grew = {k: s[k] - before[k] for k in ("escapes", "overflow_values")}
    assert 0 < grew["overflow_values"] < grew["escapes"], (before, s)
    assert 0 < s["overflow_values_held"] <= s["overflow_values"], s


def test_a_full_arena_refuses_the_rare_requests_alone_and_loses_nothing(rare_run: dict) -> None:
    """Long rare prompts, then ordinary ones and a long rare one again, in the same engine: the rare requests finish
    with an error saying why and what to do, before any token; every other request completes; every value read back
    (the refused blocks left out) is the value written."""
    _, _, rare, after = (p["requests"] for p in rare_run["phases"])
    assert rare_run["pids"]["engine"] not in rare_run["pids"]["workers"], rare_run["pids"]  # reports crossed processes
    assert _completed(after[:-1]), after
    for r in [*rare, after[-1]]:
        assert r["finish_reason"] == "error" and r["tokens"] == [], r
        assert "overflow arena" in r["stop_reason"] and "GLYD_KV_ARENA_MB" in r["stop_reason"], r
    s = rare_run["stats"]
    assert s["values_checked"] > rare_run["phases"][1]["stats"]["values_checked"] and s["values_differing"] == 0, s
    assert s["overflow_arena_bytes"] <= s["layers"] * float(ARENA_MB) * 1e6, s
