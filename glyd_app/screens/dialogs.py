"""Small modal dialogs: ask for a line of text, confirm, show an engine failure."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

DIALOG_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: 72; height: auto; padding: 1 2; border: thick $primary; background: $surface; }}
{name} .title {{ text-style: bold; margin-bottom: 1; width: 100%; }}
{name} Horizontal {{ height: auto; align-horizontal: right; margin-top: 1; }}
{name} Button {{ margin-left: 2; }}
"""


class TextPrompt(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss_none", "Cancel")]
    DEFAULT_CSS = DIALOG_CSS.format(name="TextPrompt")

    def __init__(self, title: str, value: str = "", placeholder: str = "") -> None:
        super().__init__()
        self.title_text, self.value, self.placeholder = title, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.title_text, classes="title")
            yield Input(self.value, placeholder=self.placeholder)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class Confirm(ModalScreen[bool]):
    BINDINGS = [Binding("escape", "no", "No"), Binding("y", "yes", "Yes")]
    DEFAULT_CSS = DIALOG_CSS.format(name="Confirm")

    def __init__(self, question: str, yes: str = "Delete") -> None:
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, classes="title")
            with Horizontal():
                yield Button("Keep", id="no")
                yield Button(self.yes, id="yes", variant="error")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)


class SlowModel(ModalScreen[str]):
    """Before a model loads that will be slow here (a Glyd checkpoint with no CUDA GPU): why, and the choice
    of loading it anyway, opening its bf16 model where that is here, or not loading it."""

    BINDINGS = [
        Binding("escape", "choose('cancel')", "Don't load"),
        Binding("l", "choose('load')", "Load anyway"),
        Binding("b", "choose('bf16')", "Open the bf16 model"),
    ]
    DEFAULT_CSS = DIALOG_CSS.format(name="SlowModel") + """
    SlowModel > Vertical { border: thick $warning; }
    SlowModel #why { width: 100%; }
    """

    def __init__(self, why: str, bf16_name: str | None) -> None:
        super().__init__()
        self.why, self.bf16_name = why, bf16_name

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("This model will be slow here", classes="title")
            offer = (f"\n\nIts bf16 model, {self.bf16_name}, is here: same replies, full speed."
                     if self.bf16_name else "")
            yield Static(self.why[:1].upper() + self.why[1:] + "." + offer, id="why", markup=False)
            with Horizontal():
                yield Button("Don't load", id="cancel")
                if self.bf16_name:
                    yield Button("Open bf16", id="bf16", variant="primary")
                yield Button("Load anyway", id="load", variant="warning")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "cancel")

    def action_choose(self, what: str) -> None:
        if what != "bf16" or self.bf16_name:
            self.dismiss(what)


KIND_TITLES = {
    "oom": "Not enough memory",
    "unsupported": "This model is not supported",
    "refused": "Refused",
    "offline": "No network",
    "cancelled": "Start cancelled",
    "crash": "The engine crashed",
    "signal": "The engine was stopped by a signal",
}


class EngineFailed(ModalScreen[str]):
    """Why the engine failed, and what the user can do: restart, pick another model, or go on reading."""

    BINDINGS = [
        Binding("escape", "choose('close')", "Close"),
        Binding("r", "choose('restart')", "Restart"),
        Binding("m", "choose('models')", "Pick a model"),
    ]
    DEFAULT_CSS = (
        DIALOG_CSS.format(name="EngineFailed")
        + """
    EngineFailed > Vertical { border: thick $error; }
    EngineFailed #why { margin-bottom: 1; width: 100%; }
    EngineFailed #fix { margin-bottom: 1; width: 100%; }
    EngineFailed #log { color: $text-muted; width: 100%; }
    """
    )

    def __init__(self, kind: str, message: str, log_path: str | None, fix: str = "") -> None:
        super().__init__()
        self.kind, self.message, self.log_path, self.fix = kind, message, log_path, fix

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(KIND_TITLES.get(self.kind, "The engine failed"), classes="title")
            yield Static(self.message, id="why", markup=False)
            if self.fix:  # a refusal says what to do instead
                yield Static(f"What to do: {self.fix}", id="fix", markup=False)
            if self.log_path:
                yield Static(f"Details: {self.log_path}", id="log", markup=False)
            with Horizontal():
                yield Button("Close", id="close")
                yield Button("Pick a model", id="models")
                yield Button("Restart", id="restart", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "close")

    def action_choose(self, what: str) -> None:
        self.dismiss(what)
