"""A message view whose reply ends before it has composed (a scripted or failing reply can end at once): the note
set then must not crash the app, and shows once the view composes."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Label

from glyd_app.widgets.messages import MessageView

pytestmark = pytest.mark.anyio


async def test_a_note_set_before_the_view_composes_shows_once_it_does() -> None:
    view = MessageView("assistant", "partial reply")
    view.set_note("Stopped")  # no children yet: querying the note label would raise NoMatches

    class Host(App[None]):
        def compose(self) -> ComposeResult:
            yield view

    async with Host().run_test() as pilot:
        await pilot.pause()
        label = view.query_one(".note", Label)
        assert label.display and view.note == "Stopped"
        assert "Stopped" in str(label.render())
        view.set_note("")
        assert not label.display
