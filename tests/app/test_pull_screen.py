"""Getting a model in the app: the picker's typed hub id opens the download screen, which says size, architecture
and memory fit before it starts, downloads with progress, refuses what cannot run, and starts the new model.
The hub is tests/fake_hub.py on a local port (HF_ENDPOINT)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub, tiny_model
from helpers import type_text, wait_for
from textual.widgets import Button, Input, Static

from glyd_app.app import GlydApp
from glyd_app.screens.pull import PullScreen
from glyd_engine.models import hub_model_path

pytestmark = pytest.mark.anyio
SIZE = (110, 36)


@pytest.fixture
def hub(glyd_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("glyd_engine.models.fit.machine_memory", lambda: (8 << 30, "free RAM"))
    server = FakeHub({"org/tiny": tiny_model(), "org/bert": tiny_model("BertModel")})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.close()


async def _open_pull(pilot, app: GlydApp, repo_id: str) -> PullScreen:  # type: ignore[no-untyped-def]
    await wait_for(pilot, lambda: app.session.engine_state == "ready")
    await pilot.press("f2")
    await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ModelPicker")
    app.screen.query_one("#model-input", Input).focus()
    await type_text(pilot, repo_id)
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(app.screen, PullScreen))
    screen = app.screen
    assert isinstance(screen, PullScreen)
    await wait_for(pilot, lambda: screen.plan is not None or bool(screen.error), what="the plan")
    await pilot.pause()  # the plan's text re-flows the screen before a click finds the button where it is drawn
    return screen


async def test_download_from_the_picker_then_the_model_starts(
        scripted_app: Callable[..., GlydApp], hub: FakeHub) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await _open_pull(pilot, app, "org/tiny")
        shown = str(screen.query_one("#plan", Static).render())
        assert "org/tiny: LlamaForCausalLM, 3 MiB in 4 files; needs about 1.3 GiB, 8.0 GiB free RAM: fits" in shown
        assert hub.file_gets("model.safetensors") == []  # nothing fetched before the user says so
        assert not screen.query_one("#download", Button).disabled
        await pilot.press("enter")  # the Download button has the focus
        await wait_for(pilot, lambda: app.session.model_spec == "org/tiny", what="the switch to the new model")
        target = hub_model_path("org/tiny")
        assert (target / "model.safetensors").read_bytes() == hub.repos["org/tiny"]["model.safetensors"]
        engine = app.session.engine_factory.engines[-1]  # type: ignore[attr-defined]
        await wait_for(pilot, lambda: engine.started and engine.started[0][0] == "org/tiny")


async def test_unsupported_architecture_is_refused_with_why(
        scripted_app: Callable[..., GlydApp], hub: FakeHub) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await _open_pull(pilot, app, "org/bert")
        shown = str(screen.query_one("#plan", Static).render())
        assert "Not downloaded: BertModel is not a text-generation architecture vLLM runs" in shown
        assert screen.query_one("#download", Button).disabled
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ModelPicker")
        assert app.session.model_spec == "demo" and hub.file_gets("model.safetensors") == []


async def test_too_large_is_refused_and_a_broken_download_resumes(
        scripted_app: Callable[..., GlydApp], hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("glyd_engine.models.fit.machine_memory", lambda: (700 << 20, "free RAM"))
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await _open_pull(pilot, app, "org/tiny")
        assert "Not downloaded: it needs about 1.3 GiB, 700 MiB free RAM: does not fit" in str(
            screen.query_one("#plan", Static).render())
        assert screen.query_one("#download", Button).disabled
        await pilot.press("escape", "escape")
        monkeypatch.setattr("glyd_engine.models.fit.machine_memory", lambda: (8 << 30, "free RAM"))
        hub.cut_after["model.safetensors"] = 1_200_000
        screen = await _open_pull(pilot, app, "org/tiny")
        await pilot.click("#download")
        await wait_for(pilot, lambda: bool(screen.error), what="the broken download reported")
        assert "broke off at 1,200,000" in screen.error
        button = screen.query_one("#download", Button)
        await wait_for(pilot, lambda: not button.disabled and str(button.label) == "Resume", what="Resume")
        await pilot.pause()  # the error text re-flows the screen: click where the button is drawn now
        await pilot.click("#download")
        await wait_for(pilot, lambda: app.session.model_spec == "org/tiny")
        assert hub.file_gets("model.safetensors") == ["", "bytes=1200000-"]
