"""`--quantization glyd`: serve a Glyd checkpoint with its weights compressed in memory.

vLLM's loader maps each packed part (`q_proj.weight_glyd_sm` -> `qkv_proj.weight_glyd_sm`, shard 'q') onto
a placeholder parameter of the layer; its loader keeps the part, by shard, without decoding. After loading,
each layer's shards are checked (every part present, shapes as the layer expects), decoded once from the
file's prefix code and re-coded into the resident form (format/resident.py, ~12 bits a weight), which stays
in memory. Every matmul decodes its weight to bf16 and runs vLLM's own unquantized GEMM on it, so outputs
equal the bf16 model's bit for bit. On CUDA a weight whose shape allows it is held in the fragment layout
instead (format/fragment_weight.py, `GLYD_WEIGHT_LAYOUT`): the CUDA matmul (kernels/matmul_cuda.py) decodes it
in registers for 1-64 rows of x, larger batches decode it once and run vLLM's GEMM; other weights run the
Triton kernels (kernels/resident_linear.py). An embedding in the fragment layout decodes only the rows a batch
looks up (the resident one too, on the CPU); a tied lm_head reads the embedding's weight. Under tensor parallelism
each rank keeps its split of every packed tensor (vLLM's own split: `Split`), decoded from the split's chunks only,
and the ranks check each tensor's crc32 together (format/weight_shard.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

from glyd_engine.errors import CorruptFileError, RefusedError, UnsupportedModelError
from glyd_engine.format import FORMAT_VERSION, resident
from glyd_engine.format import fragment_weight as fw
from glyd_engine.format import weight_shard as shard
from glyd_engine.format import weights as wcode
from glyd_engine.format.checkpoint import MIN_PACKED_VALUES, QUANT_METHOD
from glyd_engine.vllm_plugin.settings import options, weights_mode

log = logging.getLogger("vllm.glyd")

PART_DTYPES = {"sm": torch.uint8, "exp": torch.int32, "off": torch.int32, "len": torch.uint8, "meta": torch.int64}
QKV_SHARDS = {"q": 0, "k": 1, "v": 2}
BUFFERS = ("glyd_sm", "glyd_offs", "glyd_esc_pos", "glyd_esc_bits")
FRAGMENT_BUFFERS = ("glyd_frag_data", "glyd_frag_rowptr", "glyd_frag_esc", "glyd_frag_colptr")


# -- the matmul: one op, plain torch decode + vLLM's GEMM on the CPU, the fused Triton kernel on CUDA -----
class _GemmHolder(torch.nn.Module):
    """What vLLM's CPU GEMM dispatch reads (`weight`, `bias`) and writes (`cpu_linear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        # The dispatch may widen the bias in place (its small-GEMM kernel): never the caller's tensor.
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)


def dense_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """vLLM's unquantized GEMM on a decoded weight: the same kernel choice as the bf16 model, same bits."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm, dispatch_unquantized_gemm
    from vllm.platforms import current_platform

    holder = _GemmHolder(weight, bias)
    if current_platform.is_cpu():
        dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
        return holder.cpu_linear(x, holder.weight, holder.bias)
    return dispatch_unquantized_gemm()(holder, x, holder.weight, holder.bias)


@torch.library.custom_op("glyd::resident_linear", mutates_args=())
def resident_linear(x: torch.Tensor, sm: torch.Tensor, offs: torch.Tensor, esc_pos: torch.Tensor,
                    esc_bits: torch.Tensor, plan_rowptr: torch.Tensor, plan_col: torch.Tensor,
                    plan_corr: torch.Tensor, base: int, rows: int, cols: int,
                    bias: torch.Tensor | None, fused: bool = True) -> torch.Tensor:
    """x @ W.T (+ bias). CPU: torch decode + vLLM's GEMM (the bf16 model's bits). CUDA: the fused Triton
    kernel for up to FUSED_ROWS rows of x (faster than decode + GEMM there, docs/gpu.md), else (and always where
    `fused` is off: the exact weights mode) the Triton decode + vLLM's GEMM."""
    r = resident.ResidentWeight((rows, cols), sm, offs, base, esc_pos, esc_bits)
    if x.is_cuda and cols % 2 == 0:
        from glyd_kernels import resident_linear as kernel

        flat = x.reshape(-1, cols)
        if fused and flat.shape[0] <= kernel.FUSED_ROWS and plan_rowptr.numel() == rows + 1:
            plan = kernel.EscapePlan(plan_rowptr, plan_col, plan_corr)
            return kernel.resident_linear(flat, r, plan, bias).reshape(*x.shape[:-1], rows)
        return dense_gemm(x, kernel.resident_decode(r), bias)
    return dense_gemm(x, resident.decode(r), bias)


@resident_linear.register_fake
def _(x: torch.Tensor, sm: torch.Tensor, offs: torch.Tensor, esc_pos: torch.Tensor, esc_bits: torch.Tensor,
      plan_rowptr: torch.Tensor, plan_col: torch.Tensor, plan_corr: torch.Tensor, base: int, rows: int, cols: int,
      bias: torch.Tensor | None, fused: bool = True) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], rows))


@torch.library.custom_op("glyd::resident_embedding", mutates_args=())
def resident_embedding(ids: torch.Tensor, sm: torch.Tensor, offs: torch.Tensor, esc_pos: torch.Tensor,
                       esc_bits: torch.Tensor, base: int, rows: int, cols: int) -> torch.Tensor:
    """Embedding rows [*ids.shape, cols], bf16. An op of its own because decoding only the looked-up rows
    depends on the data (how many escapes they hold): torch.compile cannot trace that, so it sees this op
    through its fake implementation. CUDA: decode all, then gather (no host sync, CUDA-graph safe)."""
    r = resident.ResidentWeight((rows, cols), sm, offs, base, esc_pos, esc_bits)
    if ids.is_cuda and cols % 2 == 0:
        from glyd_kernels.resident_linear import resident_decode

        return torch.nn.functional.embedding(ids, resident_decode(r))
    return resident.decode_rows(r, ids).reshape(*ids.shape, cols)


@resident_embedding.register_fake
def _(ids: torch.Tensor, sm: torch.Tensor, offs: torch.Tensor, esc_pos: torch.Tensor, esc_bits: torch.Tensor,
      base: int, rows: int, cols: int) -> torch.Tensor:
    return ids.new_empty((*ids.shape, cols), dtype=torch.bfloat16)


@torch.library.custom_op("glyd::fragment_linear", mutates_args=())
def fragment_linear(x: torch.Tensor, data: torch.Tensor, rowptr: torch.Tensor, esc: torch.Tensor, colptr: torch.Tensor,
                    lo: int, rows: int, cols: int, bias: torch.Tensor | None, fused: bool = True) -> torch.Tensor:
    """x @ W.T (+ bias), W in the fragment layout. CUDA: the CUDA matmul for up to `fused_rows` (64, on Hopper 128 for
    large W) rows of x, else (and always where `fused` is off: the exact weights mode) its decode + vLLM's GEMM, the
    bf16 model's kernel on the same bf16 W. CPU: the layout's torch decode + vLLM's GEMM (the bf16 model's bits; how
    the tests run it)."""
    f = fw.FragmentWeight((rows, cols), data, lo, rowptr, esc, colptr)
    if x.is_cuda:
        from glyd_kernels import matmul_cuda as kernel

        flat = x.reshape(-1, cols)
        if fused and flat.shape[0] <= kernel.fused_rows(rows, cols, flat.device.index or 0):
            return kernel.matmul(flat, f, bias).reshape(*x.shape[:-1], rows)
        return dense_gemm(x, kernel.decode(f), bias)
    return dense_gemm(x, fw.decode(f), bias)


@fragment_linear.register_fake
def _(x: torch.Tensor, data: torch.Tensor, rowptr: torch.Tensor, esc: torch.Tensor, colptr: torch.Tensor, lo: int,
      rows: int, cols: int, bias: torch.Tensor | None, fused: bool = True) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], rows))


@torch.library.custom_op("glyd::fragment_embedding", mutates_args=())
def fragment_embedding(ids: torch.Tensor, data: torch.Tensor, rowptr: torch.Tensor, esc: torch.Tensor, lo: int,
                       rows: int, cols: int) -> torch.Tensor:
    """Embedding rows [*ids.shape, cols] of a fragment-layout weight. CUDA: a kernel that decodes only the looked-up
    rows (no host sync, CUDA-graph safe). CPU: only the 16-row tiles the ids fall in."""
    f = fw.FragmentWeight((rows, cols), data, lo, rowptr, esc)
    if ids.is_cuda:
        from glyd_kernels import matmul_cuda as kernel

        return kernel.gather_rows(f, ids).reshape(*ids.shape, cols)
    return fw.decode_rows(f, ids).reshape(*ids.shape, cols)


@fragment_embedding.register_fake
def _(ids: torch.Tensor, data: torch.Tensor, rowptr: torch.Tensor, esc: torch.Tensor, lo: int, rows: int,
      cols: int) -> torch.Tensor:
    return ids.new_empty((*ids.shape, cols), dtype=torch.bfloat16)


def _apply(src: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows, cols = src.glyd_shape
    if src.glyd_layout == "fragment":
        return fragment_linear(x, src.glyd_frag_data, src.glyd_frag_rowptr, src.glyd_frag_esc, src.glyd_frag_colptr,
                               src.glyd_lo, rows, cols, bias, src.glyd_fused)
    return resident_linear(x, src.glyd_sm, src.glyd_offs, src.glyd_esc_pos, src.glyd_esc_bits, src.glyd_plan_rowptr,
                           src.glyd_plan_col, src.glyd_plan_corr, src.glyd_base, rows, cols, bias, src.glyd_fused)


# -- loading -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """Where one output partition of a layer (q, k, v, gate, up, or the whole) lies in the checkpoint's tensor:
    `full` rows there, this rank's `count` of them from `start`; and likewise the layer's columns."""

    full: int
    start: int
    count: int


def _partition_splits(layer: torch.nn.Module, local: list[int]) -> list[Split]:
    """This rank's rows of each output partition, by vLLM's own split (its weight loaders' narrow)."""
    tp, rank = int(getattr(layer, "tp_size", 1) or 1), int(getattr(layer, "tp_rank", 0) or 0)
    if tp == 1 or isinstance(layer, RowParallelLinear | ReplicatedLinear):
        return [Split(n, 0, n) for n in local]
    if isinstance(layer, VocabParallelEmbedding):
        idx = layer.shard_indices
        return [Split(int(layer.org_vocab_size), idx.org_vocab_start_index, idx.num_org_elements)]
    if isinstance(layer, QKVParallelLinear):
        kv = rank // layer.num_kv_head_replicas
        return [Split(layer.total_num_heads * layer.head_size, rank * local[0], local[0]),
                Split(layer.total_num_kv_heads * layer.head_size, kv * local[1], local[1]),
                Split(layer.total_num_kv_heads * layer.v_head_size, kv * local[2], local[2])]
    return [Split(n * tp, rank * n, n) for n in local]  # column-parallel: rank's n rows of each partition


def _column_split(layer: torch.nn.Module, local_cols: int) -> Split:
    if isinstance(layer, RowParallelLinear) and int(getattr(layer, "tp_size", 1) or 1) > 1:
        return Split(int(layer.input_size), layer.tp_rank * local_cols, local_cols)
    return Split(local_cols, 0, local_cols)


@dataclass
class _Pending:
    """A layer's packed parts as they arrive, by shard (a tuple of output-partition indices). Under tensor
    parallelism every rank receives the checkpoint's whole tensors and keeps its split (`splits`, `cols`)."""

    prefix: str
    splits: list[Split]  # each output partition's rows
    cols: Split
    pieces: dict[tuple[int, ...], dict[str, torch.Tensor]] = field(default_factory=dict)

    def span(self, shard_id: Any) -> tuple[int, ...]:
        if shard_id is None:
            return tuple(range(len(self.splits)))
        if isinstance(shard_id, str):
            if shard_id not in QKV_SHARDS:
                raise UnsupportedModelError(f"{self.prefix}: unknown shard {shard_id!r}")
            return (QKV_SHARDS[shard_id],)
        if isinstance(shard_id, tuple):
            return tuple(int(i) for i in shard_id)
        return (int(shard_id),)

    def add(self, part: str, tensor: torch.Tensor, shard_id: Any) -> None:
        # Keep a copy: the loader's tensors may be views of a file that is closed after loading.
        self.pieces.setdefault(self.span(shard_id), {})[wcode.part_name("weight", part)] = tensor.detach().clone()

    def shard_label(self, span: tuple[int, ...]) -> str:
        if len(self.splits) == 1:
            return f"{self.prefix}.weight"
        names = "qkv" if len(self.splits) == 3 else None
        return f"{self.prefix}.weight (shard {', '.join(names[i] if names else str(i) for i in span)})"

    def window(self, span: tuple[int, ...]) -> shard.Window:
        """This rank's rows and columns of the checkpoint tensor holding the partitions `span`."""
        rows, at = [], 0
        for i in span:
            s = self.splits[i]
            rows.append((at + s.start, s.count))
            at += s.full
        return shard.Window(tuple(rows), (self.cols.start, self.cols.count), (at, self.cols.full))

    def build(self, crc_group: Any = None) -> resident.ResidentWeight:
        """Check the arrived parts and re-code this rank's split into one resident weight (rows in partition
        order). A split decodes only its chunks; its checksum share is checked with the other ranks' over
        `crc_group` (vLLM's tensor-parallel CPU group), every rank of which builds the same layers in order."""
        if not self.pieces:
            raise CorruptFileError(f"the Glyd checkpoint has no packed weight for {self.prefix}.weight "
                                   f"(expected {self.prefix}.weight_glyd_* or its unfused parts)")
        seen = sorted(i for span in self.pieces for i in span)
        expected = list(range(len(self.splits)))
        if seen != expected:
            missing = [self.shard_label((i,)) for i in expected if i not in seen]
            twice = sorted({i for i in seen if seen.count(i) > 1})
            what = f"missing {', '.join(missing)}" if missing else f"shards {twice} loaded twice"
            raise CorruptFileError(f"the Glyd checkpoint does not match the model: {what}")
        exps, sms, checks = [], [], []
        for span in sorted(self.pieces):
            label, parts = self.shard_label(span), self.pieces[span]
            absent = [wcode.SUFFIX + p for p in wcode.PARTS if wcode.part_name("weight", p) not in parts]
            if absent:
                raise CorruptFileError(f"the Glyd checkpoint lacks part(s) {', '.join(absent)} of {label}")
            try:
                packed = wcode.PackedTensor.from_parts("weight", parts)
            except CorruptFileError as exc:
                raise CorruptFileError(f"{label}: {exc}") from exc
            win = self.window(span)
            if tuple(packed.shape) != win.shape:
                raise CorruptFileError(f"{label}: the checkpoint holds shape {tuple(packed.shape)}, the model "
                                       f"expects {win.shape}")
            if win.is_whole:
                exp, sm = resident.planes_from_packed(packed, label)
            else:
                exp, sm = shard.decode_window(packed, win)
                checks.append((label, win.shape, packed.crc32, shard.shares(exp, sm, win)))
            exps.append(exp)
            sms.append(sm)
        self.pieces.clear()
        if checks:
            _check_split_crcs(checks, crc_group)
        rows = sum(s.count for s in self.splits)
        return resident.from_planes(torch.cat(exps), torch.cat(sms), (rows, self.cols.count))


def _check_split_crcs(checks: list[tuple[str, tuple[int, int], int, list[shard.Share]]], group: Any) -> None:
    """Every rank's checksum shares of a layer's split tensors, gathered over the tensor-parallel group and combined
    into each whole tensor's crc32 (weight_shard.py): a damaged file is caught though no rank decodes it whole."""
    import torch.distributed as dist

    mine = [c[3] for c in checks]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for i, (label, shape, crc, _) in enumerate(checks):
        whole = shard.combine([s for rank in gathered for s in rank[i]], shape)
        if whole is None:
            raise CorruptFileError(f"{label}: the tensor-parallel ranks' splits do not cover the tensor once, so its "
                                   "checksum cannot be checked")
        if whole != crc:
            raise CorruptFileError(f"{label}: decoded data does not match its checksum (the file is damaged)")


def _add_part_params(layer: torch.nn.Module, pending: _Pending) -> None:
    """One empty placeholder a part: vLLM's loader finds it by name and calls its weight_loader."""
    for part, dtype in PART_DTYPES.items():
        param = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

        def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None, _part: str = part) -> None:
            pending.add(_part, loaded, shard_id if shard_id is not None else getattr(loaded, "shard_id", None))

        param.weight_loader = load  # type: ignore[attr-defined]
        layer.register_parameter(wcode.part_name("weight", part), param)
    layer._glyd_pending = pending


def _remove_part_params(layer: torch.nn.Module) -> None:
    for part in PART_DTYPES:
        layer._parameters.pop(wcode.part_name("weight", part), None)


@functools.lru_cache(maxsize=8)
def _cuda_matmul_builds(device: torch.device) -> bool:
    """Whether the CUDA matmul compiles and loads here (a failure leaves weights to the Triton kernels, logged)."""
    try:
        from glyd_kernels import matmul_cuda

        matmul_cuda.kernels(1, matmul_cuda.default_config(1), device)
        return True
    except Exception as exc:  # noqa: BLE001 (NVRTC missing, a build or load failure: serve, slower)
        log.warning("Glyd: the CUDA matmul is not available (%s); weights stay in the resident layout and run the "
                    "Triton kernels", exc)
        return False


def weight_layout(device: torch.device, shape: tuple[int, ...]) -> str:
    """`resident` or `fragment` for a weight of this shape on this device (GLYD_WEIGHT_LAYOUT or additional_config
    glyd.weight_layout, options.py)."""
    from vllm.config import get_current_vllm_config_or_none

    asked = options(get_current_vllm_config_or_none()).weight_layout
    if asked == "resident" or fw.unsupported(shape) is not None:
        return "resident"
    if asked == "fragment":
        return "fragment"
    return "fragment" if device.type == "cuda" and _cuda_matmul_builds(device) else "resident"


def _install(layer: torch.nn.Module, r: resident.ResidentWeight, device: torch.device) -> None:
    r = r.to(device)
    layer.glyd_shape, layer.glyd_values = r.shape, r.numel
    layer.glyd_layout = weight_layout(device, r.shape)
    layer.glyd_fused = weights_mode() == "lossless"  # exact: decode + the bf16 model's GEMM at every row count
    if layer.glyd_layout == "fragment":
        if device.type == "cuda":
            from glyd_kernels import matmul_cuda

            matmul_cuda.preload(r.shape[0], device, r.shape[1])
        f = fw.from_resident(r)
        for name, t in zip(FRAGMENT_BUFFERS, (f.data, f.rowptr, f.esc, f.colptr), strict=True):
            layer.register_buffer(name, t, persistent=False)
        layer.glyd_lo, layer.glyd_bytes, layer.glyd_escapes = f.lo, f.nbytes, int(f.esc.numel())
        return
    for name, t in zip(BUFFERS, (r.sm, r.offs, r.esc_pos, r.esc_bits), strict=True):
        layer.register_buffer(name, t, persistent=False)
    plan = (torch.empty(0, dtype=torch.int32, device=device),) * 2 + (torch.empty(0, device=device),)
    if device.type == "cuda" and r.shape[1] % 2 == 0:  # the fused kernel's escape plan, made once
        from glyd_kernels.resident_linear import escape_plan

        p = escape_plan(r)
        plan = (p.rowptr, p.col, p.corr)
    for name, t in zip(("glyd_plan_rowptr", "glyd_plan_col", "glyd_plan_corr"), plan, strict=True):
        layer.register_buffer(name, t, persistent=False)
    layer.glyd_base, layer.glyd_escapes = r.base, int(r.esc_pos.numel())
    layer.glyd_bytes = r.nbytes + sum(t.numel() * t.element_size() for t in plan)


def _finish(layer: torch.nn.Module) -> None:
    device = next((p.device for p in layer.parameters(recurse=False)), torch.device("cpu"))
    group = None
    if int(getattr(layer, "tp_size", 1) or 1) > 1:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group().cpu_group
    r = layer._glyd_pending.build(group)
    _remove_part_params(layer)
    del layer._glyd_pending
    _install(layer, r, device)


class GlydLinearMethod(LinearMethodBase):
    """Linear layers: resident weight, decoded for each matmul. Layers too small to pack stay plain."""

    def __init__(self, config: GlydConfig, prefix: str) -> None:
        self.config, self.prefix = config, prefix
        self.plain: UnquantizedLinearMethod | None = None

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        # glyd pack decided by the whole tensor's size; a rank holds a split of it
        splits = _partition_splits(layer, list(output_partition_sizes))
        cols = _column_split(layer, input_size_per_partition)
        packed = [s.full * cols.full >= self.config.min_packed_values for s in splits]
        if not any(packed):  # glyd pack left this weight plain
            self.plain = UnquantizedLinearMethod()
            self.plain.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                      output_size, params_dtype, **extra_weight_attrs)
            return
        if not all(packed):
            raise UnsupportedModelError(f"{self.prefix}: some shards of this fused layer are below "
                                        f"{self.config.min_packed_values} values and were stored plain; Glyd "
                                        "serves fused layers whose shards are all packed")
        _add_part_params(layer, _Pending(self.prefix, splits, cols))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.plain is not None:
            self.plain.process_weights_after_loading(layer)
            return
        _finish(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.plain is not None:
            return self.plain.apply(layer, x, bias)
        return _apply(layer, x, bias)


class GlydEmbeddingMethod(QuantizeMethodBase):
    """Embeddings and the lm_head: lookups decode only their rows; the head decodes the whole weight."""

    def __init__(self, config: GlydConfig, prefix: str) -> None:
        self.config, self.prefix = config, prefix
        self.plain: UnquantizedEmbeddingMethod | None = None
        self.tied: list[torch.nn.Module] = []  # a list, so the tied module is not registered as a child

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        vocab = int(getattr(layer, "org_vocab_size", sum(output_partition_sizes)))  # the checkpoint's rows
        if vocab * input_size_per_partition < self.config.min_packed_values:
            self.plain = UnquantizedEmbeddingMethod()
            self.plain.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                      output_size, params_dtype, **extra_weight_attrs)
            return
        # The checkpoint holds the unpadded vocabulary; vLLM pads the partition to a multiple of 64 rows, and under
        # tensor parallelism a rank holds its range of the vocabulary's rows (vLLM's shard_indices).
        _add_part_params(layer, _Pending(self.prefix or "embedding", _partition_splits(layer, [vocab]),
                                         Split(input_size_per_partition, 0, input_size_per_partition)))

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        _remove_part_params(layer)
        layer.__dict__.pop("_glyd_pending", None)
        source = embed_tokens.quant_method
        if isinstance(source, GlydEmbeddingMethod) and source.plain is None:
            self.tied = [embed_tokens]
        else:  # the embedding stayed plain: tie as vLLM does
            self.plain = UnquantizedEmbeddingMethod()
            layer.weight = embed_tokens.weight
        return layer

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.plain is not None:
            self.plain.process_weights_after_loading(layer)
        elif not self.tied:
            _finish(layer)

    def _source(self, layer: torch.nn.Module) -> torch.nn.Module:
        return self.tied[0] if self.tied else layer

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            return self.plain.embedding(layer, input_)
        src = self._source(layer)
        rows, cols = src.glyd_shape
        if src.glyd_layout == "fragment":
            return fragment_embedding(input_, src.glyd_frag_data, src.glyd_frag_rowptr, src.glyd_frag_esc, src.glyd_lo,
                                      rows, cols)
        return resident_embedding(input_, src.glyd_sm, src.glyd_offs, src.glyd_esc_pos, src.glyd_esc_bits,
                                  src.glyd_base, rows, cols)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.plain is not None:
            return self.plain.apply(layer, x, bias)
        src = self._source(layer)
        out = _apply(src, x, bias)
        pad = int(layer.num_embeddings_per_partition) - src.glyd_shape[0]
        return torch.nn.functional.pad(out, (0, pad)) if pad > 0 else out  # vLLM's padded rows are zeros


@register_quantization_config(QUANT_METHOD)
class GlydConfig(QuantizationConfig):
    """A Glyd checkpoint (`glyd pack`): config.json's quantization_config has quant_method "glyd"."""

    def __init__(self, format_version: int = FORMAT_VERSION, min_packed_values: int = MIN_PACKED_VALUES) -> None:
        super().__init__()
        if format_version != FORMAT_VERSION:
            raise CorruptFileError(f"this checkpoint is Glyd format version {format_version}; this Glyd serves "
                                   f"version {FORMAT_VERSION}: re-pack it with `glyd pack` or install the "
                                   "matching Glyd")
        self.min_packed_values = int(min_packed_values)

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # plain torch decode: any device vLLM runs on

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the quantization config lives in config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GlydConfig:
        return cls(int(config.get("format_version", -1)), int(config.get("min_packed_values", MIN_PACKED_VALUES)))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return GlydLinearMethod(self, prefix)
        if isinstance(layer, VocabParallelEmbedding):
            return GlydEmbeddingMethod(self, prefix)
        return None


def worker_weight_bytes(worker: Any) -> dict[str, int]:
    """For `llm.collective_rpc(worker_weight_bytes)`: the resident weight bytes of a worker's model."""
    return model_weight_bytes(worker.get_model())


def model_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the weights Glyd holds compressed, what they would take in bf16, and how many tensors it holds in
    the fragment layout (for reports)."""
    held_bytes = values = escapes = tensors = fragment = 0
    for m in model.modules():
        if hasattr(m, "glyd_shape"):
            held_bytes += int(m.glyd_bytes)
            values += int(m.glyd_values)
            escapes += int(m.glyd_escapes)
            tensors += 1
            fragment += m.glyd_layout == "fragment"
    return {"glyd_weight_bytes": held_bytes, "glyd_weight_values": values, "glyd_weight_escapes": escapes,
            "glyd_weight_tensors": tensors, "glyd_fragment_tensors": fragment, "bf16_weight_bytes": 2 * values}


def refusals(vllm_config: Any) -> list[str]:
    """Why this engine cannot serve Glyd weights (empty: it can, or it does not ask for them)."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or getattr(model, "quantization", None) != QUANT_METHOD:
        return []
    why = []
    hf_quant = getattr(model.hf_config, "quantization_config", None) or {}
    if not isinstance(hf_quant, dict) or hf_quant.get("quant_method") != QUANT_METHOD:
        why.append(f"{model.model} is not a Glyd checkpoint (its config.json has no quantization_config with "
                   f"quant_method \"glyd\"): pack it first with `glyd pack {model.model} DST` and serve DST")
    if getattr(model, "dtype", torch.bfloat16) != torch.bfloat16:
        why.append(f"the model would run in {model.dtype}; Glyd weights are bf16 (use --dtype bfloat16)")
    return why


def check(vllm_config: Any) -> None:
    why = refusals(vllm_config)
    if why:
        raise RefusedError("Glyd weights (--quantization glyd) cannot be served: " + "; ".join(why),
                           "change that, or serve the bf16 model without --quantization glyd")
