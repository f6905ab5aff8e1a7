"""Atomic file writes: a file appears complete under its final name, or not at all.

Writes go to a temporary file in the same directory, are fsynced, then renamed. A crash leaves only a
`.NAME.tmp-*` file, which readers never open and a later write removes once stale; a full disk removes the
temporary and raises DiskFullError, a GlydError the CLI and the app print as one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from glyd_engine.errors import GlydError


class DiskFullError(GlydError, OSError):
    """A write ran out of space (or past the file size limit); the destination was left as it was."""

    def __str__(self) -> str:
        return str(self.strerror)


_FULL = {errno.ENOSPC: "no space left on the device",
         errno.EFBIG: "a file grew larger than this file system or the process's file size limit allows"}
if hasattr(errno, "EDQUOT"):
    _FULL[errno.EDQUOT] = "the disk quota is used up"
# Writers in Rust (safetensors' save_file) raise their own exception type, with the OS error in the text only.
_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")


def disk_full(path: Path, exc: BaseException) -> DiskFullError | None:
    """DiskFullError for a write to `path` that failed for want of space (an OSError, or a writer's error that
    names the errno in its text); None for any other failure, which is re-raised as it is."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None and isinstance(exc, Exception) and not isinstance(exc, GlydError):
        m = _OS_ERROR_TEXT.search(str(exc))
        code = int(m.group(1)) if m else None
    if code not in _FULL:
        return None
    return DiskFullError(code, f"{_FULL[code]} while writing {path}; {path} was left as it was. "
                               "Free some space and try again.")


STALE_AFTER_S = 24 * 3600  # a temporary file this old belongs to a writer that died (killed, power cut)


def remove_stale(path: Path) -> None:
    """Delete leftovers of earlier writes to `path` whose writer never finished."""
    import time

    for old in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_AFTER_S:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        except OSError:
            pass  # another process got there first, or it is not ours to remove


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, briefly, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def normalize_permissions(root: Path) -> None:
    """mkdtemp and some writers (safetensors) make owner-only files; a finished directory should read like
    any other the user writes (the usual umask permissions)."""
    umask = _umask()
    root.chmod(0o777 & ~umask)
    for item in root.rglob("*"):
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def _space_checked(path: Path) -> Iterator[None]:
    """Raise DiskFullError, not the writer's own error, when a write to `path` runs out of space."""
    try:
        yield
    except BaseException as exc:
        full = disk_full(path, exc)
        if full is None:
            raise
        raise full from exc


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it is renamed over `path`."""
    path = Path(path)
    with _space_checked(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        try:
            os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; the file should get the usual permissions
            yield tmp_path
            with open(tmp_path, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp_path, path)
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory next to `path`; on success it replaces `path` whole."""
    path = Path(path)
    with _space_checked(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            yield tmp
            normalize_permissions(tmp)
            if path.exists():
                old = path.with_name(f".{path.name}.old-{os.getpid()}")
                os.replace(path, old)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    os.replace(old, path)  # the destination is left as it was
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
