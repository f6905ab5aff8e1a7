"""Fixtures for the app's tests: an isolated GLYD_HOME and apps wired to a scripted engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from scripted import Script, factory
from textual.clock import MockClock

from glyd_app.app import GlydApp
from glyd_app.store import Store
from glyd_engine.engine.protocol import EngineSettings


@pytest.fixture
def glyd_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("GLYD_HOME", str(home))
    return home


@pytest.fixture
def scripted_app(glyd_home: Path, tmp_path: Path) -> Callable[..., GlydApp]:
    """A GlydApp on a ScriptedEngine: `scripted_app(Script(...))`; engines on `app.session.engine_factory.engines`."""

    def make(script: Script | None = None, store: Store | None = None, **kwargs: object) -> GlydApp:
        app = GlydApp(
            model="demo",
            settings=EngineSettings(kv="off"),
            engine_factory=factory(script),
            store=store or Store(tmp_path / "chats.sqlite3"),
            export_dir=tmp_path / "exports",
            install_if_missing=False,
            **kwargs,
        )  # type: ignore[arg-type]
        app.progress_clock = MockClock()
        return app

    return make


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio through anyio's pytest plugin (no pytest-asyncio needed)."""
    return "asyncio"
