"""The message box: Enter sends, Ctrl+J (or Shift+Enter where the terminal reports it) adds a newline.

The bindings are priority bindings because TextArea itself turns Enter into a newline; their ids
(`glyd.send`, `glyd.newline`) let users remap them in keymap.toml.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class ChatInput(TextArea):
    BINDINGS = [
        Binding("enter", "send", "Send", id="glyd.send", priority=True),
        Binding("ctrl+j,shift+enter", "newline", "Newline", id="glyd.newline", priority=True, show=False),
    ]

    DEFAULT_CSS = """
    ChatInput { height: auto; min-height: 3; max-height: 10; }
    """

    class Send(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=False, **kwargs)  # type: ignore[arg-type]

    def action_send(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Send(text))

    def action_newline(self) -> None:
        self.insert("\n")
