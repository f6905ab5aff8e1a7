"""One chat session with no UI in it: the store, the engine, the open chat and the reply in flight.

The session is the one writer of the app's state: every change to the chat store, and what the engine's
events do to the session, happens here. The chat screen draws the conversation (`SessionView`) and the app
draws the engine's life (`EngineView`): both only render what they are told. Nothing here imports Textual
(tests/app/test_boundaries.py): the engine's events reach the session through `on_event`, and where they come
from (the app's message queue, a test's list) is the caller's business.

A reply is saved while it streams (about once a second) and once more when it ends, so a crash of either
process keeps what arrived.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from glyd_app.attachments import Attachment, TokenCounter, model_text
from glyd_app.store import Chat, SearchHit, Store, StoredAttachment, StoredMessage, title_from
from glyd_engine.engine.client import EngineClient, EngineLike
from glyd_engine.engine.protocol import (
    Delta,
    EngineSettings,
    Error,
    Event,
    Finished,
    GenerationParams,
    Progress,
    Ready,
    Stats,
    Stopped,
)
from glyd_engine.errors import CRASH

if TYPE_CHECKING:
    from glyd_engine.progress import ProgressEvent

EngineFactory = Callable[[Callable[[Event], None]], EngineLike]
# Where an engine start's events go, tagged with its generation; called from the client's reader thread
Post = Callable[[Event, int], None]

SAVE_EVERY_S = 1.0
EngineState = Literal["stopped", "starting", "ready", "failed", "stopping"]
Severity = Literal["information", "warning", "error"]
# How a reply ended (the engine's Finished.reason) as the store keeps it
REPLY_STATUS = {"stop": "done", "length": "length", "stopped": "stopped"}


def default_factory(on_event: Callable[[Event], None]) -> EngineLike:
    return EngineClient(on_event)


class SessionView(Protocol):
    """What the session tells whoever draws the conversation (the chat screen)."""

    def notice(self, text: str, severity: Severity = "information", timeout: float | None = None) -> None: ...
    async def reply_started(self, message_id: int) -> None: ...
    async def reply_text(self, text: str) -> None: ...
    def reply_stats(self, stats: Stats) -> None: ...
    async def reply_finished(self, status: str) -> None: ...
    def busy_changed(self, busy: bool) -> None: ...
    async def messages_dropped(self, from_id: int) -> None: ...


class EngineView(Protocol):
    """What the session tells whoever draws the engine's life (the app)."""

    def engine_progress(self, progress: Progress) -> None: ...
    def engine_ready(self, ready: Ready) -> None: ...
    def engine_failed(self, error: Error) -> None: ...
    def engine_error(self, error: Error) -> None: ...
    def engine_stopped(self) -> None: ...


@dataclass
class Reply:
    """The assistant message being streamed: its store row, its engine request, the text so far."""

    message_id: int
    request_id: str
    text: str = ""
    last_save: float = 0.0


class ChatSession:
    """The app's state that outlives a screen: which chat is open, the engine serving it, the reply streaming."""

    def __init__(
        self,
        model: str = "demo",
        settings: EngineSettings | None = None,
        engine_factory: EngineFactory = default_factory,
        store: Store | None = None,
        chat_id: int | None = None,
        install_if_missing: bool = True,
    ) -> None:
        self.model_spec = model
        self.settings = settings or EngineSettings()
        self.engine_factory = engine_factory
        self._store = store
        self.open_chat_id = chat_id
        self.install_if_missing = install_if_missing
        self.engine: EngineLike | None = None
        self.generation = 0  # which start the engine's events belong to; older ones are dropped
        self.engine_state: EngineState = "stopped"
        self.ready_info: Ready | None = None
        self.last_error: Error | None = None
        self.chat: Chat | None = None
        self.reply: Reply | None = None
        self.view: SessionView | None = None
        self.engine_view: EngineView | None = None
        self._engine_lock = threading.Lock()

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store()
        return self._store

    @property
    def engine_ready(self) -> bool:
        return self.engine_state == "ready" and self.engine is not None

    @property
    def busy(self) -> bool:
        """A reply is streaming: a new message, a regenerate or another chat waits for Esc."""
        return self.reply is not None

    def _view(self) -> SessionView:
        assert self.view is not None, "the chat screen attaches itself before anything is sent"
        return self.view

    # ------------------------------------------------------------------ chats

    def first_chat(self) -> Chat:
        """The chat asked for on the command line, else the last one open, else a new one."""
        wanted = self.open_chat_id
        if wanted is None:
            last = self.store.get_state("last_chat")
            wanted = int(last) if last and last.isdigit() else None
        chat = next((c for c in self.store.chats() if c.id == wanted), None) if wanted is not None else None
        return chat or self.store.new_chat(model=self.model_spec)

    def open(self, chat_id: int) -> Chat:
        self.chat = self.store.chat(chat_id)
        self.store.set_state("last_chat", str(chat_id))
        return self.chat

    def reload_chat(self) -> Chat | None:
        """The open chat as the store has it now (after a rename or new settings)."""
        if self.chat is not None:
            self.chat = self.store.chat(self.chat.id)
        return self.chat

    def messages(self) -> list[StoredMessage]:
        return self.store.messages(self.chat.id) if self.chat is not None else []

    def chats(self) -> list[Chat]:
        return self.store.chats()

    def chat_by_id(self, chat_id: int) -> Chat:
        return self.store.chat(chat_id)

    def message_count(self, chat_id: int) -> int:
        return len(self.store.messages(chat_id))

    def attachments(self, chat_id: int) -> dict[int, list[StoredAttachment]]:
        """The files attached to each message of the chat (by message id)."""
        return self.store.attachments(chat_id)

    def new_chat(self) -> Chat | None:
        """A new empty chat with the open one's settings (not opened yet); None, said to the view, while a reply
        streams or when the open chat is empty already."""
        chat = self.chat
        if self.busy:
            self._view().notice("A reply is streaming: Esc stops it first.", "warning")
            return None
        if chat is not None and not self.store.messages(chat.id):
            self._view().notice("This chat is already empty.")
            return None
        settings = {}
        if chat is not None:
            settings = {"system_prompt": chat.system_prompt, "temperature": chat.temperature, "top_p": chat.top_p,
                        "max_tokens": chat.max_tokens, "seed": chat.seed}
        return self.store.new_chat(model=self.model_spec, **settings)

    def chat_after_delete(self) -> Chat:
        """What to open once the open chat was deleted: the latest one left, else a new one."""
        remaining = self.store.chats()
        return remaining[0] if remaining else self.store.new_chat(model=self.model_spec)

    def save_chat_settings(self, chat_id: int, system_prompt: str, temperature: float | None, top_p: float | None,
                           max_tokens: int, seed: int | None) -> None:
        self.store.update_chat(chat_id, system_prompt=system_prompt, temperature=temperature, top_p=top_p,
                               max_tokens=max_tokens, seed=seed)
        self.reload_chat()

    # ------------------------------------------------------------------ models

    def model_dirs(self) -> list[Path]:
        """The model directories the user added (the model picker lists them)."""
        return self.store.model_dirs()

    def forget_model_dir(self, path: Path) -> None:
        self.store.remove_model_dir(path)

    def use_model(self, spec: str, added_dir: bool = False) -> None:
        """The open chat now runs `spec` (the reply in flight is stopped; a directory the user picked is kept for the
        picker). The engine start is the app's to ask for."""
        if added_dir:
            self.store.add_model_dir(spec)
        self.stop_reply()
        if self.chat is not None:
            self.store.update_chat(self.chat.id, model=spec)
            self.reload_chat()

    def use_kv_mode(self, mode: str) -> None:
        """The KV mode the next engine start asks for."""
        self.settings.kv = mode

    def search(self, text: str) -> list[SearchHit]:
        """Chats whose title or a message holds every word of `text` (the store's full-text index)."""
        return self.store.search(text)

    def rename_chat(self, chat_id: int, title: str) -> None:
        self.store.rename_chat(chat_id, title)
        if self.chat is not None and self.chat.id == chat_id:
            self.reload_chat()

    def delete_chat(self, chat_id: int) -> bool:
        """Delete a chat and its messages; False (and nothing deleted) for the open chat while its reply
        streams, whose next save would land nowhere."""
        if self.busy and self.chat is not None and self.chat.id == chat_id:
            return False
        self.store.delete_chat(chat_id)
        return True

    def export_chat(self, chat_id: int, directory: Path) -> Path:
        """The chat as a Markdown file in `directory` (written atomically, never over an earlier export)."""
        return self.store.export_to(chat_id, directory)

    # ------------------------------------------------------------------ the engine's life

    def begin_start(self, spec: str) -> int:
        """A new start of `spec`: what the previous engine said no longer holds. Returns its generation."""
        self.generation += 1
        self.model_spec = spec
        self.engine_state = "starting"
        self.ready_info = None
        self.last_error = None
        return self.generation

    def spawn(self, spec: str, generation: int, post: Post) -> None:
        """Shut the previous engine down (its child exits, freeing its memory), then spawn the new one;
        its events go to `post` with `generation` (from the client's reader thread: `post` hands them over to
        whoever calls `on_event`). Blocks: the app runs it in a thread.

        Serialised by a lock: a second switch while the first is still spawning waits, then shuts the
        first one down; a start that was superseded meanwhile does nothing.
        """
        with self._engine_lock:
            old, self.engine = self.engine, None
            if old is not None:
                old.shutdown()
            if generation != self.generation:
                return
            if self.install_if_missing:
                _install_engine_if_missing(post, generation)
            client = self.engine_factory(lambda event: post(event, generation))
            self.engine = client
            client.start(spec, self.settings)

    def begin_cancel(self) -> EngineLike | None:
        """The start is being cancelled; returns the engine to cancel (off the UI thread)."""
        self.engine_state = "stopping"
        return self.engine

    def engine_failed(self, error: Error) -> None:
        """The start failed, or the engine died: told to the engine's view (also for a spawn that raised)."""
        self.engine_state = "failed"
        self.last_error = error
        if self.engine_view is not None:
            self.engine_view.engine_failed(error)

    def engine_loaded(self, ready: Ready) -> None:
        self.engine_state = "ready"
        self.ready_info = ready

    async def on_event(self, event: Event, generation: int) -> None:
        """One event of the engine start `generation` (older starts' events are dropped): the session's state
        changes here, then the views are told."""
        if generation != self.generation:
            return
        view = self.engine_view
        if isinstance(event, Progress):
            if view is not None:
                view.engine_progress(event)
        elif isinstance(event, Ready):
            self.engine_loaded(event)
            if view is not None:
                view.engine_ready(event)
            await self.request_reply()  # a message sent while the engine started
        elif isinstance(event, Delta | Stats | Finished):
            await self.on_reply_event(event)
        elif isinstance(event, Error):
            if event.fatal:
                self.engine_failed(event)
            elif view is not None:
                view.engine_error(event)
        elif isinstance(event, Stopped):
            exited = self.engine_exited()
            if exited == "unexpected":
                self.engine_failed(Error("The engine process exited.", CRASH, fatal=True))
            elif exited == "stopped" and view is not None:
                view.engine_stopped()

    def engine_exited(self) -> Literal["unexpected", "stopped"] | None:
        """The child is gone: "unexpected" when it was serving (a failure to report), "stopped" when it was
        asked to go, None when its start had already failed."""
        if self.engine_state in ("failed", "stopping"):
            self.engine = None
        if self.engine_state == "ready":
            return "unexpected"
        if self.engine_state == "stopping":
            self.engine_state = "stopped"
            return "stopped"
        return None

    def stop_for_quit(self) -> EngineLike | None:
        """Keep the reply in flight as stopped and hand over the engine to shut down."""
        if self.reply is not None:
            self.store.update_message(self.reply.message_id, content=self.reply.text, status="stopped")
        engine, self.engine = self.engine, None
        self.engine_state = "stopping"
        return engine

    # ------------------------------------------------------------------ sending and replies

    def add_user_message(self, text: str, attachments: Sequence[Attachment] = ()) -> StoredMessage:
        """Store what the user sent, with the files attached to it; a new chat takes its title from its
        first message."""
        assert self.chat is not None
        if not self.store.messages(self.chat.id) and self.chat.title == "New chat":
            self.store.rename_chat(self.chat.id, title_from(text))
            self.reload_chat()
        stored = self.store.add_message(self.chat.id, "user", text)
        for a in attachments:
            self.store.add_attachment(stored.id, a.name, a.content, a.tokens)
        return stored

    def token_counter(self) -> TokenCounter:
        """Token counts for the model that is loaded (its tokenizer), else a byte bound."""
        return TokenCounter(self.ready_info.path if self.ready_info is not None else None)

    @property
    def context_length(self) -> int:
        """The loaded engine's context, else the one it is being started with."""
        return self.ready_info.max_model_len if self.ready_info is not None else self.settings.max_model_len

    async def request_reply(self) -> None:
        """Ask the engine for a reply if the last message is the user's and the engine is ready;
        otherwise the message waits and is answered when the engine becomes ready."""
        if self.chat is None or self.busy:
            return
        messages = self.store.messages(self.chat.id)
        if not messages or messages[-1].role != "user":
            return
        if not self.engine_ready:
            self._view().notice("The engine is still starting; your message is sent as soon as it is ready.")
            return
        assert self.engine is not None
        chat = self.store.chat(self.chat.id)
        files = self.store.attachments(chat.id)
        history = [{"role": m.role, "content": model_text(m.content, files.get(m.id, []))}
                   for m in messages if m.content.strip() or m.id in files]
        params = GenerationParams(
            temperature=chat.temperature,
            top_p=chat.top_p,
            max_tokens=chat.max_tokens,
            system_prompt=chat.system_prompt,
            seed=chat.seed,
        )
        stored = self.store.add_message(chat.id, "assistant", "", status="streaming", model=self.model_spec)
        await self._view().reply_started(stored.id)
        # no await from here until `reply` is set: the request's first events may already be queued
        self.reply = Reply(stored.id, self.engine.generate(history, params), last_save=time.monotonic())
        self._view().busy_changed(True)

    def stop_reply(self) -> None:
        if self.busy and self.engine is not None:
            self.engine.stop_generation()

    def _refused_while_busy(self) -> bool:
        if self.chat is None or self.busy:
            self._view().notice("A reply is streaming: Esc stops it first." if self.busy else "No chat.", timeout=3)
            return True
        return False

    async def regenerate(self) -> None:
        """Ask again for the last reply (the previous one is replaced)."""
        if self._refused_while_busy():
            return
        messages = self.messages()
        if not any(m.role == "user" for m in messages):
            self._view().notice("Nothing to regenerate yet.", timeout=3)
            return
        if messages[-1].role == "assistant":
            await self._drop_from(messages[-1].id)
        await self.request_reply()

    async def take_back_last(self) -> str | None:
        """Remove the last user message and its reply; returns its text to edit, None when there is none."""
        if self._refused_while_busy():
            return None
        last = next((m for m in reversed(self.messages()) if m.role == "user"), None)
        if last is None:
            self._view().notice("No message to edit yet.", timeout=3)
            return None
        await self._drop_from(last.id)
        return last.content

    async def _drop_from(self, message_id: int) -> None:
        """Remove a message and every later one of this chat, from the store and the screen."""
        for m in self.messages():
            if m.id >= message_id:
                self.store.delete_message(m.id)
        await self._view().messages_dropped(message_id)

    # ------------------------------------------------------------------ engine events for the reply

    async def on_reply_event(self, event: Delta | Stats | Finished) -> None:
        if isinstance(event, Delta):
            await self._delta(event)
        elif isinstance(event, Stats):
            self._stats(event)
        else:
            await self._finished(event)

    async def _delta(self, event: Delta) -> None:
        reply = self.reply
        if reply is None or event.id != reply.request_id:
            return
        reply.text += event.text
        await self._view().reply_text(event.text)
        if time.monotonic() - reply.last_save >= SAVE_EVERY_S:
            reply.last_save = time.monotonic()
            self.store.update_message(reply.message_id, content=reply.text)

    def _stats(self, event: Stats) -> None:
        reply = self.reply
        if (reply is None or event.id != reply.request_id) and not event.final:
            return
        self._view().reply_stats(event)
        if event.final and reply is not None:
            self.store.update_message(reply.message_id, stats=_stats_dict(event))

    async def _finished(self, event: Finished) -> None:
        reply = self.reply
        if reply is None or event.id != reply.request_id:
            return
        status = REPLY_STATUS.get(event.reason, "interrupted")
        self.store.update_message(reply.message_id, content=reply.text, status=status)
        await self._view().reply_finished(status)
        # the reply is over (a new message may be sent) only once the store holds its final state
        self.reply = None
        self._view().busy_changed(False)


def _install_engine_if_missing(post: Post, generation: int) -> None:
    from glyd_engine.engine.install import engine_available, install_engine

    if engine_available():
        return

    def progress(ev: ProgressEvent) -> None:
        post(Progress.of(ev), generation)

    install_engine(progress)


def _stats_dict(s: Stats) -> dict[str, float | int | None]:
    return {
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "prompt_tps": s.prompt_tps,
        "gen_tps": s.gen_tps,
        "ttft_s": s.ttft_s,
    }
