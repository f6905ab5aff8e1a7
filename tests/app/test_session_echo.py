"""A conversation through the chat session alone, on the real engine process with the echo stand-in backend: no App,
no screen, no Textual. The session's views are recorders; the engine's events come back from the client's reader
thread through a queue, as the app's message queue would bring them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from test_session import RecordingView

from glyd_app.session import ChatSession
from glyd_app.store import Store
from glyd_engine.engine.protocol import EngineSettings, Error, Event, Progress, Ready

pytestmark = pytest.mark.anyio


class RecordingEngineView:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def engine_progress(self, progress: Progress) -> None:
        self.calls.append(("progress", progress.phase))

    def engine_ready(self, ready: Ready) -> None:
        self.calls.append(("ready", ready.name))

    def engine_failed(self, error: Error) -> None:
        self.calls.append(("failed", error.message))

    def engine_error(self, error: Error) -> None:
        self.calls.append(("error", error.message))

    def engine_stopped(self) -> None:
        self.calls.append(("stopped", None))


async def test_a_conversation_through_the_session_on_the_echo_engine(
        glyd_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLYD_ENGINE_BACKEND", "echo")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    store = Store(tmp_path / "chats.sqlite3")
    session = ChatSession(str(model), EngineSettings(kv="off"), store=store, install_if_missing=False)
    session.view, session.engine_view = view, engine_view = RecordingView(), RecordingEngineView()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Event, int]] = asyncio.Queue()

    def post(event: Event, generation: int) -> None:  # from the client's reader thread
        loop.call_soon_threadsafe(queue.put_nowait, (event, generation))

    async def until(done: Callable[[], bool]) -> None:
        while not done():
            await session.on_event(*await asyncio.wait_for(queue.get(), 60))

    session.open(session.first_chat().id)
    session.add_user_message("Capital of France?")  # sent before the engine is up: answered once it is ready
    generation = session.begin_start(str(model))
    await asyncio.to_thread(session.spawn, str(model), generation, post)
    try:
        await until(lambda: session.engine_state == "ready" and session.busy)
        assert [k for k, _ in engine_view.calls][-1] == "ready" and ("busy", True) in view.calls
        await until(lambda: not session.busy)
        user, reply = session.messages()
        assert user.content == "Capital of France?" and session.chat is not None
        assert session.chat.title == "Capital of France?"
        assert reply.role == "assistant" and reply.status == "done"
        assert reply.content.strip() == "You said: Capital of France?"
        assert "".join(t for k, t in view.calls if k == "text") == reply.content
        assert view.calls[-1] == ("busy", False) and ("finished", "done") in view.calls

        session.add_user_message("And of Italy?")  # the second turn, on the same engine
        await session.request_reply()
        await until(lambda: not session.busy)
        assert [m.role for m in store.messages(session.chat.id)] == ["user", "assistant", "user", "assistant"]
        assert store.messages(session.chat.id)[-1].content.strip() == "You said: And of Italy?"
    finally:
        engine = session.stop_for_quit()
        if engine is not None:
            await asyncio.to_thread(engine.shutdown, 10.0)
