"""One file from the hub, resumable byte by byte and checked against the hub's own hash.

huggingface_hub restarts an interrupted file from zero (each try writes a fresh temporary file); a model's
weights are gigabytes, so Glyd keeps a `NAME.part` file and asks for the rest with an HTTP Range request. A
server that ignores the range (200 instead of 206) gets the whole file again. The finished file is hashed
(sha256 for LFS files, git's blob sha1 for the others, both from the hub's file listing) before it is renamed
into place, so a resumed file is known whole.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glyd_engine.errors import GlydError
from glyd_engine.progress import Cancelled, CancelToken

CHUNK = 1 << 20
READ_TIMEOUT_S = 30.0


class DownloadBrokeOff(GlydError):
    """The connection ended before the file did; what arrived is kept and the next pull resumes there."""


@dataclass(frozen=True)
class HubFile:
    """A file as the hub lists it: its name in the repository, size and hash."""

    name: str
    size: int
    sha256: str | None = None  # LFS files
    git_sha1: str | None = None  # the others: git's blob id

    def matches(self, path: Path) -> bool:
        """The file at `path` is this one (its size, then its hash where the hub gave one)."""
        if path.stat().st_size != self.size:
            return False
        if self.sha256:
            digest = hashlib.sha256()
        elif self.git_sha1:
            digest = hashlib.sha1(usedforsecurity=False)
            digest.update(f"blob {self.size}\0".encode())
        else:
            return True
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                digest.update(block)
        return digest.hexdigest() == (self.sha256 or self.git_sha1)


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def fetch_file(session: Any, url: str, headers: dict[str, str], file: HubFile, dest: Path,
               on_bytes: Callable[[int], None], cancel: CancelToken | None = None) -> None:
    """Download `file` from `url` to `dest`, resuming `dest`.part; `on_bytes(n)` for each n bytes received.

    `session` is huggingface_hub's HTTP client (`get_session()`), so proxies and tokens work as for the hub.
    """
    from huggingface_hub.utils import hf_raise_for_status

    part = part_path(dest)
    have = part.stat().st_size if part.exists() else 0
    if have > file.size:  # not a prefix of this file (it changed on the hub): start over
        part.unlink()
        have = 0
    if have < file.size:
        ask = dict(headers, **({"Range": f"bytes={have}-"} if have else {}))
        ask["Accept-Encoding"] = "identity"  # byte offsets are of the file, not of a compressed stream
        try:
            with session.stream("GET", url, headers=ask, follow_redirects=True, timeout=READ_TIMEOUT_S) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    hf_raise_for_status(resp)
                if have and resp.status_code != 206:
                    have = 0  # the server sent the whole file
                elif have and _range_start(resp.headers.get("Content-Range", "")) != have:
                    raise GlydError(f"the hub answered a resume of {file.name} at byte {have} with "
                                    f"{resp.headers.get('Content-Range')!r}; delete {part} and pull again")
                with open(part, "ab" if have else "wb") as out:
                    for chunk in resp.iter_bytes():  # as they arrive: a break loses nothing received
                        if cancel is not None:
                            cancel.check()
                        out.write(chunk)
                        on_bytes(len(chunk))
        except (GlydError, OSError, Cancelled):
            raise
        except Exception as exc:  # the connection: reset, timeout, a body cut short
            got = part.stat().st_size if part.exists() else 0
            raise DownloadBrokeOff(f"the download of {file.name} broke off at {got:,} of {file.size:,} bytes "
                                   f"({type(exc).__name__}); pull again to resume from there") from exc
    got = part.stat().st_size
    if got != file.size:
        raise DownloadBrokeOff(f"the download of {file.name} ended at {got:,} of {file.size:,} bytes; "
                               "pull again to resume from there")
    if not file.matches(part):
        part.unlink()
        raise GlydError(f"{file.name} arrived damaged (its hash differs from the hub's); it was deleted, "
                        "pull again to fetch it afresh")
    os.replace(part, dest)


def _range_start(content_range: str) -> int | None:
    m = re.match(r"bytes (\d+)-", content_range.strip())
    return int(m.group(1)) if m else None
