"""The UI is on screen in well under a second: process start to the chat's first frame, in a pty.

Also the measurement behind the number in docs/app.md: `python tests/app/test_startup_time.py`
prints five runs and the median. Marked slow: it spawns real processes and is timing-sensitive.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest

MARKER = b"Type a message"
LIMIT_S = 1.0


def first_frame_seconds(cmd: list[str], timeout: float = 20.0) -> float | None:
    """Seconds from fork to the first output that contains the chat's hint text."""
    env = dict(
        os.environ, GLYD_HOME=tempfile.mkdtemp(prefix="glyd-start-"), TERM="xterm-256color", GLYD_ENGINE_BACKEND="echo"
    )
    start = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # child
        os.execvpe(cmd[0], cmd, env)
    seen = b""
    found = None
    try:
        while time.perf_counter() - start < timeout:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                continue
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
            if MARKER in seen:
                found = time.perf_counter() - start
                break
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    return found


def _command() -> list[str]:
    return [sys.executable, "-m", "glyd_app"]


@pytest.mark.slow
def test_first_frame_in_under_a_second() -> None:
    runs = [first_frame_seconds(_command()) for _ in range(3)]
    assert all(r is not None for r in runs), runs
    assert statistics.median(runs) < LIMIT_S, runs  # type: ignore[type-var]


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parents[2])
    times = [first_frame_seconds(sys.argv[1:] or _command()) for _ in range(5)]
    print(
        "first frame (s):",
        [None if t is None else round(t, 3) for t in times],
        "median",
        round(statistics.median([t for t in times if t is not None]), 3),
    )
