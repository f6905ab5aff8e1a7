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
        def __init__(self, text: str, raw: str) -> None:
            super().__init__()
            self.text = text  # stripped: what is sent
            self.raw = raw  # the box's text at the time: what `consume` removes once it is sent

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=False, **kwargs)  # type: ignore[arg-type]

    # Priority bindings run as the app receives the key, while the characters typed before it may still wait
    # in this widget's queue (fast typing while a reply renders; a paste that arrives as key presses). Both
    # actions therefore run from that queue, after those characters: reading the text at once sent a cut
    # message, and the characters inserted after it were cleared with the box.

    def action_send(self) -> None:
        self.call_later(self._send_now)

    def action_newline(self) -> None:
        self.call_later(self.insert, "\n")

    def _send_now(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Send(text, self.text))

    def consume(self, raw: str) -> None:
        """Remove a sent text from the box, keeping what was typed after it (the next message's start)."""
        rest = self.text[len(raw):] if self.text.startswith(raw) else ""
        self.text = rest
        self.move_cursor(self.document.end)
