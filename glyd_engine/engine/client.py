"""The front end's side of the engine runner: spawn the child, send requests, deliver events.

`EngineClient` is what the app, `glyd serve` and the bench talk to. Events arrive on a reader thread
and go to the `on_event` callback (the app turns them into Textual messages). Whatever happens to the
child (a failed start, a crash mid-reply, a kill), the callback gets an `Error` and then exactly one
`Stopped` once the process has exited; a stopped client can be started again.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from glyd_engine import paths
from glyd_engine.engine.exit_reason import exit_error, oom_kills
from glyd_engine.engine.protocol import (
    CancelStart,
    EngineSettings,
    Error,
    Event,
    Finished,
    Generate,
    GenerationParams,
    Ready,
    Request,
    Shutdown,
    Start,
    StopGeneration,
    Stopped,
    decode_event,
    encode,
)

EventCallback = Callable[[Event], None]
log = logging.getLogger("glyd.engine")


class EngineLike(Protocol):
    """What a front end needs from an engine; the app's tests script a stand-in with the same shape."""

    def start(self, model: str, settings: EngineSettings) -> None: ...
    def generate(self, messages: list[dict[str, str]], params: GenerationParams) -> str: ...
    def stop_generation(self) -> None: ...
    def cancel_start(self) -> None: ...
    def shutdown(self, timeout: float = 15.0) -> None: ...
    @property
    def running(self) -> bool: ...


def log_path() -> Path:
    return paths.cache_dir() / "logs" / "engine.log"


def _open_log() -> IO[bytes]:
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size:
        os.replace(path, path.with_name("engine.previous.log"))
    return open(path, "ab")


class EngineClient:
    def __init__(self, on_event: EventCallback, python: str | None = None, env: dict[str, str] | None = None) -> None:
        self.on_event = on_event
        self.python = python
        self.env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._reply: str | None = None
        self._stopping = False
        self._oom_kills: int | None = None
        self.ready: Ready | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, model: str, settings: EngineSettings | None = None) -> None:
        """Spawn the child and ask it to load `model`; returns at once, progress follows as events."""
        from glyd_engine.engine.install import engine_python

        if self.running:
            raise RuntimeError("the engine is running; shut it down first")
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["GLYD_ENGINE_LOG"] = str(log_path())
        with _open_log() as log:
            self._proc = subprocess.Popen(
                [self.python or engine_python(), "-m", "glyd_engine.engine.child"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,  # Ctrl+C in the terminal goes to the app, which shuts us down
            )
        self._stopping = False
        self._reply = None
        self.ready = None
        self._oom_kills = oom_kills()  # compared at an unasked exit: did the OOM killer act meanwhile?
        self._reader = threading.Thread(target=self._read, args=(self._proc,), name="glyd-engine-events", daemon=True)
        self._reader.start()
        self._send(Start(model=model, settings=settings or EngineSettings()))

    def generate(self, messages: list[dict[str, str]], params: GenerationParams | None = None) -> str:
        rid = uuid.uuid4().hex[:12]
        self._reply = rid
        self._send(Generate(id=rid, messages=messages, params=params or GenerationParams()))
        return rid

    def stop_generation(self) -> None:
        if self._reply is not None:
            self._send(StopGeneration(id=self._reply))

    def cancel_start(self) -> None:
        self._stopping = True
        self._send(CancelStart())
        self._reap(5.0)

    def shutdown(self, timeout: float = 15.0) -> None:
        """Ask the child to leave, then make sure it has: terminate, then kill. Blocks until it exited."""
        proc = self._proc
        if proc is None:
            return
        self._stopping = True
        self._send(Shutdown())
        self._reap(timeout)

    def _reap(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)

    def _send(self, req: Request) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        with self._lock:
            try:
                proc.stdin.write((encode(req) + "\n").encode())
                proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # the reader reports the exit

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        failed = False
        for raw in proc.stdout:
            try:
                event = decode_event(raw.decode("utf-8", "replace"))
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(event, Stopped):
                continue  # sent once below, after the process has really exited
            if isinstance(event, Ready):
                self.ready = event
            elif isinstance(event, Finished) and event.id == self._reply:
                self._reply = None
            elif isinstance(event, Error) and event.fatal:
                failed = True
            self._deliver(event)
        code = proc.wait()
        if not failed and not self._stopping:
            self._deliver(exit_error(code, self._oom_kills, oom_kills(), log_path(), self._reply))
        if self._reply is not None:
            self._deliver(Finished(self._reply, "error"))
            self._reply = None
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self.ready = None
        self._deliver(Stopped(exit_code=code))

    def _deliver(self, event: Event) -> None:
        try:
            self.on_event(event)
        except Exception as exc:  # noqa: BLE001 - a front-end bug must not kill the reader
            log.warning("engine event handler failed: %r", exc)
