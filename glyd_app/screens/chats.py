"""The chat list: open, rename, delete, export to Markdown. Returns the chat id to open (or None)."""

from __future__ import annotations

import datetime as dt

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from glyd_app.screens.dialogs import Confirm, TextPrompt
from glyd_app.store import Chat, Store


def when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


class ChatsChanged(Message):
    """A chat was renamed or deleted from the list; the chat screen refreshes its title."""

    def __init__(self, deleted: int | None = None) -> None:
        super().__init__()
        self.deleted = deleted


class ExportChat(Message):
    """Export this chat (the app knows where exports go)."""

    def __init__(self, chat_id: int) -> None:
        super().__init__()
        self.chat_id = chat_id


class ChatList(ModalScreen[int | None]):
    BINDINGS = [
        Binding("escape", "dismiss_none", "Close"),
        Binding("r", "rename", "Rename", id="glyd.chats_rename"),
        Binding("d,delete", "delete", "Delete", id="glyd.chats_delete"),
        Binding("e", "export", "Export", id="glyd.chats_export"),
    ]

    DEFAULT_CSS = """
    ChatList { align: center middle; }
    ChatList > Vertical { width: 90; height: auto; max-height: 90%; padding: 1 2;
                          border: thick $primary; background: $surface; }
    ChatList .title { text-style: bold; }
    ChatList OptionList { height: auto; max-height: 20; margin: 1 0; }
    ChatList .hint { color: $text-muted; }
    """

    def __init__(self, store: Store, current: int | None, export_dir_label: str = "") -> None:
        super().__init__()
        self.store = store
        self.current = current
        self.chats: list[Chat] = []
        self.export_dir_label = export_dir_label

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Chats", classes="title")
            yield OptionList(id="chat-list")
            yield Label("Enter: open · r: rename · d: delete · e: export to Markdown · Esc: close", classes="hint")

    def on_mount(self) -> None:
        self.refresh_list()
        self.query_one(OptionList).focus()

    def refresh_list(self) -> None:
        previous = self.highlighted_chat() if self.chats else None
        self.chats = self.store.chats()
        options = self.query_one(OptionList)
        keep = options.highlighted
        options.clear_options()
        for chat in self.chats:
            n = len(self.store.messages(chat.id))
            mark = "● " if chat.id == self.current else "  "
            options.add_option(
                Option(f"{mark}{chat.title}  [dim]{n} messages · {when(chat.updated)}[/]", id=str(chat.id))
            )
        if not self.chats:
            options.add_option(Option("No chats yet", disabled=True))
        elif previous is not None and any(c.id == previous.id for c in self.chats):
            options.highlighted = next(i for i, c in enumerate(self.chats) if c.id == previous.id)
        elif keep is not None:
            options.highlighted = min(keep, len(self.chats) - 1)
        else:
            options.highlighted = next((i for i, c in enumerate(self.chats) if c.id == self.current), 0)

    def highlighted_chat(self) -> Chat | None:
        i = self.query_one(OptionList).highlighted
        return self.chats[i] if i is not None and i < len(self.chats) else None

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id:
            self.dismiss(int(event.option.id))

    def action_rename(self) -> None:
        chat = self.highlighted_chat()
        if chat is None:
            return

        def done(title: str | None) -> None:
            if title:
                self.store.rename_chat(chat.id, title)
                self.app.post_message(ChatsChanged())
                self.refresh_list()

        self.app.push_screen(TextPrompt("Rename chat", chat.title), done)

    def action_delete(self) -> None:
        chat = self.highlighted_chat()
        if chat is None:
            return

        def done(yes: bool | None) -> None:
            if yes:
                self.store.delete_chat(chat.id)
                self.app.post_message(ChatsChanged(deleted=chat.id))
                self.refresh_list()

        self.app.push_screen(Confirm(f"Delete “{chat.title}” and its messages?"), done)

    def action_export(self) -> None:
        chat = self.highlighted_chat()
        if chat is not None:
            self.app.post_message(ExportChat(chat.id))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
