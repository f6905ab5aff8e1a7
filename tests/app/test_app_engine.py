"""The app on the real engine process with the echo stand-in backend: a crash mid-reply, a restart,
a model that fails to load. Real pipes and a real child, no model, so seconds per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import focus_input, type_text, wait_for, wait_for_dialog

from glyd_app.app import GlydApp
from glyd_app.screens.dialogs import EngineFailed
from glyd_app.store import Store
from glyd_app.widgets.messages import MessageView
from glyd_engine.engine.protocol import EngineSettings

pytestmark = pytest.mark.anyio
SIZE = (110, 36)


@pytest.fixture
def echo_app(glyd_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("GLYD_ENGINE_BACKEND", "echo")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")

    def make(spec: str = str(model)) -> GlydApp:
        return GlydApp(
            model=spec,
            settings=EngineSettings(kv="off"),
            store=Store(tmp_path / "c.sqlite3"),
            export_dir=tmp_path,
            install_if_missing=False,
        )

    return make


async def test_crash_mid_reply_keeps_text_and_restart_works(echo_app) -> None:  # type: ignore[no-untyped-def]
    app = echo_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session.engine_state == "ready", 30, "ready")
        await type_text(pilot, "please CRASH")
        await pilot.press("enter")
        await wait_for_dialog(pilot, app, EngineFailed)
        assert app.screen.kind == "crash" and "exit code 3" in app.screen.message  # type: ignore[attr-defined]
        await wait_for(pilot, lambda: not app.session.busy, 10, "reply closed")
        reply = app.session.store.messages(app.session.chat.id)[-1]  # type: ignore[union-attr]
        assert reply.role == "assistant" and reply.status == "interrupted" and reply.content == "about to "
        await pilot.press("r")  # restart from the dialog
        await wait_for(pilot, lambda: app.session.engine_state == "ready", 30, "ready again")
        await focus_input(pilot, app)
        await type_text(pilot, "hello again")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.busy and len(app.query(MessageView)) == 4, 30)
        assert "hello again" in list(app.query(MessageView))[-1].content


async def test_model_that_fails_to_load_shows_why(echo_app) -> None:  # type: ignore[no-untyped-def]
    app = echo_app("fail:unsupported")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_dialog(pilot, app, EngineFailed)
        assert app.screen.kind == "unsupported"  # type: ignore[attr-defined]
        assert "EchoForCausalLM is not supported" in app.screen.message  # type: ignore[attr-defined]
        await pilot.press("escape")
        assert app.screen is app.chat_screen and app.session.engine_state == "failed"
        await pilot.press("ctrl+q")


async def test_a_killed_engine_is_titled_by_what_happened(echo_app) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of the engine: the dialog says it was stopped by a signal (no OOM kill was counted), not
    "Not enough memory"; a crash with an exit code says it crashed, with the log's exception line."""
    from textual.widgets import Label

    app = echo_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session.engine_state == "ready", 30, "ready")
        await type_text(pilot, "please KILL")
        await pilot.press("enter")
        await wait_for_dialog(pilot, app, EngineFailed)
        title = str(app.screen.query_one(".title", Label).render())
        assert title == "The engine was stopped by a signal", title
        assert "stopped by SIGKILL" in app.screen.message  # type: ignore[attr-defined]
        await pilot.press("r")
        await wait_for(pilot, lambda: app.session.engine_state == "ready", 30, "ready again")
        await focus_input(pilot, app)
        await type_text(pilot, "please CRASH")
        await pilot.press("enter")
        await wait_for_dialog(pilot, app, EngineFailed)
        assert str(app.screen.query_one(".title", Label).render()) == "The engine crashed"
        assert "RuntimeError: the echo backend was asked to crash" in app.screen.message  # type: ignore[attr-defined]
