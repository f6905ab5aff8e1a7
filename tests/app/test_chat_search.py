"""Finding chats in the app: the chat list's full-text search, and rename/delete/export on what it found."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import type_text, wait_for
from textual.widgets import Input, OptionList

from glyd_app.app import GlydApp
from glyd_app.screens.chats import ChatList
from glyd_app.store import Store
from glyd_app.widgets.messages import MessageView

pytestmark = pytest.mark.anyio
SIZE = (110, 36)


def _store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "chats.sqlite3")
    for title, words in [("Trip", "Which trains go to Zürich from Basel?"), ("Code", "Fix my Python loop please"),
                         ("Cooking", "A recipe for onion soup")]:
        chat = store.new_chat(title=title)
        store.add_message(chat.id, "user", words)
        store.add_message(chat.id, "assistant", f"An answer about {title.lower()}.")
    return store


async def test_search_finds_chats_by_their_messages_then_rename_export_delete_and_open(
        scripted_app: Callable[..., GlydApp], tmp_path: Path) -> None:
    app = scripted_app(store=_store(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatList))
        screen = app.screen
        assert isinstance(screen, ChatList) and len(screen.chats) == 4  # and the new chat the app opened
        await pilot.press("slash")  # from the list to the search box
        assert screen.query_one("#chat-search", Input).has_focus
        await type_text(pilot, "zurich")  # accents folded; typing "r", "d" or "e" here types, not acts
        await wait_for(pilot, lambda: [c.title for c in screen.chats] == ["Trip"], what="one hit")
        prompt = str(screen.query_one(OptionList).get_option_at_index(0).prompt)
        assert "1 matching message" in prompt and "Zürich" in prompt
        await pilot.press("ctrl+a", "ctrl+k")
        await type_text(pilot, "pyth loo")  # every word, by prefix
        await wait_for(pilot, lambda: [c.title for c in screen.chats] == ["Code"], what="the code chat")
        await pilot.press("enter")  # to the results
        assert screen.query_one(OptionList).has_focus
        await pilot.press("r")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "TextPrompt")
        await pilot.press("ctrl+a", "ctrl+k")
        await type_text(pilot, "Python loops")
        await pilot.press("enter")
        code = next(c for c in app.session.store.chats() if c.title == "Python loops")
        assert [h.chat_id for h in app.session.search("loops")] == [code.id]  # the index saw the rename
        await pilot.press("e")
        exported = tmp_path / "exports" / "glyd-python-loops.md"
        await wait_for(pilot, exported.exists, what="the export")
        assert "Fix my Python loop please" in exported.read_text()
        await pilot.press("slash", "ctrl+a", "ctrl+k")
        await type_text(pilot, "onion")
        await wait_for(pilot, lambda: [c.title for c in screen.chats] == ["Cooking"])
        await pilot.press("enter", "d")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm")
        await pilot.press("y")
        await wait_for(pilot, lambda: "Cooking" not in [c.title for c in app.session.store.chats()])
        assert app.session.search("onion") == [] and screen.chats == []
        await pilot.press("slash", "ctrl+a", "ctrl+k")
        await type_text(pilot, "basel")
        await wait_for(pilot, lambda: [c.title for c in screen.chats] == ["Trip"])
        await pilot.press("enter", "enter")  # to the results, then open the chat
        await wait_for(pilot, lambda: app.session.chat is not None and app.session.chat.title == "Trip")
        assert "Zürich" in app.query(MessageView).first().content


async def test_palette_opens_the_search_and_a_new_message_is_found(
        scripted_app: Callable[..., GlydApp], tmp_path: Path) -> None:
    app = scripted_app(store=Store(tmp_path / "chats.sqlite3"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await type_text(pilot, "tell me about Lisbon")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.busy and len(app.query(MessageView)) == 2)
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "CommandPalette")
        await type_text(pilot, "search chats")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatList))
        assert app.screen.query_one("#chat-search", Input).has_focus
        await type_text(pilot, "paris lisb")  # the streamed reply says Paris; the question says Lisbon
        await wait_for(pilot, lambda: len(app.screen.chats) == 0)  # type: ignore[attr-defined]
        await pilot.press("ctrl+a", "ctrl+k")
        await type_text(pilot, "paris")
        await wait_for(pilot, lambda: len(app.screen.chats) == 1)  # type: ignore[attr-defined]
