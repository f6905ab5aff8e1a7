"""Rare prompts, CI-sized: prompts made of the demo model's least-trained tokens
(glyd_engine.bench.rare_tokens) served at once with ordinary ones by the real engine, lossless, with the
read-back check on (every value a forward reads is compared bit for bit with a bf16 shadow of what was written).
The full-size run (40 x ~1,400 + 8 ordinary, off against lossless) is `glyd bench rare`; docs/benchmarks.md.
With the overflow arena limited (GLYD_KV_ARENA_MB), the same engine refuses the rare prompts alone and goes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import KV_BYTES

pytestmark = pytest.mark.slow

RARE = {"n": 6, "length": 400, "ordinary": 2, "ordinary_length": 400, "max_tokens": 4}


@pytest.fixture(scope="module")
def rare_run(demo_model_dir: Path) -> dict[str, Any]:
    from glyd_engine.bench.rare_tokens import run_engine

    return run_engine({"model": demo_model_dir, "mode": "lossless", "check": True, "kv_bytes": KV_BYTES,
                       "max_model_len": 1024, "rare": RARE}, timeout=600)


def test_rare_tokens_found(demo_model_dir: Path) -> None:
    from glyd_engine.bench.rare_tokens import find_rare_tokens

    rare = find_rare_tokens(demo_model_dir, 64)
    assert len(rare) == 64
    ids = [t["id"] for t in rare]
    assert len(set(ids)) == 64 and all(i > 16 for i in ids)  # no special or control token
    tokens = {t["token"] for t in rare[:20]}
    assert {"ManagementPlaneProtection", "MetaInfoClass", "swigfaiss"} <= tokens, tokens


def test_rare_prompts_complete_exact_and_escape(rare_run: dict) -> None:
    assert rare_run["requests"] == rare_run["completed"] == RARE["n"] + RARE["ordinary"]
    s = rare_run["stats"]
    assert s["values_checked"] > 0 and s["values_differing"] == 0, s
    assert s["escapes"] > 0, s
    # rare-token text escapes more than a page's reserve holds: the overflow path ran, and only for some escapes
    assert 0 < s["overflow_values"] < s["escapes"], s
    assert 0 < s["overflow_values_held"] <= s["overflow_values"], s


ARENA_MB = "0.004"  # 2,000 entries a layer: ordinary prompts' overflow fits, a prompt of rare tokens' does not


@pytest.fixture(scope="module")
def refused_run(demo_model_dir: Path) -> dict[str, Any]:
    from glyd_engine.bench.rare_tokens import run_engine

    return run_engine({"model": demo_model_dir, "mode": "lossless", "check": True, "kv_bytes": KV_BYTES,
                       "max_model_len": 1024, "arena_mb": ARENA_MB,
                       "rare": {**RARE, "n": 4, "ordinary": 4, "phased": True}}, timeout=600)


def test_a_full_arena_refuses_the_rare_requests_alone_and_loses_nothing(refused_run: dict) -> None:
    """Ordinary prompts, then rare ones, then ordinary ones and a rare one again, in one engine whose arena is
    limited: the rare requests finish with an error saying why and what to do, before any token; every other request
    completes; every value read back (the refused blocks left out) is the value written."""
    before, rare, after = refused_run["phases"]
    done = before + after[:-1]
    assert all(r["finish_reason"] == "length" and len(r["tokens"]) == RARE["max_tokens"] for r in done), done
    for r in [*rare, after[-1]]:
        assert r["finish_reason"] == "error" and r["tokens"] == [], r
        assert "overflow arena" in r["stop_reason"] and "GLYD_KV_ARENA_MB" in r["stop_reason"], r
    s = refused_run["stats"]
    assert s["values_checked"] > 0 and s["values_differing"] == 0, s
    assert s["overflow_arena_bytes"] <= s["layers"] * float(ARENA_MB) * 1e6, s
