"""Keys that reach the app faster than the message box handles them (fast typing while a reply renders, a
paste in a terminal without bracketed paste, which arrives as key presses) must all be in the message Enter
sends, in order. Enter and Ctrl+J are priority bindings, run by the app as the key arrives, while the
characters before them may still wait in the box's queue: the text read then was cut ("...about a d") and
the rest was cleared with the box."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from helpers import focus_input, wait_for
from scripted import Script
from textual import events

from glyd_app.app import GlydApp
from glyd_app.widgets.chat_input import ChatInput
from glyd_app.widgets.messages import MessageView

pytestmark = pytest.mark.anyio
SIZE = (110, 36)


def burst(app: GlydApp, keys: list[str]) -> None:
    """Key events handed to the app at once, as a terminal delivers a paste or fast typing."""
    for key in keys:
        name = {" ": "space"}.get(key, key)
        event = events.Key(name, {"enter": "\r", "ctrl+j": "\n"}.get(key, key))
        event.set_sender(app)
        app._driver.send_message(event)  # type: ignore[union-attr]


async def test_a_burst_of_keys_ending_in_enter_sends_all_of_it(scripted_app: Callable[..., GlydApp]) -> None:
    app = scripted_app(Script())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session.engine_state == "ready", what="engine ready")
        await focus_input(pilot, app)
        box = app.chat_screen.query_one(ChatInput)
        box.text = "tell me about a"
        box.move_cursor(box.document.end)
        release = asyncio.Event()
        box.call_later(release.wait)  # the box is busy (as while a long reply renders): keys queue up behind
        asyncio.get_running_loop().call_later(0.3, release.set)
        burst(app, [*" dog", "ctrl+j", *"and a cat", "enter", *"next"])
        await wait_for(pilot, lambda: not app.session.busy and len(app.query(MessageView)) == 2, what="reply")
        engine = app.session.engine_factory.engines[-1]  # type: ignore[attr-defined]
        assert engine.requests[0][0][-1]["content"] == "tell me about a dog\nand a cat"
        assert box.text == "next"  # typed after Enter: the next message's start, kept
