"""Waiting in Pilot tests: poll a condition while the app keeps running."""

from __future__ import annotations

import time
from collections.abc import Callable

from textual.pilot import Pilot


async def wait_for(pilot: Pilot, condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or condition}")
        await pilot.pause(0.05)


async def wait_for_dialog(pilot: Pilot, app, cls: type, timeout: float = 30.0) -> None:  # noqa: ANN001
    """`cls` is the current screen and composed: a pushed screen's widgets mount a frame later (under load, later
    still), so a query right after the push can miss them."""
    await wait_for(pilot, lambda: isinstance(app.screen, cls) and app.screen.is_mounted and bool(app.screen.children),
                   timeout, f"the {cls.__name__} dialog")


async def type_text(pilot: Pilot, text: str) -> None:
    """Type into the focused widget (characters as key presses; spaces by name)."""
    await pilot.press(*[{" ": "space"}.get(c, c) for c in text])


async def focus_input(pilot: Pilot, app) -> None:  # noqa: ANN001 (a GlydApp; the helper stays import-light)
    """The chat screen current and its input focused, by code: a click there can land on a toast instead."""
    await wait_for(pilot, lambda: app.screen is app.chat_screen, 30, "the chat screen current")
    box = app.chat_screen.query_one("#input")
    box.focus()
    await wait_for(pilot, lambda: box.has_focus, 10, "the input focused")
