"""Per-chat settings: system prompt, temperature, top-p, max tokens; validated before they are kept."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, TextArea

from glyd_app.store import Chat


@dataclass
class ChatSettings:
    system_prompt: str
    temperature: float
    top_p: float
    max_tokens: int


def parse_settings(system: str, temperature: str, top_p: str, max_tokens: str) -> ChatSettings:
    """Raises ValueError naming the field that is out of range."""
    t = float(temperature)
    if not 0 <= t <= 2:
        raise ValueError("temperature must be between 0 and 2")
    p = float(top_p)
    if not 0 < p <= 1:
        raise ValueError("top-p must be above 0 and at most 1")
    m = int(max_tokens)
    if not 1 <= m <= 32768:
        raise ValueError("max tokens must be between 1 and 32768")
    return ChatSettings(system.strip(), t, p, m)


class ChatSettingsScreen(ModalScreen[ChatSettings | None]):
    BINDINGS = [Binding("escape", "dismiss_none", "Cancel"), Binding("ctrl+s", "save", "Save")]

    DEFAULT_CSS = """
    ChatSettingsScreen { align: center middle; }
    ChatSettingsScreen > Vertical { width: 80; height: auto; padding: 1 2; border: thick $primary;
                                    background: $surface; }
    ChatSettingsScreen .title { text-style: bold; margin-bottom: 1; }
    ChatSettingsScreen TextArea { height: 6; }
    ChatSettingsScreen Grid { grid-size: 3; grid-gutter: 0 2; height: auto; margin-top: 1; }
    ChatSettingsScreen #error { color: $error; height: 1; }
    ChatSettingsScreen Horizontal { height: auto; align-horizontal: right; }
    ChatSettingsScreen Button { margin-left: 2; }
    """

    def __init__(self, chat: Chat) -> None:
        super().__init__()
        self.chat = chat

    def compose(self) -> ComposeResult:
        c = self.chat
        with Vertical():
            yield Label(f"Settings for “{c.title}”", classes="title")
            yield Label("System prompt")
            yield TextArea(c.system_prompt, id="system")
            with Grid():
                yield Label("Temperature")
                yield Label("Top-p")
                yield Label("Max tokens")
                yield Input(f"{c.temperature:g}", id="temperature", type="number")
                yield Input(f"{c.top_p:g}", id="top_p", type="number")
                yield Input(str(c.max_tokens), id="max_tokens", type="integer")
            yield Label("", id="error")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Save", id="save", variant="primary")

    def action_save(self) -> None:
        try:
            settings = parse_settings(
                self.query_one("#system", TextArea).text,
                self.query_one("#temperature", Input).value,
                self.query_one("#top_p", Input).value,
                self.query_one("#max_tokens", Input).value,
            )
        except ValueError as exc:
            self.query_one("#error", Label).update(str(exc))
            return
        self.dismiss(settings)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
