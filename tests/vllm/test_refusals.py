"""Refusals and the auto fallback, decided where vLLM makes its engine config (no engine start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm.conftest import run_configs

pytestmark = pytest.mark.slow


def _sliding_window_model(path: Path) -> Path:
    """A tiny Mistral config with sliding-window attention (config only: refusal happens before weights)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 256,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "sliding_window": 64,
           "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def decisions(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    swa = str(_sliding_window_model(tmp_path_factory.mktemp("swa")))
    demo = str(demo_model_dir)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    cases = {
        "lossless": {"model": demo, "additional_config": {"glyd": {"kv": "lossless"}}},
        "auto": {"model": demo, "additional_config": {"glyd": {"kv": "auto"}}},
        "swa_lossless": {"model": swa, "additional_config": {"glyd": {"kv": "lossless"}}},
        "swa_auto": {"model": swa, "additional_config": {"glyd": {"kv": "auto"}}},
        "tp_lossless": {"model": demo, "tensor_parallel_size": 3, "additional_config": {"glyd": {"kv": "lossless"}}},
        "tp_reference": {"model": demo, "tensor_parallel_size": 3,
                         "additional_config": {"glyd": {"kv": "lossless", "kernels": "reference"}}},
        "spec_lossless": {"model": demo, "speculative_config": spec, "additional_config": {"glyd": {"kv": "exact"}}},
        "spec_auto": {"model": demo, "speculative_config": spec, "additional_config": {"glyd": {"kv": "auto"}}},
        "fp8_lossless": {"model": demo, "kv_cache_dtype": "fp8", "additional_config": {"glyd": {"kv": "lossless"}}},
        "typo": {"model": demo, "additional_config": {"glyd": {"kv": "losless"}}},
    }
    return run_configs(cases)


def test_supported_model_is_accepted(decisions: dict) -> None:
    for case in ("lossless", "tp_lossless"):  # the CPU backend holds a rank's KV heads under tensor parallelism
        assert decisions[case]["ok"], decisions[case]["error"]
        assert "Glyd KV cache: lossless" in decisions[case]["log"], case


def test_auto_falls_back_with_log_line(decisions: dict) -> None:
    for case in ("auto", "swa_auto", "spec_auto"):
        assert decisions[case]["ok"], decisions[case]["error"]
        assert "auto keeps vLLM's own KV cache" in decisions[case]["log"], case
    assert "sliding-window" in decisions["swa_auto"]["log"]
    assert "speculative decoding" in decisions["spec_auto"]["log"]


@pytest.mark.parametrize(("case", "why"), [
    ("swa_lossless", "sliding-window attention layers"),
    ("tp_reference", "tensor parallel size 3 > 1"),
    ("spec_lossless", "speculative decoding is on"),
    ("fp8_lossless", "kv_cache_dtype is fp8"),
])
def test_lossless_refuses_with_reason(decisions: dict, case: str, why: str) -> None:
    d = decisions[case]
    assert not d["ok"]
    assert "Glyd KV cache" in d["error"] and why in d["error"], d["error"]
    assert "GLYD_KV=off" in d["error"]


def test_unknown_mode_is_named(decisions: dict) -> None:
    assert not decisions["typo"]["ok"]
    assert "'losless' is not a Glyd KV mode" in decisions["typo"]["error"]


@pytest.fixture(scope="module")
def without_hook(demo_model_dir: Path) -> dict:
    """The same engine configs in a vLLM that lacks a hook the plugin needs (customize_spec)."""
    demo = str(demo_model_dir)
    return run_configs({"lossless": {"model": demo, "additional_config": {"glyd": {"kv": "lossless"}}},
                        "auto": {"model": demo, "additional_config": {"glyd": {"kv": "auto"}}},
                        "off": {"model": demo, "additional_config": {"glyd": {"kv": "off"}}}},
                       without_hook="customize_spec")


def test_a_missing_hook_refuses_lossless_asked_through_additional_config(without_hook: dict) -> None:
    """What the app and the bench do: the refusal comes where vLLM makes the config, naming the hook."""
    d = without_hook["lossless"]
    assert not d["ok"]
    assert "kv=lossless" in d["error"] and "lacks AttentionBackend.customize_spec" in d["error"], d["error"]
    assert "GLYD_KV=off" in d["error"]
    assert without_hook["off"]["ok"], without_hook["off"]["error"]
    assert without_hook["auto"]["ok"], without_hook["auto"]["error"]
    assert "auto keeps vLLM's own KV cache: this is vLLM" in without_hook["auto"]["log"]
