"""User-facing errors: each message says what went wrong and what to do; the CLI and the app print it
without a traceback.

Each class carries its `kind`, the word the engine child sends with a failure (`protocol.Error.kind`)
and the app picks a dialog title by: the kind travels as data, never guessed from a message.
"""

from __future__ import annotations

from typing import ClassVar, Final, Literal, get_args

ErrorKind = Literal["oom", "unsupported", "refused", "offline", "cancelled", "crash", "signal"]
KINDS: Final[tuple[str, ...]] = get_args(ErrorKind)
OOM, UNSUPPORTED, REFUSED, OFFLINE, CANCELLED, CRASH, SIGNAL = KINDS


class GlydError(Exception):
    """Base for errors whose message is the whole story; by default a rule of Glyd's said no."""

    kind: ClassVar[str] = REFUSED


class CorruptFileError(GlydError):
    """A Glyd file (checkpoint, table) is truncated, damaged, or of an unknown format version."""


class UnsupportedModelError(GlydError):
    """A model or tensor the formats do not handle (not bf16, empty, unknown layout)."""

    kind: ClassVar[str] = UNSUPPORTED


class MismatchError(GlydError):
    """Decoded data differs from what it should be (checksum or bit comparison)."""


class OfflineError(GlydError):
    """Something must be downloaded and the hub cannot be reached."""

    kind: ClassVar[str] = OFFLINE


class RefusedError(GlydError, ValueError):
    """Glyd will not run what was asked (a setting, an engine, a model it cannot hold), and says what to do instead.

    A ValueError too, so vLLM, which expects one from a config check, treats it as a bad configuration. `reason`
    and `fix` travel to the app apart (`protocol.Error`), so it shows a refusal as one, not as a crash."""

    def __init__(self, reason: str, fix: str = "") -> None:
        super().__init__(f"{reason}; {fix}" if fix else reason)
        self.reason, self.fix = reason, fix

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickles whole (vLLM's processes, pytest-xdist)
        return type(self), (self.reason, self.fix)


class SettingError(RefusedError):
    """A Glyd setting's value is not one it takes: `reason` names where it came from, `fix` the values it takes."""
