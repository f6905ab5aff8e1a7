"""Per-chat settings: system prompt, temperature, top-p, max tokens, seed; validated before they are kept.

Temperature and top-p left empty follow the model's own defaults (its generation_config.json); an empty
seed gives every reply a fresh one.
"""

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
    temperature: float | None
    top_p: float | None
    max_tokens: int
    seed: int | None = None


def _optional(text: str, kind: type[float] | type[int]) -> float | int | None:
    text = text.strip()
    return None if not text else kind(text)


def parse_settings(system: str, temperature: str, top_p: str, max_tokens: str, seed: str = "") -> ChatSettings:
    """Raises ValueError naming the field that is out of range; empty fields mean the default."""
    t = _optional(temperature, float)
    if t is not None and not 0 <= t <= 2:
        raise ValueError("temperature must be between 0 and 2 (empty: the model's default)")
    p = _optional(top_p, float)
    if p is not None and not 0 < p <= 1:
        raise ValueError("top-p must be above 0 and at most 1 (empty: the model's default)")
    m = int(max_tokens)
    if not 1 <= m <= 32768:
        raise ValueError("max tokens must be between 1 and 32768")
    try:
        sd = _optional(seed, int)
    except ValueError:
        raise ValueError("seed must be a whole number (empty: a fresh seed every reply)") from None
    if sd is not None and not 0 <= sd < 2**63:
        raise ValueError("seed must be a whole number from 0 (empty: a fresh seed every reply)")
    return ChatSettings(system.strip(), t, p, m, None if sd is None else int(sd))


def default_hint(defaults: dict[str, float], key: str, neutral: float) -> str:
    """What an empty field means, e.g. "model default: 0"."""
    value = defaults.get(key)
    return f"model default: {neutral if value is None else value:g}"


class ChatSettingsScreen(ModalScreen[ChatSettings | None]):
    BINDINGS = [Binding("escape", "dismiss_none", "Cancel"), Binding("ctrl+s", "save", "Save")]

    DEFAULT_CSS = """
    ChatSettingsScreen { align: center middle; }
    ChatSettingsScreen > Vertical { width: 92; height: auto; padding: 1 2; border: thick $primary;
                                    background: $surface; }
    ChatSettingsScreen .title { text-style: bold; margin-bottom: 1; }
    ChatSettingsScreen TextArea { height: 6; }
    ChatSettingsScreen Grid { grid-size: 4; grid-gutter: 0 2; height: auto; margin-top: 1; }
    ChatSettingsScreen #error { color: $error; height: 1; }
    ChatSettingsScreen Horizontal { height: auto; align-horizontal: right; }
    ChatSettingsScreen Button { margin-left: 2; }
    """

    def __init__(self, chat: Chat, defaults: dict[str, float] | None = None) -> None:
        super().__init__()
        self.chat = chat
        self.defaults = defaults or {}  # the model's sampling defaults, when the engine has said them

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
                yield Label("Seed")
                yield Input(_text(c.temperature), id="temperature", type="number",
                            placeholder=default_hint(self.defaults, "temperature", 1.0))
                yield Input(_text(c.top_p), id="top_p", type="number",
                            placeholder=default_hint(self.defaults, "top_p", 1.0))
                yield Input(str(c.max_tokens), id="max_tokens", type="integer")
                yield Input("" if c.seed is None else str(c.seed), id="seed", type="integer",
                            placeholder="fresh every reply")
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
                self.query_one("#seed", Input).value,
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


def _text(value: float | None) -> str:
    return "" if value is None else f"{value:g}"
