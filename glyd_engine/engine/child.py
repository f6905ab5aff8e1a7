"""The engine child process: `python -m glyd_engine.engine.child`.

Reads requests (JSON lines) on stdin, writes events on a private copy of the original stdout, and sends
everything else (vLLM's logs, warnings, a C-level crash) to stderr, which the client points at a log
file: the terminal the app draws on never sees a traceback. The process exits after a shutdown, a
cancel, a failed start or a fatal error, so its memory is always given back by the OS.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any

from glyd_engine.engine.backend_choice import stand_in_engine
from glyd_engine.engine.protocol import (
    CancelStart,
    EngineSettings,
    Error,
    Event,
    Finished,
    Generate,
    Progress,
    Request,
    Shutdown,
    Start,
    StopGeneration,
    Stopped,
    decode_request,
    encode,
)
from glyd_engine.errors import (
    CANCELLED,
    CRASH,
    OOM,
    REFUSED,
    UNSUPPORTED,
    GlydError,
    RefusedError,
    UnsupportedModelError,
)
from glyd_engine.progress import Cancelled, CancelToken, ProgressEvent

log = logging.getLogger("glyd.engine")


class Emitter:
    """Thread-safe event writer; a closed pipe means the front end is gone, so the child leaves."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        line = encode(event)
        with self.lock:
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                os._exit(0)


# vLLM and torch raise plain exceptions (ValueError, RuntimeError): for those alone the message is the only
# sign of what went wrong. Glyd's own errors carry their kind (glyd_engine.errors) and are never read.
FOREIGN_OOM = ("out of memory", "outofmemory", "insufficient memory", "no available memory", "not enough memory")
FOREIGN_UNSUPPORTED = ("not supported", "unsupported", "architectures", "does not appear to have", "no such file",
                       "not a valid model")


def wrapped(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception stands for: itself, what it was raised from, and (vLLM's config is a pydantic
    dataclass, whose ValidationError keeps a check's own exception as data, not as a cause) its errors' causes."""
    out: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo and len(out) < 20:
        cur = todo.pop(0)
        if cur in out:
            continue
        out.append(cur)
        todo += _validation_causes(cur) + [c for c in (cur.__cause__, cur.__context__) if c is not None]
    return out


def _validation_causes(exc: BaseException) -> list[BaseException]:
    """The exceptions a pydantic ValidationError holds in its errors' ctx (duck-typed: no pydantic import)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors) or type(exc).__name__ != "ValidationError":
        return []
    try:
        found = [(e.get("ctx") or {}).get("error") for e in errors()]
    except Exception:  # noqa: BLE001 - a foreign object that only looks like pydantic's
        return []
    return [e for e in found if isinstance(e, BaseException)]


def refusal(exc: BaseException) -> RefusedError | None:
    """The Glyd refusal behind a failure (however vLLM wrapped it), or None."""
    return next((e for e in wrapped(exc) if isinstance(e, RefusedError)), None)


def failure(exc: BaseException, fatal: bool, **more: Any) -> Error:
    """The event for a failure: a refusal keeps its kind, reason and fix across the process boundary."""
    r = refusal(exc)
    if r is not None and not isinstance(exc, Cancelled):
        return Error(r.reason, r.kind, fatal=fatal, fix=r.fix, **more)  # type: ignore[arg-type]
    return Error(user_message(exc), classify(exc), fatal=fatal, **more)  # type: ignore[arg-type]


def classify(exc: BaseException) -> str:
    """The error kind the app shows: oom, unsupported, refused, offline, cancelled or crash."""
    if isinstance(exc, Cancelled):
        return CANCELLED
    if isinstance(exc, GlydError):
        return exc.kind
    found = refusal(exc)
    if found is not None:
        return found.kind
    if isinstance(exc, MemoryError):
        return OOM
    text = f"{type(exc).__name__}: {exc}".lower()
    if any(s in text for s in FOREIGN_OOM):
        return OOM
    if "refus" in text:
        return REFUSED
    if any(s in text for s in FOREIGN_UNSUPPORTED):
        return UNSUPPORTED
    return CRASH


def user_message(exc: BaseException) -> str:
    """The first line a user sees: the most specific message in the exception chain."""
    if isinstance(exc, Cancelled):
        return "start cancelled"
    seen: list[str] = []
    cur: BaseException | None = exc
    while cur is not None and len(seen) < 5:
        text = str(cur).strip()
        if text and "Engine core initialization failed" not in text:
            seen.append(text if isinstance(cur, GlydError) else f"{type(cur).__name__}: {text}")
        cur = cur.__cause__ or cur.__context__
    return seen[-1].splitlines()[0][:500] if seen else type(exc).__name__


def resolve(model: str, settings: EngineSettings, emit: Any, cancel: CancelToken) -> Path:
    """The model directory, built (demo) or downloaded (hub id) on first use, with progress."""

    def progress(ev: ProgressEvent) -> None:
        emit(Progress.of(ev))

    if stand_in_engine() and model.startswith("fail:"):
        return Path(".")  # the echo stand-in fails its own start, as scripted by the name
    try:
        from glyd_engine.models import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        return Path(resolve_model(model or "demo", progress=progress, cancel=cancel))
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    raise UnsupportedModelError(f"{model!r} is not a model directory (glyd_engine.models is not available)")


def ensure_kv_tables(model_dir: Path, settings: EngineSettings, emit: Any, cancel: CancelToken) -> None:
    """The first-start KV table build (minutes on a CPU), skipped when KV compression is off.

    In `auto` mode a model the tables cannot handle falls back to vLLM's own cache with a log line;
    in `lossless`/`exact` mode that is a refusal.
    """
    if settings.kv == "off" or stand_in_engine():
        return
    # The tables serve only the plugin's pages: where the mode keeps vLLM's own cache (auto on a platform
    # where Glyd's pages are not measured as fast), building them would cost minutes for nothing.
    from glyd_engine.vllm_plugin.settings import holds_pages

    if not holds_pages(settings.kv):
        log.info("KV tables skipped: KV mode %r keeps vLLM's own cache on this platform", settings.kv)
        return
    from glyd_engine.tables import ensure_tables

    def progress(ev: ProgressEvent) -> None:
        emit(Progress.of(ev))

    try:
        ensure_tables(model_dir, window=settings.max_model_len, progress=progress, cancel=cancel)
    except Cancelled:
        raise
    except (GlydError, ValueError, NotImplementedError) as exc:
        if settings.kv != "auto":
            raise RefusedError(f"KV mode {settings.kv} needs KV tables, and building them failed: {exc}",
                               "pick KV mode auto or off (F5), or another model") from exc
        log.warning("KV tables failed; falling back to vLLM's own cache: %s", exc)


def make_backend(model: str, model_dir: Path, settings: EngineSettings, emit: Any) -> Any:
    if stand_in_engine():
        from glyd_engine.engine.echo_backend import EchoBackend

        return EchoBackend(model, model_dir, settings, emit)
    from glyd_engine.engine.vllm_backend import VllmBackend

    return VllmBackend(model, model_dir, settings, emit)


class Child:
    def __init__(self, emit: Emitter, stdin: IO[str]) -> None:
        self.emit = emit
        self.stdin = stdin
        self.inbox: queue.Queue[Request | None] = queue.Queue()
        self.cancel = CancelToken()
        self.backend: Any = None
        self.loading = False  # inside vLLM's load, which has no cancel points

    def _read(self) -> None:
        for line in self.stdin:
            if not line.strip():
                continue
            try:
                req = decode_request(line)
            except (ValueError, KeyError, TypeError) as exc:
                self.emit(Error(f"bad request: {exc}", CRASH, fatal=False))
                continue
            if isinstance(req, CancelStart | Shutdown) and self.backend is None:
                self.cancel.cancel()
                if self.loading:  # nothing to wait for: leave now, the OS frees the half-loaded engine
                    if isinstance(req, CancelStart):
                        self.emit(Error("start cancelled", CANCELLED, fatal=True))
                    self._exit(0)
            self.inbox.put(req)
        # stdin closed: the front end is gone; don't outlive it.
        self._exit(0)

    def _exit(self, code: int) -> None:
        self.emit(Stopped(exit_code=code))
        sys.stderr.flush()
        os._exit(code)

    def run(self) -> None:
        threading.Thread(target=self._read, name="glyd-engine-stdin", daemon=True).start()
        while True:
            if self.backend is not None and self.backend.busy:
                try:
                    req = self.inbox.get_nowait()
                except queue.Empty:
                    try:
                        self.backend.step()
                    except Exception as exc:  # noqa: BLE001 - reported, then the child leaves
                        log.error("engine step failed\n%s", traceback.format_exc())
                        self.emit(failure(exc, fatal=True))
                        self._exit(1)
                    continue
            else:
                req = self.inbox.get()
            if req is None or not self.handle(req):
                self._exit(0)

    def handle(self, req: Request) -> bool:
        """Act on one request; False ends the child."""
        if isinstance(req, Start):
            if self.backend is not None:
                self.emit(Error("the engine is already started", REFUSED, fatal=False))
                return True
            try:
                self.start(req)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes an event
                log.error("start failed\n%s", traceback.format_exc())
                self.emit(failure(exc, fatal=True, log_path=_log_path()))
                return False
            return True
        if isinstance(req, Generate):
            if self.backend is None:
                self.emit(Error("the engine is not started", REFUSED, fatal=False, id=req.id))
                self.emit(Finished(req.id, "error"))
                return True
            try:
                self.backend.submit(req)
            except Exception as exc:  # noqa: BLE001
                log.error("generate failed\n%s", traceback.format_exc())
                self.emit(failure(exc, fatal=False, id=req.id))
                self.emit(Finished(req.id, "error"))
            return True
        if isinstance(req, StopGeneration):
            if self.backend is not None and self.backend.busy:
                self.backend.abort()
            return True
        if isinstance(req, CancelStart):
            return self.backend is not None  # after the start, a late cancel is ignored
        return not isinstance(req, Shutdown)

    def start(self, req: Start) -> None:
        settings = req.settings
        log.info("starting %r with %s", req.model, settings)
        model_dir = resolve(req.model, settings, self.emit, self.cancel)
        ensure_kv_tables(model_dir, settings, self.emit, self.cancel)
        self.cancel.check()
        backend = make_backend(req.model, model_dir, settings, self.emit)
        self.loading = True
        try:
            ready = backend.load()
        finally:
            self.loading = False
        self.backend = backend
        log.info("ready: %s", ready)
        self.emit(ready)


def _log_path() -> str | None:
    return os.environ.get("GLYD_ENGINE_LOG")


def _protocol_stream() -> IO[str]:
    """Keep the real stdout for events; from here on fd 1 and fd 2 both go to the log."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1, encoding="utf-8")


def use_every_core() -> None:
    """On vLLM's CPU build the model should run on every core this process may use. vLLM drops torch to one
    thread "for serving" unless OMP_NUM_THREADS is set; here the engine is in-process, so that would be the
    model's threads. Set before torch loads; a user's own OMP_NUM_THREADS stands."""
    from glyd_engine.machine import cpu_build, usable_cores

    if cpu_build():
        os.environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))


def main() -> None:
    use_every_core()
    out = _protocol_stream()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    Child(Emitter(out), sys.stdin).run()


if __name__ == "__main__":
    main()
