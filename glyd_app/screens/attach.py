"""Choosing a file to attach: a path box with completion (Tab completes, the matches are listed below).

Returns the path typed (or None); reading it and checking that it fits the context is the chat screen's.
"""

from __future__ import annotations

import os
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widgets import Input, Label, Static

MAX_SHOWN = 8


def complete_path(text: str, cwd: Path | None = None) -> tuple[str, list[str]]:
    """`text` completed as far as the file names under its directory agree, and the names that match.
    A single match that is a directory gets its slash, so Tab goes on into it."""
    folder, _, prefix = text.rpartition("/")
    base = Path(os.path.expanduser(folder + "/" if folder or text.startswith("/") else "."))
    if not base.is_absolute():
        base = (cwd or Path.cwd()) / base
    try:
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(base)
                       if e.name.startswith(prefix) and (prefix.startswith(".") or not e.name.startswith(".")))
    except OSError:
        return text, []
    if not names:
        return text, []
    common = os.path.commonprefix(names)
    head = f"{folder}/" if folder or text.startswith("/") else ""
    return head + common, names


class PathSuggester(Suggester):
    """Inline completion while typing (Right arrow or Tab takes it)."""

    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        completed, _ = complete_path(value)
        return completed if completed != value else None


class AttachScreen(ModalScreen[Path | None]):
    BINDINGS = [
        Binding("escape", "dismiss_none", "Cancel"),
        Binding("tab", "complete", "Complete the path", priority=True, show=False),
    ]

    DEFAULT_CSS = """
    AttachScreen { align: center middle; }
    AttachScreen > Vertical { width: 90; height: auto; padding: 1 2; border: thick $primary; background: $surface; }
    AttachScreen .title { text-style: bold; margin-bottom: 1; }
    AttachScreen #matches { color: $text-muted; width: 100%; height: auto; }
    AttachScreen .hint { color: $text-muted; margin-top: 1; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Attach a text file", classes="title")
            yield Input(placeholder="a path, e.g. notes.md or ~/src/main.py", suggester=PathSuggester(),
                        id="attach-path")
            yield Static("", id="matches", markup=False)
            yield Label("Tab: complete · Enter: attach · Esc: cancel. Its text goes to the model with your "
                        "next message.", classes="hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def action_complete(self) -> None:
        box = self.query_one(Input)
        completed, names = complete_path(box.value)
        box.value = completed
        box.cursor_position = len(completed)
        shown = names[:MAX_SHOWN] + ([f"… and {len(names) - MAX_SHOWN} more"] if len(names) > MAX_SHOWN else [])
        self.query_one("#matches", Static).update("  ".join(shown) if len(names) > 1 else "")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.dismiss(Path(event.value.strip()).expanduser())

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
