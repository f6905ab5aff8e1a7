"""The chat list: search every chat, open, rename, delete, export to Markdown. Returns the chat id to open.

The search box filters as the user types: full-text over titles and messages (the store's FTS5 index),
every word must appear, prefixes match ("pyth loo" finds "Python loops"). Rename, delete and export act on
the highlighted chat, found or listed; what they write goes through the chat session.
"""

from __future__ import annotations

import datetime as dt

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from glyd_app.screens.dialogs import Confirm, TextPrompt
from glyd_app.session import ChatSession
from glyd_app.store import HIT_END, HIT_START, Chat, SearchHit


def when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def highlighted(snippet: str) -> Text:
    """A search snippet with its matched words in bold reverse (the store marks them)."""
    text = Text()
    bold = False
    for part in snippet.replace(HIT_END, HIT_START).split(HIT_START):
        text.append(" ".join(part.split("\n")), style="bold reverse" if bold else "")
        bold = not bold
    return text


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
        Binding("slash", "search", "Search", id="glyd.chats_search"),
    ]

    DEFAULT_CSS = """
    ChatList { align: center middle; }
    ChatList > Vertical { width: 90; height: auto; max-height: 90%; padding: 1 2;
                          border: thick $primary; background: $surface; }
    ChatList .title { text-style: bold; }
    ChatList Input { margin-top: 1; }
    ChatList OptionList { height: auto; max-height: 20; margin: 1 0; }
    ChatList .hint { color: $text-muted; }
    """

    def __init__(self, session: ChatSession, current: int | None, search: bool = False) -> None:
        super().__init__()
        self.start_in_search = search
        self.session = session
        self.current = current
        self.chats: list[Chat] = []
        self.hits: list[SearchHit] | None = None  # None: no search, every chat is listed

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Chats", classes="title")
            yield Input(placeholder="Search all chats (titles and messages)…", id="chat-search")
            yield OptionList(id="chat-list")
            yield Label(
                "Enter: open · r: rename · d: delete · e: export to Markdown · /: search · Esc: close", classes="hint"
            )

    def on_mount(self) -> None:
        self.refresh_list()
        self.query_one("#chat-search" if self.start_in_search else "#chat-list").focus()

    @property
    def query_text(self) -> str:
        return self.query_one("#chat-search", Input).value.strip()

    def refresh_list(self) -> None:
        """List every chat, or the chats that match the search box; the highlight stays on the same chat."""
        previous = self.highlighted_chat_id()
        session = self.session
        self.hits = session.search(self.query_text) if self.query_text else None
        self.chats = session.chats() if self.hits is None else [session.chat_by_id(h.chat_id) for h in self.hits]
        options = self.query_one(OptionList)
        options.clear_options()
        if self.hits is None:
            for chat in self.chats:
                n = session.message_count(chat.id)
                mark = "● " if chat.id == self.current else "  "
                options.add_option(
                    Option(f"{mark}{chat.title}  [dim]{n} messages · {when(chat.updated)}[/]", id=str(chat.id))
                )
        else:
            for hit in self.hits:
                options.add_option(Option(self._hit_prompt(hit), id=str(hit.chat_id)))
        if not self.chats:
            empty = "No chats yet" if self.hits is None else f"No chat contains “{self.query_text}”"
            options.add_option(Option(empty, disabled=True))
            return
        ids = [c.id for c in self.chats]
        for wanted in (previous, self.current):
            if wanted in ids:
                options.highlighted = ids.index(wanted)
                break
        else:
            options.highlighted = 0

    def _hit_prompt(self, hit: SearchHit) -> Text:
        mark = "● " if hit.chat_id == self.current else "  "
        found = f"{hit.matches} matching message{'s' if hit.matches != 1 else ''}" if hit.matches else "title matches"
        prompt = Text(mark) + Text(hit.title, style="bold") + Text(f"  {found} · {when(hit.updated)}", style="dim")
        if hit.snippet:
            prompt += Text("\n    ") + highlighted(hit.snippet)
        return prompt

    def highlighted_chat_id(self) -> int | None:
        chat = self.highlighted_chat()
        return chat.id if chat is not None else None

    def highlighted_chat(self) -> Chat | None:
        if not self.is_mounted:
            return None
        i = self.query_one(OptionList).highlighted
        return self.chats[i] if i is not None and i < len(self.chats) else None

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.refresh_list()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the search box: to the results (Enter there opens one)."""
        event.stop()
        if self.chats:
            self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id:
            self.dismiss(int(event.option.id))

    def action_search(self) -> None:
        self.query_one("#chat-search", Input).focus()

    def action_rename(self) -> None:
        chat = self.highlighted_chat()
        if chat is None:
            return

        def done(title: str | None) -> None:
            if title:
                self.session.rename_chat(chat.id, title)
                self.app.post_message(ChatsChanged())
                self.refresh_list()

        self.app.push_screen(TextPrompt("Rename chat", chat.title), done)

    def action_delete(self) -> None:
        chat = self.highlighted_chat()
        if chat is None:
            return

        def done(yes: bool | None) -> None:
            if not yes:
                return
            if not self.session.delete_chat(chat.id):
                self.notify("Its reply is still streaming: Esc stops it first.", severity="warning")
                return
            self.app.post_message(ChatsChanged(deleted=chat.id))
            self.refresh_list()

        self.app.push_screen(Confirm(f"Delete “{chat.title}” and its messages?"), done)

    def action_export(self) -> None:
        chat = self.highlighted_chat()
        if chat is not None:
            self.app.post_message(ExportChat(chat.id))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
