"""A stand-in engine client for UI tests and snapshots: same interface as EngineClient, scripted events.

Events are delivered synchronously from the calling thread (the app turns them into messages), so a
snapshot sees exactly the script, with no timing in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from glyd_engine.engine.protocol import (
    Delta,
    EngineSettings,
    Error,
    Event,
    Finished,
    GenerationParams,
    Progress,
    Ready,
    Stats,
    Stopped,
)

READY = Ready(
    model="demo",
    name="SmolLM2-135M-Instruct (demo)",
    path="/models/SmolLM2-135M-Instruct",
    architecture="LlamaForCausalLM",
    device="cpu",
    engine="vLLM 0.32.0 (CPU build, eager)",
    max_model_len=4096,
    kv_capacity_tokens=16_320,
    kv_bytes_per_token=16_450.0,
    kv_bf16_bytes_per_token=23_040.0,
    weights_bytes=188_000_000,
    weights_bf16_bytes=269_030_016,
    kv_mode="lossless",
    kv_reason="every value exact, 1.40x the tokens of bf16",
    load_seconds=9.6,
    dtype="bfloat16",
    weights_dtype="glyd",
    rss_bytes=900 << 20,
)

REPLY = 'The capital of France is **Paris**.\n\n```python\nprint("Bonjour, Paris")\n```\n'


@dataclass
class Script:
    start: list[Event] = field(default_factory=lambda: [Progress("engine", "Loading the weights", 6, 10, 4.0), READY])
    reply: str = REPLY
    hold: bool = False  # deltas only; Finished comes with stop_generation (to test Esc)
    stats: Stats = field(
        default_factory=lambda: Stats(
            "",
            prompt_tokens=37,
            generated_tokens=19,
            prompt_tps=672.4,
            gen_tps=41.3,
            ttft_s=0.06,
            kv_tokens_in_use=56,
            kv_capacity_tokens=16_320,
            final=True,
        )
    )


class ScriptedEngine:
    def __init__(self, on_event: Callable[[Event], None], script: Script | None = None) -> None:
        self.on_event = on_event
        self.script = script or Script()
        self.started: list[tuple[str, EngineSettings]] = []
        self.requests: list[tuple[list[dict[str, str]], GenerationParams]] = []
        self._running = False
        self._rid: str | None = None
        self._text = ""

    @property
    def running(self) -> bool:
        return self._running

    def start(self, model: str, settings: EngineSettings | None = None) -> None:
        self._running = True
        self.started.append((model, settings or EngineSettings()))
        for ev in self.script.start:
            self.on_event(ev)

    def generate(self, messages: list[dict[str, str]], params: GenerationParams | None = None) -> str:
        rid = f"r{len(self.requests) + 1}"
        self.requests.append((messages, params or GenerationParams()))
        self._rid = rid
        pieces = self.script.reply.split(" ")
        for i, piece in enumerate(pieces):
            self.on_event(Delta(rid, piece + (" " if i < len(pieces) - 1 else ""), 1))
        if not self.script.hold:
            self._finish("stop")
        return rid

    def _finish(self, reason: str) -> None:
        rid, self._rid = self._rid, None
        if rid is None:
            return
        stats = self.script.stats
        self.on_event(
            Stats(
                rid,
                stats.prompt_tokens,
                stats.generated_tokens,
                stats.prompt_tps,
                stats.gen_tps,
                stats.ttft_s,
                stats.kv_tokens_in_use,
                stats.kv_capacity_tokens,
                0,
                True,
            )
        )
        self.on_event(Finished(rid, reason))

    def stop_generation(self) -> None:
        self._finish("stopped")

    def cancel_start(self) -> None:
        self.on_event(Error("start cancelled", "cancelled", fatal=True))
        self.shutdown()

    def shutdown(self, timeout: float = 15.0) -> None:
        if self._running:
            self._running = False
            self.on_event(Stopped(0))


def factory(script: Script | None = None) -> Callable[[Callable[[Event], None]], ScriptedEngine]:
    """An engine factory for GlydApp; the created engines are kept on `.engines` for assertions."""
    engines: list[ScriptedEngine] = []

    def make(on_event: Callable[[Event], None]) -> ScriptedEngine:
        engine = ScriptedEngine(on_event, script)
        engines.append(engine)
        return engine

    make.engines = engines  # type: ignore[attr-defined]
    return make
