"""The bridge from the engine client's reader thread to Textual: every event becomes one message.

Progress and non-final stats events replace their own earlier, still-queued copies (`can_replace`),
so a fast stream of updates costs one redraw per frame rather than one per event. The engine itself
(torch, vLLM) never loads in this process: `EngineClient` spawns the child and speaks JSON to it.
The session (session.py) knows none of this: it hands each event with its start's generation to the
`poster` the app gives it.
"""

from __future__ import annotations

from collections.abc import Callable

from textual.message import Message
from textual.message_pump import MessagePump

from glyd_engine.engine.protocol import Event, Progress, Stats


class EngineEvent(Message):
    """An event from the engine, posted from the client's reader thread (post_message is thread-safe)."""

    def __init__(self, event: Event, generation: int) -> None:
        super().__init__()
        self.event = event
        self.generation = generation  # which engine start this came from; stale ones are dropped

    def can_replace(self, message: Message) -> bool:
        if not isinstance(message, EngineEvent) or message.generation != self.generation:
            return False
        mine, theirs = self.event, message.event
        if isinstance(mine, Progress) and isinstance(theirs, Progress):
            return mine.job == theirs.job
        if isinstance(mine, Stats) and isinstance(theirs, Stats):
            return not mine.final and mine.id == theirs.id
        return False


def poster(target: MessagePump) -> Callable[[Event, int], None]:
    """Where the session sends an engine start's events (from any thread): `target`'s queue, as EngineEvents."""

    def post(event: Event, generation: int) -> None:
        target.post_message(EngineEvent(event, generation))

    return post
