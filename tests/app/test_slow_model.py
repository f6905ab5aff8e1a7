"""A Glyd checkpoint opened where no CUDA GPU runs it (this machine): the app says before loading that it
will be slow and why, and offers the bf16 model it was packed from where that is here."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_for
from safetensors.numpy import save_file
from scripted import factory

from glyd_app.app import GlydApp
from glyd_app.screens.dialogs import SlowModel
from glyd_app.store import Store
from glyd_engine import paths
from glyd_engine.engine.protocol import EngineSettings
from glyd_engine.models import model_fingerprint

pytestmark = pytest.mark.anyio
SIZE = (80, 30)


def bf16_and_packed(root: Path) -> tuple[Path, Path]:
    """A bf16 model in Glyd's models directory and a Glyd checkpoint that names it as its source."""
    src = paths.models_dir() / "Tiny-bf16"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"w": np.arange(64, dtype=np.float32)}, str(src / "model.safetensors"))
    packed = root / "Tiny-glyd"
    packed.mkdir()
    (packed / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "glyd", "source_fingerprint": model_fingerprint(src)}}))
    save_file({"w": np.zeros(4, dtype=np.uint8)}, str(packed / "model.safetensors"))
    return src, packed


@pytest.fixture
def app_on(glyd_home: Path, tmp_path: Path) -> Callable[[str], GlydApp]:
    def make(spec: str) -> GlydApp:
        return GlydApp(model=spec, settings=EngineSettings(kv="off"), engine_factory=factory(None),
                       store=Store(tmp_path / "c.sqlite3"), export_dir=tmp_path, install_if_missing=False)

    return make


async def test_a_glyd_checkpoint_asks_first_and_offers_its_bf16_model(  # type: ignore[no-untyped-def]
        app_on, tmp_path: Path) -> None:
    src, packed = bf16_and_packed(tmp_path)
    app = app_on(str(packed))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, SlowModel) and bool(app.screen.query("#why")),
                       what="asked before loading")
        why = str(app.screen.query_one("#why").render())
        assert "Tiny-glyd is a Glyd checkpoint" in why and "0.1-0.4 tokens a second" in why
        assert "Its bf16 model, Tiny-bf16, is here" in why
        engines = app.session.engine_factory.engines  # type: ignore[attr-defined]
        assert engines == []  # nothing loads before the answer
        await pilot.press("b")
        await wait_for(pilot, lambda: app.session.engine_state == "ready", what="the bf16 model loaded")
        assert [e.started[-1][0] for e in engines] == [str(src)]


async def test_load_anyway_is_asked_once_and_dont_load_leaves_the_app_usable(  # type: ignore[no-untyped-def]
        app_on, tmp_path: Path) -> None:
    _, packed = bf16_and_packed(tmp_path)
    app = app_on("demo")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session.engine_state == "ready", what="demo ready")
        app.switch_model(str(packed))  # what F2 does with the chosen model
        await wait_for(pilot, lambda: isinstance(app.screen, SlowModel))
        await pilot.press("escape")  # don't load: the demo engine goes on
        await pilot.pause(0.1)
        engines = app.session.engine_factory.engines  # type: ignore[attr-defined]
        assert len(engines) == 1 and app.session.engine_state == "ready" and app.model_spec == "demo"
        app.switch_model(str(packed))
        await wait_for(pilot, lambda: isinstance(app.screen, SlowModel))
        await pilot.press("l")
        await wait_for(pilot, lambda: len(engines) == 2 and app.session.engine_state == "ready")
        assert engines[-1].started[-1][0] == str(packed.resolve())
        app.action_restart_engine()  # the same model again: not asked twice
        await wait_for(pilot, lambda: len(engines) == 3 and app.session.engine_state == "ready")
        assert not isinstance(app.screen, SlowModel)
