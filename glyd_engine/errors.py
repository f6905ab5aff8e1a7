"""User-facing errors: each message says what went wrong and what to do; the CLI and the app print it
without a traceback."""

from __future__ import annotations


class GlydError(Exception):
    """Base for errors whose message is the whole story."""


class CorruptFileError(GlydError):
    """A Glyd file (checkpoint, table) is truncated, damaged, or of an unknown format version."""


class UnsupportedModelError(GlydError):
    """A model or tensor the formats do not handle (not bf16, empty, unknown layout)."""


class MismatchError(GlydError):
    """Decoded data differs from what it should be (checksum or bit comparison)."""


class OfflineError(GlydError):
    """Something must be downloaded and the hub cannot be reached."""
