"""The chat screen: messages, the input box, the stats bar; it draws the session's chat and reply.

What a send, a stop or a regenerate does is the session's (session.py); the screen turns keys into calls
on it and draws what it reports back (`SessionView`). It never calls into the app: the app learns that
the screen is up from the `Shown` message.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from glyd_app.attachments import Attachment, AttachmentError, context_error, read_attachment
from glyd_app.session import ChatSession, Severity
from glyd_app.store import Chat, StoredMessage
from glyd_app.widgets.chat_input import ChatInput
from glyd_app.widgets.messages import MessageView
from glyd_app.widgets.stats_bar import StatsBar
from glyd_engine.engine.protocol import Stats

FINISH_NOTES = {
    "stopped": "Stopped (Esc).",
    "length": "Reached the max tokens limit (chat settings: F4).",
    "error": "The engine stopped mid-reply; the text so far is kept. Ctrl+R restarts the engine.",
}


class ChatScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "stop", "Stop reply", id="glyd.stop"),
        # Ctrl+C stops a reply too, as in a terminal; when none is streaming it copies, as TextArea does.
        Binding("ctrl+c", "stop", "Stop reply", id="glyd.interrupt", show=False, priority=True),
        Binding("ctrl+g", "regenerate", "Regenerate", id="glyd.regenerate", show=False),
        Binding("ctrl+t", "edit_last", "Edit last message", id="glyd.edit_last", show=False),
        Binding("f8", "attach", "Attach file", id="glyd.attach", show=False),
        Binding("shift+f8", "detach", "Remove the last attached file", id="glyd.detach", show=False),
    ]

    DEFAULT_CSS = """
    ChatScreen #messages { height: 1fr; padding: 0 1; }
    ChatScreen #banner { display: none; background: $error 30%; color: $text; padding: 0 1; }
    ChatScreen #banner.shown { display: block; }
    ChatScreen #empty { color: $text-muted; padding: 1 2; }
    ChatScreen ChatInput { margin: 0 1; }
    ChatScreen #attached { display: none; color: $accent; padding: 0 2; }
    ChatScreen #attached.shown { display: block; }
    """

    class Shown(Message):
        """The screen is up with its chat drawn: the app starts the engine after this first frame."""

    def __init__(self, session: ChatSession) -> None:
        super().__init__()
        self.session = session
        session.view = self
        # one bar for the screen's life: engine events that land while the screen mounts or unmounts still have it
        self.stats_bar = StatsBar(id="stats")
        self.reply_view: MessageView | None = None
        self.pending: list[Attachment] = []  # files attached to the message being typed

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="banner", markup=False)
        yield VerticalScroll(id="messages")
        yield Static("", id="attached", markup=False)
        yield ChatInput(id="input")
        yield self.stats_bar
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one(ChatInput).focus()
        await self.show_chat(self.session.open(self.session.first_chat().id))
        self.post_message(self.Shown())

    # ------------------------------------------------------------------ conversations

    async def show_chat(self, chat: Chat) -> None:
        """Replace what is on screen with `chat` from the store."""
        self.app.sub_title = chat.title
        box = self.query_one("#messages", VerticalScroll)
        await box.remove_children()
        files = self.session.attachments(chat.id)
        views = [self._view(m, [f"📎 {a.name} · {a.tokens:,} tokens" for a in files.get(m.id, [])])
                 for m in self.session.messages()]
        if not views:
            views_or_hint = [Static("Type a message and press Enter. F1 for help, Ctrl+P for commands.", id="empty")]
            await box.mount_all(views_or_hint)
        else:
            await box.mount_all(views)
        box.scroll_end(animate=False)

    def _view(self, m: StoredMessage, files: list[str] | None = None) -> MessageView:
        note = ""
        if m.status in FINISH_NOTES:
            note = FINISH_NOTES[m.status]
        elif m.status == "interrupted":
            note = FINISH_NOTES["error"]
        elif m.status == "streaming":
            note = "This reply was cut off when the app closed."
        return MessageView(m.role, m.content, note, m.id, files)

    def retitle(self) -> None:
        chat = self.session.reload_chat()
        if chat is not None:
            self.app.sub_title = chat.title

    def show_banner(self, text: str) -> None:
        banner = self.query_one("#banner", Static)
        banner.update(text)
        banner.set_class(bool(text), "shown")

    # ------------------------------------------------------------------ sending

    async def on_chat_input_send(self, event: ChatInput.Send) -> None:
        event.stop()
        await self.send(event.text, event.raw)

    async def send(self, text: str, raw: str | None = None) -> None:
        """Send `text`; the box loses `raw` (the box's text it came from; None: all of it), and keeps any
        key typed after Enter."""
        if self.session.chat is None:
            return
        if self.session.busy:
            self.notify("A reply is still streaming: Esc stops it.", severity="warning")
            return
        files = list(self.pending)
        if files:
            counter = self.session.token_counter()
            chat = self.session.chat_by_id(self.session.chat.id)
            error = context_error(counter.count(text), files, chat.max_tokens, self.session.context_length,
                                  counter.method)
            if error:
                self.notify(error, severity="error", timeout=12)
                return
        stored = self.session.add_user_message(text, files)
        self.pending = []
        self._show_pending()
        self.app.sub_title = self.session.chat.title  # a new chat is named after its first message
        box = self.query_one("#messages", VerticalScroll)
        for hint in box.query("#empty"):
            await hint.remove()
        await box.mount(MessageView("user", text, message_id=stored.id, files=[a.label() for a in files]))
        box.scroll_end(animate=False)
        box_input = self.query_one(ChatInput)
        if raw is None:
            box_input.clear()
        else:
            box_input.consume(raw)
        await self.session.request_reply()

    def action_attach(self) -> None:
        from glyd_app.screens.attach import AttachScreen

        def chosen(path: Path | None) -> None:
            if path is not None:
                self.attach(path)

        self.app.push_screen(AttachScreen(), chosen)

    def attach(self, path: Path) -> bool:
        """Attach a text file to the message being typed, if it can be read and fits the context."""
        counter = self.session.token_counter()
        try:
            file = read_attachment(path, counter)
        except (AttachmentError, OSError) as exc:
            self.notify(f"Not attached: {exc}", severity="error", timeout=10)
            return False
        chat = self.session.chat_by_id(self.session.chat.id) if self.session.chat else None
        reply = chat.max_tokens if chat is not None else 0
        error = context_error(0, [*self.pending, file], reply, self.session.context_length, counter.method)
        if error:
            self.notify(f"Not attached: {error}", severity="error", timeout=12)
            return False
        self.pending.append(file)
        self._show_pending()
        self.query_one(ChatInput).focus()
        return True

    def action_detach(self) -> None:
        if self.pending:
            self.notify(f"Removed {self.pending.pop().name}")
            self._show_pending()

    def _show_pending(self) -> None:
        bar = self.query_one("#attached", Static)
        labels = "   ".join(a.label() for a in self.pending)
        bar.update(f"{labels}   (Shift+F8 removes the last)" if labels else "")
        bar.set_class(bool(self.pending), "shown")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            # only while a reply streams (and only then in the footer); otherwise Ctrl+C goes on to copy
            return self.session.busy
        return True

    def action_stop(self) -> None:
        self.session.stop_reply()

    async def action_regenerate(self) -> None:
        await self.session.regenerate()

    async def action_edit_last(self) -> None:
        """Take the last message back into the box to edit and send again (its reply goes with it)."""
        text = await self.session.take_back_last()
        if text is None:
            return
        box = self.query_one(ChatInput)
        box.text = text
        box.focus()
        box.move_cursor(box.document.end)

    def last_reply(self) -> MessageView | None:
        views = [v for v in self.query(MessageView) if v.role == "assistant"]
        return views[-1] if views else None

    # ------------------------------------------------------------------ what the session reports (SessionView)

    def notice(self, text: str, severity: Severity = "information", timeout: float | None = None) -> None:
        self.notify(text, severity=severity, timeout=timeout)

    async def reply_started(self, message_id: int) -> None:
        view = MessageView("assistant", "", message_id=message_id)
        box = self.query_one("#messages", VerticalScroll)
        await box.mount(view)
        box.anchor()
        self.reply_view = view

    async def reply_text(self, text: str) -> None:
        if self.reply_view is not None:
            await self.reply_view.append(text)

    def reply_stats(self, stats: Stats) -> None:
        self.stats_bar.stats = stats

    async def reply_finished(self, status: str) -> None:
        view, self.reply_view = self.reply_view, None
        if view is not None:
            await view.finish()
            view.set_note(FINISH_NOTES.get(status) or (FINISH_NOTES["error"] if status == "interrupted" else ""))

    def busy_changed(self, busy: bool) -> None:
        bar = self.stats_bar
        if busy:
            bar.stats = None  # the previous reply's numbers say nothing about this one
        bar.busy = busy
        self.refresh_bindings()
        if not busy:
            self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    async def messages_dropped(self, from_id: int) -> None:
        for view in list(self.query(MessageView)):
            if view.message_id is not None and view.message_id >= from_id:
                await view.remove()
