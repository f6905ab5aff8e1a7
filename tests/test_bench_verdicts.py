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
