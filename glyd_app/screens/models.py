"""The model picker: the demo model, models in Glyd's cache, directories the user added, or a typed id.

Choosing returns the model spec ("demo", a directory, or a Hugging Face id); the app then shuts the
running engine down and starts the new one, keeping the chat. A typed Hugging Face id not yet downloaded
opens the download screen (screens/pull.py) first: size, architecture and memory fit, then the download.
The cache listing runs in a thread worker (it stats files), so the picker opens at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from glyd_app.widgets.stats_bar import gib


class ForgetModelDir(Message):
    """The user removed a directory they had added; the app drops it from the store."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path


@dataclass(frozen=True)
class ModelEntry:
    spec: str  # what resolve_model takes
    label: str
    detail: str = ""
    removable: bool = False


def needs_download(spec: str) -> bool:
    """A Hugging Face id that is neither an existing directory nor downloaded yet."""
    from glyd_engine.models import DEMO_MODEL_ID, hub_model_path
    from glyd_engine.models.resolve import looks_like_hub_id

    if spec == DEMO_MODEL_ID or Path(spec).expanduser().exists() or not looks_like_hub_id(spec):
        return False
    return not hub_model_path(spec).is_dir()


def find_models(user_dirs: list[Path]) -> list[ModelEntry]:
    """Every model the picker offers, demo first; cheap imports only (no torch)."""
    from glyd_engine.models import DEMO_MODEL_ID, display_name, list_local_models

    try:
        local = list_local_models()
    except OSError:
        local = []
    demo = next((m for m in local if m.kind == "demo"), None)
    detail = f"built in · ready · {gib(demo.size_bytes)}" if demo else "built in, built on first use"
    entries = [ModelEntry(DEMO_MODEL_ID, display_name(DEMO_MODEL_ID), detail)]
    seen: set[str] = set()
    mine = {str(d) for d in user_dirs}  # the user's directories are listed below, where they can be forgotten
    for m in local:
        if m.kind == "demo" or str(m.path) in mine:
            continue
        seen.add(str(m.path))
        entries.append(ModelEntry(str(m.path), m.name, f"{m.kind} · {gib(m.size_bytes)}"))
    for d in user_dirs:
        if str(d) in seen:
            continue
        exists = (d / "config.json").is_file()
        entries.append(ModelEntry(str(d), d.name, f"{d}" + ("" if exists else " (missing)"), removable=True))
    return entries


class ModelPicker(ModalScreen[str | None]):
    BINDINGS = [
        Binding("escape", "dismiss_none", "Close"),
        Binding("delete", "remove", "Forget directory", id="glyd.models_forget"),
    ]

    DEFAULT_CSS = """
    ModelPicker { align: center middle; }
    ModelPicker > Vertical { width: 90; height: auto; max-height: 90%; padding: 1 2;
                             border: thick $primary; background: $surface; }
    ModelPicker .title { text-style: bold; }
    ModelPicker OptionList { height: auto; max-height: 16; margin: 1 0; }
    ModelPicker .hint { color: $text-muted; }
    """

    def __init__(self, current: str, user_dirs: list[Path]) -> None:
        super().__init__()
        self.current = current
        self.user_dirs = user_dirs
        self.entries: list[ModelEntry] = []

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Switch model", classes="title")
            yield Label("The running engine is shut down and the new model starts; the chat stays.", classes="hint")
            yield OptionList(Option("Looking for models…", disabled=True), id="model-list")
            yield Input(
                placeholder="…or a local directory, or a Hugging Face id (org/name) to download, then Enter",
                id="model-input",
            )
            yield Label("Enter: use · Del: forget an added directory · Esc: close", classes="hint")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()
        self.load_models()

    @work(
        thread=True,
        exclusive=True,
        exit_on_error=False,
        group="models",
        name="find-models",
        description="Listing local models",
    )
    def load_models(self) -> None:
        entries = find_models(self.user_dirs)
        self.app.call_from_thread(self.show_models, entries)

    def show_models(self, entries: list[ModelEntry]) -> None:
        self.entries = entries
        options = self.query_one(OptionList)
        options.clear_options()
        for e in entries:
            mark = "● " if e.spec == self.current else "  "
            options.add_option(Option(f"{mark}{e.label}  [dim]{e.detail}[/]", id=e.spec))
        options.highlighted = next((i for i, e in enumerate(entries) if e.spec == self.current), 0)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id:
            self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if not text:
            return
        if not needs_download(text):
            self.dismiss(text)
            return
        from glyd_app.screens.pull import PullScreen

        def pulled(repo_id: str | None) -> None:
            if repo_id:
                self.dismiss(repo_id)

        self.app.push_screen(PullScreen(text), pulled)

    def action_remove(self) -> None:
        options = self.query_one(OptionList)
        if options.highlighted is None or not self.entries:
            return
        entry = self.entries[options.highlighted]
        if not entry.removable:
            self.notify("Only directories you added can be forgotten", severity="warning")
            return
        self.app.post_message(ForgetModelDir(entry.spec))
        self.user_dirs = [d for d in self.user_dirs if str(d) != entry.spec]
        self.load_models()

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
