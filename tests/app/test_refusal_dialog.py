"""A refusal raised in the engine is shown as a refusal (issue 31, item 2): its reason and what to do instead,
under the title "Refused", not as a crash. The real child process runs the echo stand-in, which raises the
plugin's refusal the way vLLM hands it on (inside pydantic's ValidationError)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import wait_for_dialog
from textual.widgets import Label, Static

from glyd_app.app import GlydApp
from glyd_app.screens.dialogs import KIND_TITLES, EngineFailed
from glyd_app.store import Store
from glyd_engine.engine.protocol import EngineSettings

pytestmark = pytest.mark.anyio


async def test_a_refusal_shows_its_reason_and_fix(glyd_home: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLYD_ENGINE_BACKEND", "echo")
    app = GlydApp(model="fail:refused", settings=EngineSettings(kv="lossless"), store=Store(tmp_path / "c.sqlite3"),
                  export_dir=tmp_path, install_if_missing=False)
    async with app.run_test(size=(110, 36)) as pilot:
        await wait_for_dialog(pilot, app, EngineFailed)
        screen = app.screen
        assert isinstance(screen, EngineFailed) and screen.kind == "refused"
        assert str(screen.query_one(".title", Label).render()) == KIND_TITLES["refused"]
        assert "sliding-window attention layers" in screen.message and "ValidationError" not in screen.message
        fix = str(screen.query_one("#fix", Static).render())
        assert fix.startswith("What to do: change that, or run with GLYD_KV=off")
        assert app.stats_bar.state.startswith("failed (refused): Glyd KV cache (kv=lossless) cannot run")
        await pilot.press("escape")
        await pilot.press("ctrl+q")
