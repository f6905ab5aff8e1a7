"""Help: what the keys do (as currently bound, so remapped keys show), and where things are kept."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# glyd-chat

| Key | What it does | Binding id |
|---|---|---|
{rows}

**Messages:** focus one (Tab, or click) and press **c** to copy it, **b** to copy its last code block.
**Command palette:** Ctrl+P finds every action: switch model, new chat, export, copy code blocks, restart.

**Remap keys** in `{keymap}`, one line per binding id, e.g. `"glyd.send" = "ctrl+s"`.

**Kept on disk:** chats in `{db}`; models and KV tables in `{cache}`; the engine's log in `{log}`.

Memory numbers: *weights* is what the engine holds, labelled with its form (Glyd, bf16, or a model
converted on load) and compared with bf16 for the same model; *KV* is tokens in use / tokens the cache
holds and KV bytes a token; *RAM* is the engine process's resident memory. *KV mode* says
which cache is in force and why; F5 changes it. Sampling follows the model's own defaults unless this
chat's settings (F4) say otherwise, with a fresh seed each reply unless one is set.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,f1", "dismiss_none", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 96; height: 90%; padding: 1 2; border: thick $primary;
                                  background: $surface; }
    """

    def __init__(self, rows: list[tuple[str, str, str]], places: dict[str, str]) -> None:
        super().__init__()
        self.rows, self.places = rows, places

    def compose(self) -> ComposeResult:
        rows = "\n".join(f"| `{k}` | {d} | {f'`{i}`' if i else '(fixed)'} |" for k, d, i in self.rows)
        with VerticalScroll():
            yield Markdown(HELP.format(rows=rows, **self.places))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
