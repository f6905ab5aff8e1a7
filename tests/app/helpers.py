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


async def type_text(pilot: Pilot, text: str) -> None:
    """Type into the focused widget (characters as key presses; spaces by name)."""
    await pilot.press(*[{" ": "space"}.get(c, c) for c in text])
