"""The chat session without any UI: a recording view and a scripted engine stand in for the screen."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripted import READY, Script, ScriptedEngine

from glyd_app.session import ChatSession
from glyd_app.store import Store
from glyd_engine.engine.protocol import Delta, Event, Finished, Stats

pytestmark = pytest.mark.anyio


class RecordingView:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def notice(self, text: str, severity: str = "information", timeout: float | None = None) -> None:
        self.calls.append(("notice", text))

    async def reply_started(self, message_id: int) -> None:
        self.calls.append(("started", message_id))

    async def reply_text(self, text: str) -> None:
        self.calls.append(("text", text))

    def reply_stats(self, stats: Stats) -> None:
        self.calls.append(("stats", stats.generated_tokens))

    async def reply_finished(self, status: str) -> None:
        self.calls.append(("finished", status))

    def busy_changed(self, busy: bool) -> None:
        self.calls.append(("busy", busy))

    async def messages_dropped(self, from_id: int) -> None:
        self.calls.append(("dropped", from_id))


def _session(tmp_path: Path, script: Script) -> tuple[ChatSession, RecordingView, list[Event]]:
    """A session whose engine is ready; the engine's events are kept for the test to hand over."""
    events: list[Event] = []
    session = ChatSession(store=Store(tmp_path / "chats.sqlite3"))
    session.view = view = RecordingView()
    session.open(session.first_chat().id)
    session.engine = ScriptedEngine(events.append, script)
    session.begin_start("demo")
    session.engine_loaded(READY)
    return session, view, events


async def test_a_reply_streams_into_the_store_and_the_view(tmp_path: Path) -> None:
    session, view, events = _session(tmp_path, Script(reply="Paris it is"))
    session.add_user_message("Capital of France?")
    await session.request_reply()
    assert session.busy and ("busy", True) in view.calls
    for event in events:
        assert isinstance(event, Delta | Stats | Finished)
        await session.on_reply_event(event)
    assert not session.busy and view.calls[-1] == ("busy", False)
    assert [c[1] for c in view.calls if c[0] == "text"] == ["Paris ", "it ", "is"]
    assert ("finished", "done") in view.calls and ("stats", 19) in view.calls
    user, reply = session.messages()
    assert session.chat is not None and session.chat.title == "Capital of France?"
    assert (user.content, reply.content, reply.status) == ("Capital of France?", "Paris it is", "done")
    assert reply.stats["generated_tokens"] == 19


async def test_quit_keeps_the_reply_in_flight_as_stopped(tmp_path: Path) -> None:
    session, _, events = _session(tmp_path, Script(reply="half a reply", hold=True))
    session.add_user_message("Tell me")
    await session.request_reply()
    for event in events:
        await session.on_reply_event(event)  # type: ignore[arg-type]
    engine = session.stop_for_quit()
    assert engine is not None and session.engine is None and session.engine_state == "stopping"
    reply = session.messages()[-1]
    assert (reply.content, reply.status) == ("half a reply", "stopped")


async def test_a_message_waits_while_the_engine_starts(tmp_path: Path) -> None:
    session, view, events = _session(tmp_path, Script())
    session.begin_start("demo")
    session.add_user_message("Hello")
    await session.request_reply()
    assert not session.busy and not events
    assert view.calls == [("notice", "The engine is still starting; your message is sent as soon as it is ready.")]


async def test_edit_last_takes_the_message_and_its_reply_back(tmp_path: Path) -> None:
    session, view, events = _session(tmp_path, Script(reply="Hi"))
    first = session.add_user_message("Hello")
    await session.request_reply()
    for event in events:
        await session.on_reply_event(event)  # type: ignore[arg-type]
    assert await session.take_back_last() == "Hello"
    assert session.messages() == [] and view.calls[-1] == ("dropped", first.id)
