"""Rare prompts, CI-sized: prompts made of the demo model's least-trained tokens
(glyd_engine.bench.rare_tokens) served at once with ordinary ones by the real engine, lossless, with the
read-back check on (every value a forward reads is compared bit for bit with a bf16 shadow of what was written).
The full-size run (40 x ~1,400 + 8 ordinary, off against lossless) is `glyd bench rare`; docs/benchmarks.md.
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
