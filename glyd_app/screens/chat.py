"""The chat screen: messages, the input box, the stats bar; and the reply being streamed.

The screen owns the conversation on screen and in the store; the app owns the engine and hands
engine events for the reply in flight to `on_delta`, `on_stats` and `on_finished`. A reply is saved
while it streams (about once a second) and once more when it ends, so a crash of either process
keeps what arrived.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from glyd_app.store import Chat, StoredMessage, title_from
from glyd_app.widgets.chat_input import ChatInput
from glyd_app.widgets.messages import MessageView
from glyd_app.widgets.stats_bar import StatsBar
from glyd_engine.engine.protocol import Delta, Finished, GenerationParams, Stats

if TYPE_CHECKING:
    from glyd_app.app import GlydApp

SAVE_EVERY_S = 1.0
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
    ]

    DEFAULT_CSS = """
    ChatScreen #messages { height: 1fr; padding: 0 1; }
    ChatScreen #banner { display: none; background: $error 30%; color: $text; padding: 0 1; }
    ChatScreen #banner.shown { display: block; }
    ChatScreen #empty { color: $text-muted; padding: 1 2; }
    ChatScreen ChatInput { margin: 0 1; }
    """

    app: GlydApp  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.chat: Chat | None = None
        self.reply_view: MessageView | None = None
        self.reply_id: int | None = None  # store id of the assistant message being streamed
        self.reply_rid: str | None = None  # engine request id
        self.last_save = 0.0

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="banner", markup=False)
        yield VerticalScroll(id="messages")
        yield ChatInput(id="input")
        yield StatsBar(id="stats")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one(ChatInput).focus()
        await self.app.chat_screen_mounted()

    # ------------------------------------------------------------------ conversations

    @property
    def busy(self) -> bool:
        return self.reply_rid is not None

    async def show_chat(self, chat: Chat) -> None:
        """Replace what is on screen with `chat` from the store."""
        self.chat = chat
        self.app.sub_title = chat.title
        box = self.query_one("#messages", VerticalScroll)
        await box.remove_children()
        messages = self.app.store.messages(chat.id)
        views = [self._view(m) for m in messages]
        if not views:
            views_or_hint = [Static("Type a message and press Enter. F1 for help, Ctrl+P for commands.", id="empty")]
            await box.mount_all(views_or_hint)
        else:
            await box.mount_all(views)
        box.scroll_end(animate=False)

    def _view(self, m: StoredMessage) -> MessageView:
        note = ""
        if m.status in FINISH_NOTES:
            note = FINISH_NOTES[m.status]
        elif m.status == "interrupted":
            note = FINISH_NOTES["error"]
        elif m.status == "streaming":
            note = "This reply was cut off when the app closed."
        return MessageView(m.role, m.content, note, m.id)

    def retitle(self) -> None:
        if self.chat is not None:
            self.chat = self.app.store.chat(self.chat.id)
            self.app.sub_title = self.chat.title

    def show_banner(self, text: str) -> None:
        banner = self.query_one("#banner", Static)
        banner.update(text)
        banner.set_class(bool(text), "shown")

    # ------------------------------------------------------------------ sending

    async def on_chat_input_send(self, event: ChatInput.Send) -> None:
        event.stop()
        await self.send(event.text)

    async def send(self, text: str) -> None:
        if self.chat is None:
            return
        if self.busy:
            self.notify("A reply is still streaming: Esc stops it.", severity="warning")
            return
        store = self.app.store
        if not store.messages(self.chat.id) and self.chat.title == "New chat":
            store.rename_chat(self.chat.id, title_from(text))
            self.retitle()
        stored = store.add_message(self.chat.id, "user", text)
        box = self.query_one("#messages", VerticalScroll)
        for hint in box.query("#empty"):
            await hint.remove()
        await box.mount(MessageView("user", text, message_id=stored.id))
        box.scroll_end(animate=False)
        self.query_one(ChatInput).clear()
        await self.maybe_reply()

    async def maybe_reply(self) -> None:
        """Ask the engine for a reply if the last message is the user's and the engine is ready;
        otherwise the message waits and is answered when the engine becomes ready."""
        if self.chat is None or self.busy:
            return
        messages = self.app.store.messages(self.chat.id)
        if not messages or messages[-1].role != "user":
            return
        if not self.app.engine_ready:
            self.notify("The engine is still starting; your message is sent as soon as it is ready.")
            return
        chat = self.app.store.chat(self.chat.id)
        history = [{"role": m.role, "content": m.content} for m in messages if m.content.strip()]
        params = GenerationParams(
            temperature=chat.temperature,
            top_p=chat.top_p,
            max_tokens=chat.max_tokens,
            system_prompt=chat.system_prompt,
            seed=chat.seed,
        )
        model = self.app.model_spec
        stored = self.app.store.add_message(chat.id, "assistant", "", status="streaming", model=model)
        view = MessageView("assistant", "", message_id=stored.id)
        box = self.query_one("#messages", VerticalScroll)
        await box.mount(view)
        box.anchor()
        self.reply_view, self.reply_id = view, stored.id
        self.reply_rid = self.app.generate(history, params)
        self.last_save = time.monotonic()
        bar = self.query_one(StatsBar)
        bar.stats = None  # the previous reply's numbers say nothing about this one
        bar.busy = True
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            # only while a reply streams (and only then in the footer); otherwise Ctrl+C goes on to copy
            return self.busy
        return True

    def action_stop(self) -> None:
        if self.busy:
            self.app.stop_generation()

    async def _drop_from(self, message_id: int) -> None:
        """Remove a message and every later one of this chat, from the store and the screen."""
        assert self.chat is not None
        for m in self.app.store.messages(self.chat.id):
            if m.id >= message_id:
                self.app.store.delete_message(m.id)
        for view in list(self.query(MessageView)):
            if view.message_id is not None and view.message_id >= message_id:
                await view.remove()

    async def action_regenerate(self) -> None:
        """Ask again for the last reply (the previous one is replaced)."""
        if self.chat is None or self.busy:
            self.notify("A reply is streaming: Esc stops it first." if self.busy else "No chat.", timeout=3)
            return
        messages = self.app.store.messages(self.chat.id)
        if not any(m.role == "user" for m in messages):
            self.notify("Nothing to regenerate yet.", timeout=3)
            return
        if messages[-1].role == "assistant":
            await self._drop_from(messages[-1].id)
        await self.maybe_reply()

    async def action_edit_last(self) -> None:
        """Take the last message back into the box to edit and send again (its reply goes with it)."""
        if self.chat is None or self.busy:
            self.notify("A reply is streaming: Esc stops it first." if self.busy else "No chat.", timeout=3)
            return
        last = next((m for m in reversed(self.app.store.messages(self.chat.id)) if m.role == "user"), None)
        if last is None:
            self.notify("No message to edit yet.", timeout=3)
            return
        await self._drop_from(last.id)
        box = self.query_one(ChatInput)
        box.text = last.content
        box.focus()
        box.move_cursor(box.document.end)

    # ------------------------------------------------------------------ engine events for the reply

    async def on_delta(self, event: Delta) -> None:
        if self.reply_view is None or event.id != self.reply_rid:
            return
        await self.reply_view.append(event.text)
        if time.monotonic() - self.last_save >= SAVE_EVERY_S and self.reply_id is not None:
            self.last_save = time.monotonic()
            self.app.store.update_message(self.reply_id, content=self.reply_view.content)

    def on_stats(self, event: Stats) -> None:
        if event.id != self.reply_rid and not event.final:
            return
        self.query_one(StatsBar).stats = event
        self.last_stats = event
        if event.final and self.reply_id is not None:
            self.app.store.update_message(self.reply_id, stats=_stats_dict(event))

    async def on_finished(self, event: Finished) -> None:
        if event.id != self.reply_rid:
            return
        view, rid = self.reply_view, self.reply_id
        if view is not None and rid is not None:
            await view.finish()
            status = {"stop": "done", "length": "length", "stopped": "stopped"}.get(event.reason, "interrupted")
            self.app.store.update_message(rid, content=view.content, status=status)
            note = FINISH_NOTES.get(status) or (FINISH_NOTES["error"] if status == "interrupted" else "")
            view.set_note(note)
        # the reply is over (a new message may be sent) only once the store holds its final state
        self.reply_view = self.reply_id = self.reply_rid = None
        self.query_one(StatsBar).busy = False
        self.refresh_bindings()
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    def last_reply(self) -> MessageView | None:
        views = [v for v in self.query(MessageView) if v.role == "assistant"]
        return views[-1] if views else None


def _stats_dict(s: Stats) -> dict[str, float | int | None]:
    return {
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "prompt_tps": s.prompt_tps,
        "gen_tps": s.gen_tps,
        "ttft_s": s.ttft_s,
    }
