"""Which of the model's layers and KV heads this vLLM worker holds, under tensor and pipeline parallelism.

The KV tables are per layer and KV head, so a worker needs only the slice for the attention layers its pipeline
stage builds and the KV heads its tensor-parallel rank computes. The split is vLLM's own: `get_pp_indices` for the
layers, and the QKV layer's for the heads (`QKVParallelLinear`: a rank takes `heads / tp` consecutive KV heads, or,
where there are fewer KV heads than ranks, each head is replicated on `tp / heads` consecutive ranks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankShare:
    """The model's layers (global indices) and KV heads one worker holds."""

    layers: range
    kv_heads: range

    @classmethod
    def whole(cls, num_layers: int, num_kv_heads: int) -> RankShare:
        return cls(range(num_layers), range(num_kv_heads))

    def describe(self) -> str:
        def span(r: range) -> str:
            return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"

        return f"layers {span(self.layers)}, KV heads {span(self.kv_heads)}"


def kv_heads_of_rank(total: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads tensor-parallel rank `tp_rank` of `tp_size` computes (vLLM's QKVParallelLinear split)."""
    if tp_size >= total:
        if tp_size % total:
            raise ValueError(f"{total} KV heads cannot be replicated evenly over {tp_size} ranks")
        head = tp_rank // (tp_size // total)
        return range(head, head + 1)
    if total % tp_size:
        raise ValueError(f"{total} KV heads cannot be split evenly over {tp_size} ranks")
    n = total // tp_size
    return range(tp_rank * n, (tp_rank + 1) * n)


def layers_of_stage(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers pipeline stage `pp_rank` of `pp_size` builds (vLLM's get_pp_indices, VLLM_PP_LAYER_PARTITION)."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    return range(start, end)


def current_share(num_layers: int, num_kv_heads: int) -> RankShare:
    """This process's share: the whole model where vLLM's parallel groups are not set up (one device, or a
    process that builds no model)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return RankShare.whole(num_layers, num_kv_heads)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    return RankShare(layers_of_stage(num_layers, pp.rank_in_group, pp.world_size),
                     kv_heads_of_rank(num_kv_heads, tp.world_size, tp.rank_in_group))
