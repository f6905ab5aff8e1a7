"""One chat message: who said it and a Markdown body that can be streamed into while a reply arrives.

Focus a message (Tab / click) and press `c` to copy it or `b` to copy its last code block; the
palette offers every code block of the last reply.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Label, Markdown

if TYPE_CHECKING:
    from textual.widgets.markdown import MarkdownStream

FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a message, in order (an unclosed last fence counts too)."""
    blocks = [m.group(2).rstrip("\n") for m in FENCE.finditer(markdown)]
    rest = FENCE.sub("", markdown)
    tail = re.search(r"^(```|~~~)[^\n]*\n(.*)\Z", rest, re.S | re.M)
    if tail:
        blocks.append(tail.group(2).rstrip("\n"))
    return blocks


class MessageView(Vertical, can_focus=True):
    BINDINGS = [
        Binding("c", "copy", "Copy message", id="glyd.copy_message"),
        Binding("b", "copy_code", "Copy code block", id="glyd.copy_code"),
    ]

    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; padding: 0 1; }
    MessageView:focus { background: $boost; }
    MessageView > .who { text-style: bold; color: $text-muted; }
    MessageView.user > .who { color: $accent; }
    MessageView.assistant > .who { color: $success; }
    MessageView > Markdown { margin: 0; padding: 0; }
    MessageView .note { color: $warning; text-style: italic; }
    MessageView > .file { color: $accent; }
    """

    def __init__(self, role: str, content: str = "", note: str = "", message_id: int | None = None,
                 files: list[str] | None = None) -> None:
        super().__init__(classes=role)
        self.files = files or []  # labels of the files attached to it
        self.role = role
        self.content = content
        self.note = note
        self.message_id = message_id
        self._stream: MarkdownStream | None = None

    def compose(self):  # type: ignore[no-untyped-def]
        yield Label(
            {"user": "You", "assistant": "Assistant", "system": "System"}.get(self.role, self.role),
            classes="who",
        )
        for label in self.files:
            yield Label(label, classes="file", markup=False)
        yield Markdown(self.content)
        yield Label(self.note, classes="note")

    def on_mount(self) -> None:
        self.query_one(".note", Label).display = bool(self.note)

    def set_note(self, note: str) -> None:
        """Safe before the view has composed (a reply that ends at once): compose then shows `self.note`."""
        self.note = note
        for label in self.query(".note").results(Label):
            label.update(note)
            label.display = bool(note)

    async def append(self, text: str) -> None:
        """Stream a fragment in; MarkdownStream coalesces fast writes into fewer re-renders."""
        self.content += text
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(text)

    async def finish(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify("Message copied to the clipboard")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.content)
        if not blocks:
            self.notify("No code block in this message", severity="warning")
            return
        self.app.copy_to_clipboard(blocks[-1])
        self.notify("Code block copied to the clipboard")
