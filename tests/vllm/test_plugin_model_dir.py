"""The plugin finds vLLM's model through the one local-only resolver and leaves fingerprinting to the tables."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from glyd_engine.progress import PhaseTimer
from glyd_engine.vllm_plugin import state


def test_model_dir_resolves_locally_and_says_what_is_missing(demo_model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", lambda *a, **k: pytest.fail("the network was used"))
    assert state.model_dir(str(demo_model_dir)) == demo_model_dir.resolve()
    with pytest.raises(ValueError, match="Glyd KV cache: cannot find the files of model 'org/absent' locally"):
        state.model_dir("org/absent")


@pytest.mark.parametrize("cached", [True, False])
def test_load_tables_logs_a_build_only_when_it_builds(demo_model_dir: Path, cached: bool,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    tables = type("T", (), {"describe": lambda self: {"tables": "stand-in"}})()
    seen: list[Path] = []

    def ensure(d: Path, progress: Any, **_: object) -> Any:
        seen.append(d)
        if not cached:
            PhaseTimer("kv-tables", "loading the model", None, progress)
        return tables

    monkeypatch.setattr("glyd_engine.tables.ensure_tables", ensure)
    monkeypatch.setattr(state, "_tables", {})
    with caplog.at_level(logging.INFO, logger="vllm.glyd"):
        assert state.load_tables(str(demo_model_dir)) is tables
    assert seen == [demo_model_dir.resolve()]
    text = caplog.text
    assert ("not cached yet" in text) is not cached
    assert f"Glyd KV tables {'loaded' if cached else 'built'}" in text
