"""A bare three-widget Textual app that shows the chat's hint text: the floor under glyd-chat's start-up time.

`python tests/app/test_startup_time.py .venv/bin/python tests/app/bare_textual_app.py` times its first frame the
way it times glyd-chat's (docs/benchmarks.md)."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widgets import Static


class Bare(App[None]):
    def compose(self) -> ComposeResult:
        yield Static("Glyd")
        yield Static("Type a message")
        yield Static("ready")


if __name__ == "__main__":
    Bare().run()
