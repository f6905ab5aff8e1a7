"""Command palette entries (Ctrl+P): every app action, found by fuzzy search, listed when empty."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

Command = tuple[str, str, Callable[[], object]]


class HasPaletteCommands(Protocol):
    """The app as the palette sees it: a list of (title, help, callback); no import of the app itself."""

    def palette_commands(self) -> list[Command]: ...


class GlydCommands(Provider):
    def _commands(self) -> list[Command]:
        return cast(HasPaletteCommands, self.app).palette_commands()

    async def discover(self) -> Hits:
        for title, help_text, callback in self._commands():
            yield DiscoveryHit(title, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, callback in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, help=help_text)
