"""Atomic file writes: a file appears complete under its final name, or not at all.

Writes go to a temporary file in the same directory, are fsynced, then renamed. A full disk or a crash
leaves only a `.NAME.tmp-*` file, which readers never open and a later write removes once stale.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


class DiskFullError(OSError):
    """Raised with a clear message when a write runs out of space; nothing is left half-written."""


def _explain(path: Path, exc: OSError) -> OSError:
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(exc.errno, f"no space left on the device while writing {path}; "
                                        "nothing was written. Free some space and try again.")
    return exc


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
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it is renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; the file should get the usual permissions
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise _explain(path, exc) from exc
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
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        normalize_permissions(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _explain(path, exc) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
