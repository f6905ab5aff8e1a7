"""A stand-in for vLLM inside the real child process: same events, no model, starts in a second.

Used by the runner's fast tests and by the app's tests of crash and restart handling, so those
exercise the real process, pipes and protocol without paying for a vLLM start. Chosen with the
environment variable `GLYD_ENGINE_BACKEND=echo`. The model name scripts failures:
`fail:<kind>` fails the start with that kind (`fail:refused` as vLLM hands on a refusal of the plugin's config
check: inside pydantic's ValidationError); a user message containing "CRASH" kills the child
mid-reply; "SLOW" streams slowly (to test stopping).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from glyd_engine.engine.protocol import (
    Delta,
    EngineSettings,
    Event,
    Finished,
    Generate,
    Progress,
    Ready,
    Stats,
)
from glyd_engine.errors import GlydError, OfflineError, RefusedError, UnsupportedModelError

log = logging.getLogger("glyd.engine")


def as_vllm_config_check_raises(exc: Exception) -> Exception:
    """`exc` as vLLM hands on an error of the plugin's config check: its config is a pydantic dataclass whose
    __post_init__ runs the check, so the error arrives inside a ValidationError (as data, not as a cause)."""
    try:
        from pydantic.dataclasses import dataclass
    except ImportError:  # an engine Python without pydantic has no vLLM either: the chain stands in for it
        wrapper = RuntimeError("Engine core initialization failed")
        wrapper.__cause__ = exc
        return wrapper

    @dataclass
    class VllmConfig:
        def __post_init__(self) -> None:
            raise exc

    try:
        VllmConfig()
    except Exception as wrapped:  # noqa: BLE001 - pydantic's ValidationError, which is what we want
        return wrapped
    return exc


class EchoBackend:
    def __init__(self, model: str, model_dir: Path, settings: EngineSettings, emit: Callable[[Event], None]) -> None:
        self.model, self.model_dir, self.settings, self.emit = model, model_dir, settings, emit
        self.words: list[str] = []
        self.rid: str | None = None
        self.delay = 0.0
        self.sent = 0
        self.prompt_tokens = 0
        self.t0 = 0.0

    def load(self) -> Ready:
        if self.model.startswith("fail:"):
            kind = self.model.split(":", 1)[1]
            if kind == "offline":
                raise OfflineError("cannot download the model: the hub is not reachable")
            if kind == "unsupported":
                raise UnsupportedModelError("model architecture EchoForCausalLM is not supported")
            if kind == "oom":
                raise MemoryError("not enough memory for the KV cache")
            if kind == "refused":
                raise as_vllm_config_check_raises(RefusedError(
                    "Glyd KV cache (kv=lossless) cannot run this engine: the model has sliding-window attention "
                    "layers", "change that, or run with GLYD_KV=off to use vLLM's own cache"))
            raise GlydError(f"refused: {kind}")
        for i in range(3):
            self.emit(Progress("engine", "Loading the echo engine", i + 1, 3, (2 - i) * 0.05))
            time.sleep(0.05)
        return Ready(
            model=self.model,
            name=f"echo:{self.model or 'demo'}",
            path=str(self.model_dir),
            architecture="Echo",
            device="cpu",
            engine="echo (test stand-in)",
            max_model_len=2048,
            kv_capacity_tokens=8192,
            kv_bytes_per_token=1000.0,
            kv_bf16_bytes_per_token=1400.0,
            weights_bytes=100 << 20,
            weights_bf16_bytes=140 << 20,
            kv_mode="lossless",
            kv_reason="echo stand-in",
            load_seconds=0.15,
        )

    @property
    def busy(self) -> bool:
        return self.rid is not None

    def submit(self, req: Generate) -> None:
        text = next((m["content"] for m in reversed(req.messages) if m.get("role") == "user"), "")
        if "CRASH" in text:
            self.emit(Delta(req.id, "about to ", 2))
            traceback.print_exception(RuntimeError("the echo backend was asked to crash"))  # as an uncaught one
            sys.stderr.flush()
            log.warning("an unrelated warning, the last line of the log")
            os._exit(3)
        if "KILL" in text:  # as the OOM killer or `kill -9` would
            log.warning("an unrelated warning, the last line of the log")
            os.kill(os.getpid(), signal.SIGKILL)
        self.delay = 0.2 if "SLOW" in text else 0.01
        self.words = [f"{w} " for w in f"You said: {text}".split()][: req.params.max_tokens]
        if "SLOW" in text:
            self.words = self.words + ["more "] * 200
        self.rid, self.sent, self.prompt_tokens, self.t0 = req.id, 0, len(text.split()) + 5, time.monotonic()

    def step(self) -> None:
        if self.rid is None:
            return
        time.sleep(self.delay)
        if self.sent < len(self.words):
            self.emit(Delta(self.rid, self.words[self.sent], 1))
            self.sent += 1
            return
        self._finish("stop")

    def abort(self) -> None:
        if self.rid is not None:
            self._finish("stopped")

    def _finish(self, reason: str) -> None:
        rid, self.rid = self.rid, None
        elapsed = max(1e-3, time.monotonic() - self.t0)
        self.emit(
            Stats(
                rid or "",
                self.prompt_tokens,
                self.sent,
                1000.0,
                self.sent / elapsed,
                0.01,
                self.prompt_tokens + self.sent,
                8192,
                0,
                True,
            )
        )
        self.emit(Finished(rid or "", reason))

    def close(self) -> None:
        return None
