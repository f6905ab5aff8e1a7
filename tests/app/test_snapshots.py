"""SVG snapshots of the main screens (pytest-textual-snapshot), on the scripted engine.

Baselines live in __snapshots__/; after a deliberate UI change: `pytest tests/app/test_snapshots.py
--snapshot-update`, then look at the SVGs. Everything that varies run to run is pinned: GLYD_HOME
(shown in help), chat timestamps, the progress bar's clock, and cursor blinking.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import type_text, wait_for
from scripted import Script, factory
from textual.clock import MockClock
from textual.pilot import Pilot
from textual.widgets import Input, TextArea

from glyd_app.app import GlydApp
from glyd_app.store import Store
from glyd_engine.engine.protocol import EngineSettings, Error, Progress

SIZE = (110, 34)
FIXED_HOME = "/home/you/.glyd"


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("GLYD_HOME", FIXED_HOME)

    def build(script: Script | None = None, store: Store | None = None) -> GlydApp:
        app = GlydApp(
            model="demo",
            settings=EngineSettings(kv="off"),
            engine_factory=factory(script),
            store=store or Store(tmp_path / "chats.sqlite3"),
            export_dir=Path("/home/you"),
            install_if_missing=False,
        )
        app.progress_clock = MockClock()
        return app

    return build


async def _no_toasts(pilot: Pilot) -> None:
    """Clear the "is ready" toast. notify() posts a message and the toast rack updates later, so clear until
    no toast is on screen twice in a row (a loaded CI machine can deliver the toast after one pause)."""
    quiet = 0
    for _ in range(100):
        await pilot.pause(0.02)
        await pilot.pause()
        if pilot.app.screen.query("Toast"):
            pilot.app.clear_notifications()
            quiet = 0
            continue
        quiet += 1
        if quiet >= 2:
            return
    raise AssertionError("toasts kept appearing")


async def _steady(pilot: Pilot) -> None:
    """Cursors frozen on every screen of the stack (a chat input under a modal still renders, in the blink
    phase it had when the modal opened): a blink caught mid-way made snapshots flaky on a loaded machine."""
    for screen in pilot.app.screen_stack:
        for area in screen.query(TextArea):
            # TextArea draws its cursor while blinking and in the visible phase, whatever the focus: stop the
            # timer in that phase and repaint (the phase flag does not repaint by itself)
            area.blink_timer.pause()
            area._cursor_visible = True
            area.refresh()
        for field in screen.query(Input):
            field.cursor_blink = False
    await pilot.pause()


def test_first_start_progress(make, snap_compare) -> None:  # type: ignore[no-untyped-def]
    script = Script(
        start=[
            Progress("demo-model", "demo model ready", 1, 1, 0.0),
            Progress("kv-tables", "calibrating over a 4,096-token window", 19, 48, 83.0),
        ]
    )
    app = make(script)

    async def before(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: app.start_screen is not None and app.start_screen.job == "kv-tables")
        await _steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_chat_with_a_streamed_reply_and_numbers(make, snap_compare) -> None:  # type: ignore[no-untyped-def]
    app = make()

    async def before(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await type_text(pilot, "What is the capital of France?")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.busy and app.chat_screen.last_reply() is not None)
        await _no_toasts(pilot)
        await _steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_model_picker(make, snap_compare, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = Store(tmp_path / "chats.sqlite3")
    store.add_model_dir("/models/Llama-3.2-1B-Instruct")
    app = make(store=store)

    async def before(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await _no_toasts(pilot)
        await _steady(pilot)  # freeze the chat input's cursor before a screen covers it
        await pilot.press("f2")
        await wait_for(pilot, lambda: len(getattr(app.screen, "entries", [])) == 2)
        await _steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_engine_failed_to_load(make, snap_compare) -> None:  # type: ignore[no-untyped-def]
    error = Error(
        "not enough memory for the KV cache: it needs 2.1 GiB and 1.2 GiB is free. "
        "Lower the KV budget (--kv-cache-mib) or pick a smaller model.",
        "oom",
        log_path=f"{FIXED_HOME}/cache/logs/engine.log",
    )
    app = make(Script(start=[Progress("engine", "Loading the weights", 3, 10, 7.0), error]))

    async def before(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "EngineFailed")
        await _steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_chat_list(
    make,
    snap_compare,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    store = Store(tmp_path / "chats.sqlite3")
    for i, (title, n) in enumerate(
        [("Paris and other capitals", 4), ("A story about a dragon", 2), ("Fix my Python loop", 6)]
    ):
        chat = store.new_chat(title=title)
        for j in range(n):
            store.add_message(chat.id, "user" if j % 2 == 0 else "assistant", f"message {j}")
        store.db.execute(
            "UPDATE chats SET created = ?, updated = ? WHERE id = ?",
            (1.7e9 + i * 3600, 1.7e9 + i * 3600, chat.id),
        )
    store.db.commit()
    store.set_state("last_chat", "1")
    app = make(store=store)

    async def before(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await _no_toasts(pilot)
        await _steady(pilot)  # freeze the chat input's cursor before a screen covers it
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatList")
        await _steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_help(make, snap_compare) -> None:  # type: ignore[no-untyped-def]
    app = make()

    async def before(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await _no_toasts(pilot)
        await _steady(pilot)  # freeze the chat input's cursor before a screen covers it
        await pilot.press("f1")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen")
        await _steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_chat_search(make, snap_compare, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    store = Store(tmp_path / "chats.sqlite3")
    for i, (title, text) in enumerate([("Paris and other capitals", "What is the capital of France?"),
                                       ("Weekend plans", "Trains from Paris to Lyon on Saturday"),
                                       ("Fix my Python loop", "for i in range(3) print(i)")]):
        chat = store.new_chat(title=title)
        store.add_message(chat.id, "user", text)
        store.add_message(chat.id, "assistant", "I can help with that.")  # none waits for a reply
        store.db.execute("UPDATE chats SET created = ?, updated = ? WHERE id = ?", (1.7e9 + i * 3600,) * 2 + (chat.id,))
    store.db.commit()
    store.set_state("last_chat", "1")
    app = make(store=store)

    async def before(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await _no_toasts(pilot)
        await _steady(pilot)
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatList")
        await pilot.press("slash")
        await type_text(pilot, "paris")
        await wait_for(pilot, lambda: len(app.screen.chats) == 2)  # type: ignore[attr-defined]
        await _steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_model_download_plan(make, snap_compare, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from fake_hub import FakeHub, tiny_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("glyd_engine.models.fit.machine_memory", lambda: (11 << 30, "free RAM"))
    hub = FakeHub({"HuggingFaceTB/SmolLM2-360M-Instruct": tiny_model()})
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    app = make()

    async def before(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await _no_toasts(pilot)
        await _steady(pilot)
        await pilot.press("f2")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ModelPicker")
        app.screen.query_one("#model-input").focus()
        await type_text(pilot, "HuggingFaceTB/SmolLM2-360M-Instruct")
        await pilot.press("enter")
        await wait_for(pilot, lambda: getattr(app.screen, "plan", None) is not None)
        await _steady(pilot)

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=before)
    finally:
        hub.close()
