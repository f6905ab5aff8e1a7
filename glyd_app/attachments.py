"""Text files attached to a message: reading them, counting their tokens, and checking they fit the context.

A file's text goes to the model with the message it is attached to, inside a fenced block named after it;
the chat shows only its name and size. Token counts use the model's own tokenizer (`tokenizer.json`, read
with the `tokenizers` library, which needs no torch) when the app can reach both; otherwise a bound that
never undercounts: one token per UTF-8 byte (byte-level BPE and byte-fallback tokenizers never make more
tokens than bytes), about 4x the real count for English, so files near the limit are refused that would fit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

MAX_BYTES = 1 << 20  # larger files are refused before they are read: no context holds them
TEMPLATE_TOKENS = 16  # the chat template's tokens around one message (role markers, the file's fence)


class AttachmentError(ValueError):
    """A file that cannot be attached; the message says why and what to do."""


@dataclass(frozen=True)
class Attachment:
    name: str
    content: str
    tokens: int
    size_bytes: int

    def label(self) -> str:
        return f"📎 {self.name} · {_size(self.size_bytes)} · {self.tokens:,} tokens"


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


class TokenCounter:
    """Counts tokens with the model's tokenizer, or bounds them by bytes; `method` says which."""

    def __init__(self, model_dir: str | None) -> None:
        self.tokenizer = _tokenizer(str(Path(model_dir) / "tokenizer.json")) if model_dir else None
        self.method = "the model's tokenizer" if self.tokenizer is not None else "a bound of one token a byte"

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return len(text.encode("utf-8"))


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):  # type: ignore[no-untyped-def]  # a tokenizers.Tokenizer, or None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # an app-only install: the byte bound
        return None
    try:
        return Tokenizer.from_file(path)
    except Exception:  # no tokenizer.json (a sentencepiece-only model), or one this library cannot read
        return None


def read_attachment(path: Path, counter: TokenCounter) -> Attachment:
    """The file as an attachment, or an AttachmentError naming what is wrong with it."""
    path = Path(path).expanduser()
    if not path.exists():
        raise AttachmentError(f"{path} does not exist")
    if path.is_dir():
        raise AttachmentError(f"{path} is a directory; attach a text file")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise AttachmentError(f"{path.name} is {_size(size)}; files over {_size(MAX_BYTES)} are not attached "
                              "(no model's context here holds them)")
    data = path.read_bytes()
    if b"\0" in data:
        raise AttachmentError(f"{path.name} is not a text file (it holds NUL bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AttachmentError(f"{path.name} is not UTF-8 text (byte {exc.start} is not); attach a text file") from exc
    return Attachment(path.name, text, counter.count(model_text("", [Attachment(path.name, text, 0, 0)])), size)


class Named(Protocol):
    """An attachment as the model reads it (one being sent, or one from the store)."""

    @property
    def name(self) -> str: ...
    @property
    def content(self) -> str: ...


def model_text(text: str, attachments: Sequence[Named]) -> str:
    """What the model reads for a message: each file in a fenced block named after it, then the message."""
    blocks = [f"File `{a.name}`:\n````\n{a.content.rstrip()}\n````" for a in attachments]
    return "\n\n".join([*blocks, text] if text else blocks)


def context_error(message_tokens: int, attachments: list[Attachment], reply_tokens: int, context: int,
                  method: str) -> str | None:
    """Why this message cannot be sent to a model of `context` tokens (None: it fits). Older turns are left
    out by the engine when a chat outgrows the context, so only this message and its reply must fit."""
    files = sum(a.tokens for a in attachments)
    need = message_tokens + files + reply_tokens + TEMPLATE_TOKENS
    if need <= context:
        return None
    what = " and ".join(a.name for a in attachments) or "the message"
    return (f"{what} does not fit the context: {files + message_tokens:,} tokens ({method}) plus {reply_tokens:,} "
            f"kept for the reply is over this model's {context:,}. Attach a smaller file or a part of it, or "
            "lower the chat's max tokens (F4)")
