"""Why the engine child is gone, from what is known: its exit status (a signal or a code), the kernel's
count of out-of-memory kills in this process's memory cgroup (read at spawn and at exit), and the last
exception line in the engine's log. Only that evidence decides the error kind: a SIGKILL is "ran out of
memory" only where the OOM killer counted a kill meanwhile, otherwise "stopped by a signal"; an exit code
is a crash, quoted with the log's last exception line (the log's last line is usually an unrelated warning).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from glyd_engine.engine.protocol import Error
from glyd_engine.errors import CRASH, OOM, SIGNAL

SIGNAL_HINTS = {
    signal.SIGKILL: "killed: the system may have run out of memory, or another program ended it",
    signal.SIGSEGV: "a crash inside the engine's native code",
    signal.SIGABRT: "a crash inside the engine's native code",
    signal.SIGTERM: "asked to stop by another program",
}
# a traceback's last line ("RuntimeError: ...", "torch.OutOfMemoryError: ...") or Python's fatal error line
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)|Fatal Python error)\b:?.*")
_TAIL = 64 << 10
RESTART = "Ctrl+R starts it again."


def oom_kills() -> int | None:
    """The OOM killer's kills in this process's memory cgroup (v2 `memory.events`, v1 `memory.oom_control`);
    None where the system does not say."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2
            candidates += [Path("/sys/fs/cgroup", rel, "memory.events"), Path("/sys/fs/cgroup/memory.events")]
        elif "memory" in controllers.split(","):
            candidates += [Path("/sys/fs/cgroup/memory", rel, "memory.oom_control"),
                           Path("/sys/fs/cgroup/memory/memory.oom_control")]
    for file in candidates:
        try:
            for row in file.read_text().splitlines():
                key, _, value = row.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def last_exception(log: Path | None) -> str | None:
    """The last exception line in the log's tail (None: none there, or no log)."""
    if log is None:
        return None
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - _TAIL))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    found = [m.group(0).strip() for m in map(_EXCEPTION.match, tail.splitlines()) if m]
    return found[-1][:400] if found else None


def exit_error(code: int, oom_before: int | None, oom_after: int | None, log: Path | None,
               reply_id: str | None = None) -> Error:
    """The fatal error to report for a child that exited with `code` (negative: the signal) unasked."""
    where = str(log) if log is not None else None
    if code < 0:
        try:
            sig = signal.Signals(-code)
            name, hint = sig.name, SIGNAL_HINTS.get(sig)
        except ValueError:
            name, hint = f"signal {-code}", None
        if oom_before is not None and oom_after is not None and oom_after > oom_before:
            return Error(f"The engine ran out of memory: the system's out-of-memory killer stopped it ({name}). "
                         f"Pick a smaller model or a smaller KV budget; {RESTART}", OOM, fatal=True, id=reply_id,
                         log_path=where)
        return Error(f"The engine process was stopped by {name}" + (f" ({hint})" if hint else "") + f". {RESTART}",
                     SIGNAL, fatal=True, id=reply_id, log_path=where)
    said = last_exception(log)
    if said and ("MemoryError" in said or "out of memory" in said.lower()):
        return Error(f"The engine ran out of memory (exit code {code}): {said}", OOM, fatal=True, id=reply_id,
                     log_path=where)
    return Error(f"The engine crashed (exit code {code})" + (f": {said}" if said else "; its log says why")
                 + f". {RESTART}", CRASH, fatal=True, id=reply_id, log_path=where)
