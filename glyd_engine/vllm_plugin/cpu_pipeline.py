"""Pipeline parallelism on vLLM's CPU build with an explicit KV size: the receive buffer of a later stage.

vLLM 0.32's CPU worker skips its warm-up forward when the model runs eager and the KV cache size is given
(`--kv-cache-memory-bytes`, which `glyd serve` and glyd-chat always set on the CPU). That forward is what
allocates a later pipeline stage's buffer for the activations it receives (`intermediate_tensors`), so every
pipeline-parallel engine so configured fails its first step (`assert self.intermediate_tensors is not None`),
Glyd or not. After the worker's warm-up step this allocates the buffer as the warm-up would have.
"""

from __future__ import annotations

from typing import Any

_MARK = "_glyd_pipeline_buffer"


def ensure_receive_buffer(worker: Any) -> None:
    """A later stage's `intermediate_tensors`, sized as vLLM's warm-up run sizes it (max tokens a step)."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def install() -> None:
    """Wrap the CPU worker's warm-up step once a process (a no-op where vLLM has no CPU worker)."""
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker
    except ImportError:
        return
    original = CPUWorker.compile_or_warm_up_model
    if getattr(original, _MARK, False):
        return

    def compile_or_warm_up_model(self: Any) -> Any:
        result = original(self)
        ensure_receive_buffer(self)
        return result

    setattr(compile_or_warm_up_model, _MARK, True)
    CPUWorker.compile_or_warm_up_model = compile_or_warm_up_model
