"""`--quantization glyd` on the real engine (vLLM CPU build): the packed demo model against the bf16 one.

The packed engine keeps every linear layer and the (tied) embedding in the resident code and decodes each
weight for its matmul, so it is several times slower than bf16 on the CPU: workloads are the shared `off`
engine's (an 896-token prompt's logprobs, greedy tokens), compared bit for bit. A second engine holds the
weights in the CUDA matmul's fragment layout (`GLYD_WEIGHT_LAYOUT=fragment`, its torch reference here).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from glyd_engine.bench.kv import bits_equal
from glyd_engine.format.checkpoint import read_header
from tests.vllm.conftest import CHUNK, GREEDY, LONG, MAX_LEN, engine, run_configs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def packed(packed_demo_dir: Path) -> dict[str, Any]:
    return engine({"model": packed_demo_dir, "mode": "off", "quantization": "glyd", "max_model_len": MAX_LEN,
                   "max_num_batched_tokens": CHUNK, "work": {"logprobs": [LONG], "greedy": GREEDY}})


@pytest.fixture(scope="module")
def fragment(packed_demo_dir: Path) -> dict[str, Any]:
    """The same checkpoint held in the CUDA matmul's fragment layout, run here by the layout's torch reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLYD_WEIGHT_LAYOUT", "fragment")
        return engine({"model": packed_demo_dir, "mode": "off", "quantization": "glyd", "max_model_len": MAX_LEN,
                       "work": {"greedy": GREEDY}})


def test_prompt_logprobs_equal_the_bf16_model(off: dict, packed: dict) -> None:
    assert len(packed["prompt_logprobs"][0]) == LONG - 1
    assert bits_equal(off, packed)


def test_greedy_tokens_equal_the_bf16_model(off: dict, packed: dict) -> None:
    assert packed["greedy"] == off["greedy"]
    assert all(len(g) == GREEDY["max_tokens"] for g in packed["greedy"])


def test_weights_stay_compressed_in_memory(packed: dict, packed_demo_dir: Path) -> None:
    w = packed["weights"]
    headers = {}
    for f in packed_demo_dir.glob("glyd-*.safetensors"):
        headers.update(read_header(f))
    packed_values = sum(info["shape"][0] for name, info in headers.items() if name.endswith("_glyd_sm"))
    assert w["glyd_weight_values"] == packed_values  # every packed tensor is held resident, none as bf16
    assert w["glyd_fragment_tensors"] == 0  # auto keeps the resident code on the CPU
    bits = 8 * w["glyd_weight_bytes"] / w["glyd_weight_values"]
    assert 12.0 <= bits < 12.3, bits  # 8 sign/mantissa + 4 exponent-offset bits, plus 48 an escape (0.25%)
    share = w["glyd_weight_escapes"] / w["glyd_weight_values"]  # `glyd bench weights`' resident_escape_share
    assert 0 < share < 0.005, share


def test_the_fragment_layout_gives_the_bf16_models_tokens(off: dict, fragment: dict) -> None:
    assert fragment["greedy"] == off["greedy"]
    w = fragment["weights"]
    assert w["glyd_weight_values"] > 0
    assert w["glyd_fragment_tensors"] == w["glyd_weight_tensors"] > 0  # every demo weight has a shape it holds
    bits = 8 * w["glyd_weight_bytes"] / w["glyd_weight_values"]
    assert 12.0 <= bits < 12.3, bits  # 12 bits a weight, plus 4 bytes an escape and a row index


def test_glyd_checkpoint_is_detected_and_bf16_is_refused(demo_model_dir: Path, packed_demo_dir: Path) -> None:
    d = run_configs({"detected": {"model": str(packed_demo_dir)},
                     "bf16": {"model": str(demo_model_dir), "quantization": "glyd"}})
    assert d["detected"]["ok"] and d["detected"]["quantization"] == "glyd", d["detected"]["error"]
    assert not d["bf16"]["ok"]
    assert "is not a Glyd checkpoint" in d["bf16"]["error"] and "glyd pack" in d["bf16"]["error"]


def test_a_missing_part_is_named(packed_demo_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(packed_demo_dir, bad)
    f = next(bad.glob("glyd-*.safetensors"))
    tensors = load_file(str(f))
    del tensors["model.layers.3.mlp.up_proj.weight_glyd_exp"]
    save_file(tensors, str(f), metadata={"format": "glyd"})
    with pytest.raises(RuntimeError) as err:
        engine({"model": bad, "mode": "off", "max_model_len": 512, "work": {}})
    assert "lacks part(s) _glyd_exp of model.layers.3.mlp.gate_up_proj.weight (shard 1)" in str(err.value)
