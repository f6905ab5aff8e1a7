"""The engine runner's wire format: JSON lines between a front end (the app, `glyd serve`) and the child.

Requests go to the child on its stdin, events come back on a private pipe, one JSON object a line.
Everything here is plain data (stdlib only), so both sides and the app's stand-in engine share it
without importing torch, vLLM or Textual.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from glyd_engine import kv_mode
from glyd_engine.errors import ErrorKind, SettingError
from glyd_engine.kv_mode import KVMode
from glyd_engine.progress import ProgressEvent

PROTOCOL_VERSION = 1


@dataclass
class EngineSettings:
    """What a start needs besides the model; defaults suit a laptop CPU and scale on a GPU."""

    kv: KVMode = "auto"  # Glyd's KV mode (glyd_engine.kv_mode); vLLM's own cache when off
    max_model_len: int = 4096
    kv_cache_bytes: int | None = 256 << 20  # fixed KV budget (CPU); None: vLLM sizes it (GPU)
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool | None = None  # None: eager on CPU (starts in seconds, not minutes)
    dtype: str = "bfloat16"
    # Prompt tokens a step may process (vLLM's chunked prefill). None: 512 on the CPU, where a step of
    # a long prompt would otherwise take many seconds (Esc waits for the step), vLLM's default on a GPU.
    max_num_batched_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "engine settings") -> EngineSettings:
        """Settings from plain data (a request, config.toml's [engine]), each value parsed: a bad one is a
        SettingError naming `source`, the key and what it takes. Unknown keys are left out (a newer front end)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: parse_setting(k, v, source) for k, v in data.items() if k in names})


# What each engine setting takes: (parser, what the error says it takes). None stays None where the default is.
def _whole(low: int) -> Any:
    def parse(v: Any) -> int:
        if isinstance(v, bool) or int(v) != float(v) or int(v) < low:
            raise ValueError
        return int(v)
    return parse


def _fraction(v: Any) -> float:
    if isinstance(v, bool) or not 0 < float(v) <= 1:
        raise ValueError
    return float(v)


def _switch(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError
    return v


_PARSERS: dict[str, tuple[Any, str]] = {
    "max_model_len": (_whole(1), "a whole number of tokens, at least 1"),
    "kv_cache_bytes": (_whole(0), "a whole number of bytes (0: vLLM sizes the cache)"),
    "gpu_memory_utilization": (_fraction, "a fraction above 0, at most 1"),
    "enforce_eager": (_switch, "true or false"),
    "dtype": (str, "a dtype name (bfloat16)"),
    "max_num_batched_tokens": (_whole(1), "a whole number of tokens, at least 1"),
}


def parse_setting(key: str, value: Any, source: str, written: str = "") -> Any:
    """One engine setting's value, typed; `source` names where it came from in the error, `written` the key as the
    user wrote it (config.toml's kv_cache_mib for kv_cache_bytes: the number's unit is the caller's)."""
    if key == "kv":
        return kv_mode.parse(value, f"{source} {written or key}")
    parser, takes = _PARSERS[key]
    if value is None:
        return None
    try:
        return parser(value)
    except (TypeError, ValueError):
        takes = takes.replace("bytes", "MiB") if written.endswith("_mib") else takes
        raise SettingError(f"{source} {written or key}={value!r} is not valid", f"give {takes}") from None


@dataclass
class GenerationParams:
    """One reply's sampling. None means the model's own default (its generation_config.json, as vLLM reads
    it; vLLM's neutral default where the model has none); no seed means a fresh one for every reply."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = 512
    system_prompt: str = ""
    seed: int | None = None


# ---------------------------------------------------------------- requests (front end -> child)


@dataclass
class Request:
    op: ClassVar[str] = ""


@dataclass
class Start(Request):
    op: ClassVar[str] = "start"
    model: str = ""
    settings: EngineSettings = field(default_factory=EngineSettings)


@dataclass
class Generate(Request):
    op: ClassVar[str] = "generate"
    id: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)  # [{"role": ..., "content": ...}]
    params: GenerationParams = field(default_factory=GenerationParams)


@dataclass
class StopGeneration(Request):
    """Esc in the app: abort the reply in flight; the engine stays loaded."""

    op: ClassVar[str] = "stop"
    id: str | None = None


@dataclass
class CancelStart(Request):
    """Cancel a start in progress (download, table build, load); the child exits."""

    op: ClassVar[str] = "cancel"


@dataclass
class Shutdown(Request):
    op: ClassVar[str] = "shutdown"


# ---------------------------------------------------------------- events (child -> front end)


@dataclass
class Event:
    event: ClassVar[str] = ""


@dataclass
class Progress(Event):
    """One step of a start: model build or download, KV table build, engine load."""

    event: ClassVar[str] = "progress"
    job: str = ""
    phase: str = ""
    done: float = 0.0
    total: float | None = None
    eta_s: float | None = None

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return min(1.0, max(0.0, self.done / self.total))

    @classmethod
    def of(cls, event: ProgressEvent) -> Progress:
        """The wire copy of a job's progress: the one place the two meet (jobs stay free of the protocol)."""
        return cls(event.job, event.phase, event.done, event.total, event.eta_s)


@dataclass
class Ready(Event):
    """The engine is loaded; every number the stats bar shows that does not change per reply."""

    event: ClassVar[str] = "ready"
    model: str = ""  # what the user asked for
    name: str = ""  # a short display name
    path: str = ""
    architecture: str = ""
    device: str = ""  # "cpu" or "cuda"
    engine: str = ""  # e.g. "vLLM 0.32.0 (CPU build)"
    max_model_len: int = 0
    kv_capacity_tokens: int = 0
    kv_bytes_per_token: float = 0.0
    kv_bf16_bytes_per_token: float = 0.0
    weights_bytes: int = 0
    weights_bf16_bytes: int = 0
    kv_mode: str = ""  # what runs: lossless | exact | off (vLLM's own cache)
    kv_reason: str = ""
    load_seconds: float = 0.0
    rss_bytes: int | None = None
    dtype: str = ""  # what the weights run as ("bfloat16")
    weights_dtype: str = ""  # what the checkpoint holds ("bfloat16", "float32", "glyd")
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # the model's generation_config


@dataclass
class Delta(Event):
    event: ClassVar[str] = "delta"
    id: str = ""
    text: str = ""
    tokens: int = 0


@dataclass
class Stats(Event):
    """Per reply, sent a few times a second while generating and once more at its end (final)."""

    event: ClassVar[str] = "stats"
    id: str = ""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_tps: float | None = None
    gen_tps: float | None = None
    ttft_s: float | None = None
    kv_tokens_in_use: int = 0
    kv_capacity_tokens: int = 0
    trimmed_messages: int = 0  # older turns left out so the prompt fits the context
    final: bool = False
    prompt_done: int = 0  # prompt tokens processed so far (a long prompt takes many steps)
    rss_bytes: int | None = None  # the engine process's resident memory


@dataclass
class Finished(Event):
    event: ClassVar[str] = "finished"
    id: str = ""
    reason: str = ""  # stop | length | stopped | error


@dataclass
class Error(Event):
    """Something failed; `fatal` means the child is gone (or going) and must be started again. A refusal
    (errors.RefusedError) sends its reason as `message` and what to do instead as `fix`."""

    event: ClassVar[str] = "error"
    message: str = ""
    kind: ErrorKind = "crash"
    fatal: bool = True
    id: str | None = None
    log_path: str | None = None
    fix: str = ""


@dataclass
class Stopped(Event):
    """The child has exited (after a shutdown, a cancel, a failed start or a crash)."""

    event: ClassVar[str] = "stopped"
    exit_code: int | None = None


REQUESTS: dict[str, type[Request]] = {c.op: c for c in (Start, Generate, StopGeneration, CancelStart, Shutdown)}
EVENTS: dict[str, type[Event]] = {c.event: c for c in (Progress, Ready, Delta, Stats, Finished, Error, Stopped)}


def encode(msg: Request | Event) -> str:
    body = asdict(msg)
    if isinstance(msg, Request):
        body["op"] = msg.op
    else:
        body["event"] = msg.event
    return json.dumps(body, separators=(",", ":"))


def decode_request(line: str) -> Request:
    data = json.loads(line)
    cls = REQUESTS[data.pop("op")]
    if cls is Start:
        return Start(model=data.get("model", ""), settings=EngineSettings.from_dict(data.get("settings") or {}))
    if cls is Generate:
        params = GenerationParams(**(data.get("params") or {}))
        return Generate(id=data.get("id", ""), messages=data.get("messages", []), params=params)
    return cls(**data)


def decode_event(line: str) -> Event:
    data = json.loads(line)
    cls = EVENTS[data.pop("event")]
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})
