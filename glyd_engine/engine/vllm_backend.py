"""vLLM inside the engine child: load with progress, stream one reply at a time, abort on request.

Streaming uses vLLM's in-process `LLMEngine` (V1): `add_request` with `RequestOutputKind.DELTA`, then
`step()` in the child's loop, which checks for a stop request between steps; `abort_request` stops a
reply at once. No extra engine-core process: the child itself is the isolation, and its exit frees
everything.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glyd_engine import paths, torch_extras
from glyd_engine.engine.engine_args import engine_args
from glyd_engine.engine.protocol import (
    Delta,
    EngineSettings,
    Event,
    Finished,
    Generate,
    GenerationParams,
    Progress,
    Ready,
    Stats,
)
from glyd_engine.engine.report import kv_report, rss_bytes, weights_report
from glyd_engine.models.resolve import display_name

log = logging.getLogger("glyd.engine")

JOB = "engine"
STATS_INTERVAL_S = 0.25
CPU_PREFILL_CHUNK = 512  # prompt tokens a step on the CPU: a step stays ~1 s, so Esc stops a long prompt soon

# vLLM log lines -> the phase a user reads; matched as substrings, in order of appearance.
_PHASES = (
    ("Resolved architecture", "Reading the model's configuration"),
    ("Initializing a V1 LLM engine", "Setting up the engine"),
    ("Starting to load model", "Loading the weights"),
    ("Loading weights took", "Weights loaded; profiling memory"),
    ("Warming up model", "Compiling the model (first start only)"),
    ("compiling Glyd CUDA kernels", "Compiling Glyd's CUDA kernels (first start only)"),
    ("KV cache size", "Allocating the KV cache"),
    ("init engine", "Finishing"),
)


class _PhaseHook:
    """Turns vLLM's log lines into phase names for the progress events.

    A log-record factory rather than a handler: vLLM reconfigures its loggers (replacing handlers)
    while the engine is built, but it wraps whatever record factory is installed, so this one sees
    every record vLLM creates.
    """

    def __init__(self, on_phase: Callable[[str], None]) -> None:
        self.on_phase = on_phase
        self.previous = logging.getLogRecordFactory()

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.previous(*args, **kwargs)
        if record.name.startswith("vllm"):
            try:
                text = record.getMessage()
            except Exception:  # noqa: BLE001 - a bad log record must not break the load
                return record
            for needle, phase in _PHASES:
                if needle in text:
                    self.on_phase(phase)
                    break
        return record

    def __enter__(self) -> _PhaseHook:
        logging.setLogRecordFactory(self)
        return self

    def __exit__(self, *_: object) -> None:
        # vLLM may have wrapped us; unwrapping its factory is not ours to do, so just go quiet.
        self.on_phase = lambda _phase: None
        if logging.getLogRecordFactory() is self:
            logging.setLogRecordFactory(self.previous)


class _LoadTicker:
    """Progress while vLLM loads, which has no progress of its own: elapsed time against the last load
    of the same model (remembered on disk), phase text from vLLM's log."""

    def __init__(self, key: str, emit: Callable[[Event], None], default_s: float) -> None:
        self.key, self.emit = key, emit
        self.file = paths.cache_dir() / "engine" / "load-times.json"
        self.expected = self._history().get(key, default_s)
        self.phase = "Importing vLLM"
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="glyd-load-ticker", daemon=True)

    def _history(self) -> dict[str, float]:
        try:
            return {str(k): float(v) for k, v in json.loads(self.file.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def __enter__(self) -> _LoadTicker:
        self._thread.start()
        return self

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._tick()

    def _tick(self) -> None:
        elapsed = time.monotonic() - self.start
        total = max(self.expected, elapsed * 1.05)
        self.emit(Progress(JOB, self.phase, round(elapsed, 2), round(total, 2), round(total - elapsed, 1)))

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._tick()

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            elapsed = time.monotonic() - self.start
            self.emit(Progress(JOB, "Ready", elapsed, elapsed, 0.0))
            history = self._history()
            history[self.key] = round(elapsed, 1)
            try:
                from glyd_engine.atomic import atomic_write_bytes

                atomic_write_bytes(self.file, json.dumps(history, indent=1).encode())
            except OSError as exc:
                log.warning("could not remember the load time: %s", exc)


class _Reply:
    """Bookkeeping for the reply in flight: timings and counts for the stats events."""

    def __init__(self, rid: str, prompt_tokens: int, trimmed: int) -> None:
        self.rid, self.prompt_tokens, self.trimmed = rid, prompt_tokens, trimmed
        self.internal_id = rid  # vLLM's own id for the request (it appends a suffix)
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.generated = 0
        self.last_stats = 0.0


def import_engine() -> tuple[Any, Any, Any, Any]:
    """vLLM and the pieces the engine starts with: (vllm, EngineArgs, current_platform, LLMEngine). `glyd doctor`
    runs this very import, so it tells whether a start gets past it. Torch add-ons that cannot load (a
    torchvision built for another torch) are kept out first (glyd_engine.torch_extras)."""
    torch_extras.guard()
    import vllm
    from vllm import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    return vllm, EngineArgs, current_platform, LLMEngine


class VllmBackend:
    def __init__(self, model: str, model_dir: Path, settings: EngineSettings, emit: Callable[[Event], None]) -> None:
        self.model, self.model_dir, self.settings, self.emit = model, model_dir, settings, emit
        self.engine: Any = None
        self.tokenizer: Any = None
        self.reply: _Reply | None = None
        self.capacity = 0
        self.sampling_defaults: dict[str, Any] = {}

    # ------------------------------------------------------------------ load

    def load(self) -> Ready:
        s = self.settings
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        start = time.monotonic()
        eager_key = "eager" if s.enforce_eager is not False else "compiled"
        with _LoadTicker(f"{self.model_dir}|{eager_key}", self.emit, default_s=30.0) as ticker:
            vllm, EngineArgs, current_platform, LLMEngine = import_engine()

            with _PhaseHook(ticker.set_phase):
                cpu = current_platform.is_cpu()
                chunk = s.max_num_batched_tokens or (CPU_PREFILL_CHUNK if cpu else None)
                kwargs = engine_args(self.model_dir, dataclasses.replace(s, max_num_batched_tokens=chunk),
                                     cpu=cpu, disable_log_stats=True)
                eager = kwargs["enforce_eager"]
                self.engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        vc = self.engine.vllm_config
        self.tokenizer = self.engine.get_tokenizer()
        cc = vc.cache_config
        self.capacity = int((cc.num_gpu_blocks or 0) * cc.block_size)
        kv = kv_report(vc)
        resident = None
        if vc.model_config.quantization == "glyd":  # packed weights: what the worker holds in memory
            from glyd_engine.vllm_plugin.weights import worker_weight_bytes

            try:
                resident = int(self.engine.collective_rpc(worker_weight_bytes)[0]["glyd_weight_bytes"])
            except Exception as exc:  # a report only: fall back to the bytes on disk
                log.warning("resident weight bytes unavailable (%s); reporting the checkpoint's size", exc)
        weights = weights_report(self.model_dir, resident, run_bytes=vc.model_config.dtype.itemsize)
        try:  # the model's generation_config.json, as vLLM's OpenAI server applies it
            self.sampling_defaults = dict(vc.model_config.get_diff_sampling_param())
        except Exception as exc:  # noqa: BLE001 - a model without one samples with vLLM's neutral defaults
            log.warning("no sampling defaults from the model (%s)", exc)
        archs = getattr(vc.model_config.hf_config, "architectures", None) or [""]
        return Ready(
            model=self.model,
            name=display_name(self.model, self.model_dir),
            path=str(self.model_dir),
            architecture=archs[0],
            device="cpu" if cpu else "cuda",
            engine=f"vLLM {vllm.__version__} ({'CPU' if cpu else 'CUDA'} build{', eager' if eager else ''}"
                   + (f", {_threads()} threads)" if cpu else ")"),
            max_model_len=int(vc.model_config.max_model_len),
            kv_capacity_tokens=self.capacity,
            kv_bytes_per_token=kv.bytes_per_token,
            kv_bf16_bytes_per_token=kv.bf16_bytes_per_token,
            weights_bytes=weights.bytes,
            weights_bf16_bytes=weights.bf16_bytes,
            kv_mode=kv.mode,
            kv_reason=kv.reason,
            load_seconds=round(time.monotonic() - start, 2),
            rss_bytes=rss_bytes(),
            dtype=str(vc.model_config.dtype).removeprefix("torch."),
            weights_dtype=weights.dtype,
            sampling_defaults={k: v for k, v in self.sampling_defaults.items() if isinstance(v, int | float)},
        )

    # ------------------------------------------------------------------ generate

    @property
    def busy(self) -> bool:
        return self.reply is not None

    def _prompt_ids(self, req: Generate) -> tuple[list[int], int]:
        """The chat template applied in the child; the oldest turns are left out until the prompt
        leaves room for at least a short reply."""
        system = [{"role": "system", "content": req.params.system_prompt}] if req.params.system_prompt else []
        turns = [m for m in req.messages if m.get("role") in ("user", "assistant", "system")]
        budget = self.settings.max_model_len - min(req.params.max_tokens, self.settings.max_model_len // 4)
        trimmed = 0
        while True:
            text = self.tokenizer.apply_chat_template(system + turns, tokenize=False, add_generation_prompt=True)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(ids) <= budget or len(turns) <= 1:
                return ids[-budget:], trimmed
            turns = turns[1:]
            trimmed += 1

    def submit(self, req: Generate) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.reply is not None:
            self.abort()
        ids, trimmed = self._prompt_ids(req)
        room = max(1, self.settings.max_model_len - len(ids))
        params = SamplingParams(**sampling_kwargs(req.params, self.sampling_defaults, room),
                                output_kind=RequestOutputKind.DELTA)
        self.reply = _Reply(req.id, len(ids), trimmed)
        internal = self.engine.add_request(req.id, TokensPrompt(prompt_token_ids=ids), params)
        if isinstance(internal, str):
            self.reply.internal_id = internal

    def step(self) -> None:
        """One engine step: deltas out, and the stats now and then; the end of the reply when done."""
        reply = self.reply
        if reply is None:
            return
        for out in self.engine.step():
            if out.request_id != reply.rid:
                continue
            now = time.monotonic()
            for o in out.outputs[:1]:
                n = len(o.token_ids)
                if n:
                    if reply.t_first is None:
                        reply.t_first = now
                    reply.generated += n
                    reply.t_last = now
                if o.text or n:
                    self.emit(Delta(reply.rid, o.text, n))
            if out.finished:
                reason = (out.outputs[0].finish_reason if out.outputs else None) or "stop"
                self._finish(reason)
                return
        now = time.monotonic()
        if now - reply.last_stats >= STATS_INTERVAL_S:  # also while a long prompt is read (no output yet)
            reply.last_stats = now
            self.emit(self._stats(reply, final=False))

    def _prompt_done(self, r: _Reply) -> int:
        """Prompt tokens vLLM has processed for the reply (its scheduler's count, in this process)."""
        if r.t_first is not None:
            return r.prompt_tokens
        try:
            request = self.engine.engine_core.engine_core.scheduler.requests.get(r.internal_id)
            return min(r.prompt_tokens, int(request.num_computed_tokens)) if request is not None else 0
        except AttributeError:  # another vLLM layout: no progress, never an error
            return 0

    def abort(self) -> None:
        if self.reply is not None:
            self.engine.abort_request([self.reply.rid])
            self._finish("stopped")

    def _finish(self, reason: str) -> None:
        reply, self.reply = self.reply, None
        if reply is None:
            return
        self.emit(self._stats(reply, final=True))
        self.emit(Finished(reply.rid, reason))

    def _stats(self, r: _Reply, final: bool) -> Stats:
        ttft = None if r.t_first is None else r.t_first - r.t_submit
        gen_tps = None
        if r.t_first is not None and r.t_last is not None and r.generated > 1 and r.t_last > r.t_first:
            gen_tps = (r.generated - 1) / (r.t_last - r.t_first)
        return Stats(
            id=r.rid,
            prompt_tokens=r.prompt_tokens,
            generated_tokens=r.generated,
            prompt_tps=(r.prompt_tokens / ttft) if ttft else None,
            gen_tps=gen_tps,
            ttft_s=ttft,
            kv_tokens_in_use=r.prompt_tokens + r.generated,
            kv_capacity_tokens=self.capacity,
            trimmed_messages=r.trimmed,
            final=final,
            prompt_done=self._prompt_done(r),
            rss_bytes=rss_bytes(),
        )

    def close(self) -> None:
        self.engine = None


def sampling_kwargs(p: GenerationParams, defaults: dict[str, Any], room: int) -> dict[str, Any]:
    """SamplingParams for one reply: the model's defaults (generation_config.json) under the user's settings,
    and a fresh seed unless the user fixed one (vLLM's engine-wide seed would repeat every reply in every
    home)."""
    kw = {k: v for k, v in defaults.items() if k != "max_tokens"}
    if p.temperature is not None:
        kw["temperature"] = max(0.0, float(p.temperature))
    if p.top_p is not None:
        kw["top_p"] = min(1.0, max(1e-3, float(p.top_p)))
    kw["max_tokens"] = max(1, min(int(p.max_tokens), room))
    kw["seed"] = int(p.seed) if p.seed is not None else secrets.randbelow(1 << 31)
    return kw


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())
