"""The plugin's decisions and hooks without an engine: settings, per-layer refusals, page size, serve."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from glyd_engine.vllm_plugin import settings


def _config(kv: str | None = None, **over: object) -> SimpleNamespace:
    par = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, prefill_context_parallel_size=1,
                          decode_context_parallel_size=1)
    hf = SimpleNamespace(sliding_window=None, layer_types=None)
    model = SimpleNamespace(dtype=torch.bfloat16, use_mla=False, is_hybrid=False, is_attention_free=False,
                            hf_text_config=hf, model="/no/model", get_num_layers=lambda pc: 2,
                            get_num_kv_heads=lambda pc: 3, get_head_size=lambda: 64)
    cfg = SimpleNamespace(parallel_config=par, speculative_config=None, kv_transfer_config=None,
                          cache_config=SimpleNamespace(cache_dtype="auto", kv_offloading_size=None),
                          model_config=model, additional_config={"glyd": {"kv": kv}} if kv else {})
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_modes_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLYD_KV", raising=False)
    assert settings.asked_mode(_config()) == "auto"
    monkeypatch.setenv("GLYD_KV", "Lossless")
    assert settings.asked_mode(_config()) == "lossless"
    assert settings.asked_mode(_config("off")) == "off"  # the engine's own setting wins
    monkeypatch.setenv("GLYD_KV", "bogus")
    with pytest.raises(ValueError, match="'bogus' is not a Glyd KV mode"):
        settings.asked_mode(_config())


def test_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLYD_KV", raising=False)
    assert settings.resolve(_config("lossless")).mode == "lossless"
    assert settings.resolve(_config("exact")).mode == "exact"
    assert settings.resolve(_config("off")) == settings.Decision("off", "off")
    auto = settings.resolve(_config())
    assert auto.mode == "off" and "not measured as fast" in auto.reason  # CPU: vLLM's own kernel is faster
    spec = _config("lossless", speculative_config=object())
    with pytest.raises(ValueError, match="speculative decoding"):
        settings.resolve(spec)
    spec.additional_config = {}
    assert "speculative" in settings.resolve(spec).reason


def test_kernel_choice_by_platform_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto picks torch on the CPU and the CUDA kernels on CUDA; what cannot run is refused with the fix."""
    from glyd_engine.vllm_plugin import hooks

    monkeypatch.delenv("GLYD_KV_KERNELS", raising=False)
    cfg = _config("lossless")
    assert settings.kernels(cfg) == "torch" and hooks.backend_path(settings.resolve(cfg)) == hooks.BACKEND_PATH
    monkeypatch.setattr(settings, "platform_name", lambda: "cuda")
    assert settings.kernels(cfg) == "cuda" and hooks.backend_path(settings.resolve(cfg)) == hooks.GPU_BACKEND_PATH
    assert settings.resolve(cfg).mode == "lossless"
    exact = settings.resolve(_config("exact"))  # on CUDA: vLLM's FlashAttention over decoded pages
    assert exact.mode == "exact" and hooks.backend_path(exact) == hooks.GPU_BACKEND_PATH
    monkeypatch.setenv("GLYD_KV_KERNELS", "reference")  # the CPU build's run of the GPU wiring has no FlashAttention
    with pytest.raises(ValueError, match="exact runs vLLM's own attention on decoded pages.*use lossless"):
        settings.resolve(_config("exact"))
    monkeypatch.setenv("GLYD_KV_KERNELS", "torch")
    with pytest.raises(ValueError, match="GLYD_KV_KERNELS=torch is the CPU build's path"):
        settings.resolve(cfg)
    auto = settings.resolve(_config())
    assert auto.mode == "off" and "GLYD_KV_KERNELS=torch" in auto.reason
    monkeypatch.setattr(settings, "platform_name", lambda: "rocm")
    monkeypatch.delenv("GLYD_KV_KERNELS")
    with pytest.raises(ValueError, match="not on rocm.*GLYD_KV=off"):
        settings.resolve(cfg)
    monkeypatch.setattr(settings, "platform_name", lambda: "cpu")
    monkeypatch.setenv("GLYD_KV_KERNELS", "cuda")
    with pytest.raises(ValueError, match="GLYD_KV_KERNELS=cuda needs an NVIDIA GPU"):
        settings.resolve(cfg)
    monkeypatch.setenv("GLYD_KV_KERNELS", "reference")  # the GPU backend's wiring on the torch reference
    decision = settings.resolve(cfg)
    assert decision.mode == "lossless" and hooks.backend_path(decision) == hooks.GPU_BACKEND_PATH
    monkeypatch.setenv("GLYD_KV_KERNELS", "triton")
    with pytest.raises(ValueError, match="'triton' is not a Glyd kernel choice"):
        settings.kernels(cfg)


@pytest.mark.parametrize(("change", "needle"), [
    (lambda c: setattr(c.parallel_config, "decode_context_parallel_size", 2), "decode context parallel"),
    (lambda c: setattr(c.parallel_config, "enable_dbo", True), "micro-batching"),
    (lambda c: setattr(c, "kv_transfer_config", object()), "KV transfer"),
    (lambda c: setattr(c.cache_config, "cache_dtype", "fp8"), "kv_cache_dtype is fp8"),
    (lambda c: setattr(c.cache_config, "kv_offloading_size", 4.0), "offloading"),
    (lambda c: setattr(c.model_config, "dtype", torch.float16), "torch.float16"),
    (lambda c: setattr(c.model_config, "use_mla", True), "MLA"),
    (lambda c: setattr(c.model_config, "is_hybrid", True), "hybrid"),
    (lambda c: setattr(c.model_config.hf_text_config, "sliding_window", 4096), "sliding-window"),
    (lambda c: setattr(c.model_config.hf_text_config, "layer_types", ["sliding_attention"]), "sliding-window"),
])
def test_each_unsupported_feature_is_named(change, needle: str) -> None:  # noqa: ANN001
    cfg = _config("lossless")
    change(cfg)
    with pytest.raises(ValueError, match="cannot run this engine") as err:
        settings.resolve(cfg)
    assert needle in str(err.value) and "GLYD_KV=off" in str(err.value)


def test_sliding_window_declared_but_unused_is_fine() -> None:
    cfg = _config("lossless")
    cfg.model_config.hf_text_config = SimpleNamespace(sliding_window=4096, use_sliding_window=False)
    assert settings.resolve(cfg).mode == "lossless"


def test_layer_refusals() -> None:
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from glyd_engine.vllm_plugin.hooks import layer_refusal

    ok = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None)
    assert layer_refusal(ok) is None
    assert "sinks" in layer_refusal(ok._replace(has_sink=True))
    assert "sliding" in layer_refusal(ok._replace(has_sliding_window=True))
    assert "MLA" in layer_refusal(ok._replace(use_mla=True))
    assert "fp8" in layer_refusal(ok._replace(kv_cache_dtype="fp8"))
    assert "head size 60" in layer_refusal(ok._replace(head_size=60))
    assert "float16" in layer_refusal(ok._replace(dtype=torch.float16))


def test_register_is_idempotent_and_hooks_exist() -> None:
    from vllm.platforms import current_platform

    import glyd_engine.vllm_plugin as plugin

    assert plugin.missing_hooks() == []
    plugin.register()
    wrapped = type(current_platform).get_attn_backend_cls
    plugin.register()
    from glyd_engine.vllm_plugin import hooks

    assert hooks.install(type(current_platform)) is False  # already wrapped: no double wrap
    assert type(current_platform).get_attn_backend_cls == wrapped


@pytest.fixture
def new_process(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The plugin as a fresh vLLM process finds it (nothing registered, no decision yet); the platform's hooks
    are put back afterwards."""
    import inspect

    from vllm.platforms import current_platform

    import glyd_engine.vllm_plugin as plugin
    from glyd_engine.vllm_plugin import hooks

    cls = type(current_platform)
    saved = {n: cls.__dict__.get(n) for n in ("get_attn_backend_cls", "check_and_update_config")}
    originals = {n: inspect.getattr_static(cls, n) for n in saved}
    for name, raw in originals.items():  # unwrap, as in a process where register() has not run
        while getattr(getattr(raw, "__func__", None), hooks.ORIGINAL, None) is not None:
            raw = getattr(raw.__func__, hooks.ORIGINAL)
        setattr(cls, name, raw)
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(settings, "_decided", None)
    monkeypatch.setattr(settings, "_missing_hooks", [])
    monkeypatch.delenv("GLYD_KV", raising=False)
    yield plugin
    for name, raw in saved.items():
        if raw is None:
            delattr(cls, name)
        else:
            setattr(cls, name, raw)


def test_a_missing_hook_refuses_lossless_from_additional_config(new_process: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The app and the bench ask through additional_config, which register() cannot see: the refusal comes
    where the config is made, and the status reports vLLM's own cache with the reason."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(new_process, "missing_hooks", lambda: ["AttentionBackend.customize_spec (test)"])
    from glyd_engine.vllm_plugin import hooks

    new_process.register()  # nothing asked through GLYD_KV: no refusal yet
    cls = type(current_platform)  # the config check is wrapped (it decides; test_refusals runs it in vLLM) ...
    assert getattr(cls.check_and_update_config, hooks._MARK, False)
    assert not getattr(cls.get_attn_backend_cls, hooks._MARK, False)  # ... the selector is not: no GLYD layers
    with pytest.raises(new_process.UnsupportedVLLMError, match="kv=lossless.*lacks AttentionBackend.customize_spec"
                                                               ".*GLYD_KV=off"):
        settings.decide(_config("lossless"))
    with pytest.raises(ValueError, match="kv=exact.*lacks AttentionBackend.customize_spec"):
        settings.decide(_config("exact"))
    auto = _config()
    decision = settings.decide(auto)
    assert decision.mode == "off" and "lacks AttentionBackend.customize_spec" in decision.reason
    status = new_process.kv_status(auto)
    assert status["mode"] == "off" and "lacks AttentionBackend.customize_spec" in status["reason"]


def test_a_missing_hook_with_glyd_kv_follows_the_precedence(new_process: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """GLYD_KV=lossless, and the engine's own setting says off: off wins (no refusal at plugin load); the same
    GLYD_KV with nothing else asked is refused."""
    monkeypatch.setattr(new_process, "missing_hooks", lambda: ["AttentionBackend.customize_spec (test)"])
    monkeypatch.setenv("GLYD_KV", "lossless")
    new_process.register()
    assert settings.decide(_config("off")).mode == "off"
    with pytest.raises(ValueError, match="kv=lossless.*lacks"):
        settings.decide(_config())


def test_a_missing_hook_and_no_config_check_refuses_glyd_kv_at_load(new_process: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(new_process, "missing_hooks", lambda: ["Platform.check_and_update_config"])
    monkeypatch.setattr(new_process, "_platform_cls", lambda: type("NoHooks", (), {}))
    monkeypatch.setenv("GLYD_KV", "lossless")
    with pytest.raises(new_process.UnsupportedVLLMError, match="GLYD_KV=lossless.*lacks Platform.check_and_update"):
        new_process.register()


def test_one_decision_a_process_and_the_status_reports_it(new_process: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The status reports the decision the engine was built with, even if the environment changed since."""
    monkeypatch.setenv("GLYD_KV", "off")
    cfg = _config()
    built = settings.decide(cfg)
    assert built.mode == "off"
    monkeypatch.setenv("GLYD_KV", "lossless")
    assert settings.decide(cfg) is built
    status = new_process.kv_status(cfg)
    assert status["mode"] == "off" and status["bytes_per_token"] == 2 * 2 * 3 * 64 * 2
    assert settings.decide(_config()).mode == "lossless"  # another engine's config: decided afresh


def test_page_size_does_not_depend_on_block_size() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from glyd_engine.tables.kv_tables import KVTables
    from glyd_engine.vllm_plugin import backend, state
    from glyd_engine.vllm_plugin.rank_share import RankShare

    tables = KVTables.uniform(2, 3, 64)
    state._current = state.RankTables(tables, RankShare.whole(2, 3))
    try:
        for bs in (1, 16, 128):
            spec = FullAttentionSpec(block_size=bs, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
            got = backend.GlydAttentionBackend.customize_spec(spec)
            assert got.state_content_size_bytes == tables.token_bytes(3) == 182  # a 44-entry reserve: 2912 B a tile
            assert got.page_size_bytes == bs * 3 * 182
            assert spec.page_size_bytes == bs * 3 * 256
    finally:
        state._current = None


def test_serve_binds_localhost_unless_told() -> None:
    from glyd_engine.commands.serve import vllm_command

    cmd, _ = vllm_command("/m", ["--port", "9000"], cpu=False)
    assert cmd[1:] == ["-m", "glyd_engine.vllm_cli", "serve", "/m", "--host", "127.0.0.1", "--port", "9000"]
    cmd, _ = vllm_command("/m", ["--", "--host=0.0.0.0"], cpu=False)
    assert "127.0.0.1" not in cmd and cmd[-1] == "--host=0.0.0.0"


def test_serve_asks_for_the_kv_mode_through_additional_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`glyd serve --kv` reaches vLLM the way the app and the benches do (additional_config), merged with the
    user's own --additional-config, where a glyd.kv the user wrote wins (as it wins over GLYD_KV)."""
    import json

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from glyd_engine.commands.serve import vllm_command

    def config(args: list[str]) -> dict[str, Any]:
        parser = FlexibleArgumentParser()  # vLLM's own parser: it merges the dotted form
        parser.add_argument("--additional-config", type=json.loads, default={})
        parser.add_argument("--host")
        parser.add_argument("--port")
        return parser.parse_args(args).additional_config

    cmd, _ = vllm_command("/m", ["--port", "9000"], cpu=False)
    assert not any("additional-config" in a for a in cmd)  # no --kv: GLYD_KV or auto, read by the plugin
    cmd, _ = vllm_command("/m", ["--port", "9000"], cpu=False, kv="lossless")
    assert cmd[5:] == ["--host", "127.0.0.1", "--additional-config.glyd.kv=lossless", "--port", "9000"]
    assert config(cmd[5:]) == {"glyd": {"kv": "lossless"}}
    dotted = ["--additional-config.glyd.check", "true"]
    cmd, _ = vllm_command("/m", dotted, cpu=False, kv="exact")
    assert config(cmd[5:]) == {"glyd": {"kv": "exact", "check": True}}
    for mine in (["--additional-config", '{"glyd": {"check": true}, "x": 1}'],
                 ['--additional-config={"glyd": {"check": true}, "x": 1}']):
        cmd, _ = vllm_command("/m", mine, cpu=False, kv="off")
        assert config(cmd[5:]) == {"glyd": {"check": True, "kv": "off"}, "x": 1}
    cmd, _ = vllm_command("/m", ["--additional-config", '{"glyd": {"kv": "off"}}'], cpu=False, kv="lossless")
    assert config(cmd[5:]) == {"glyd": {"kv": "off"}}


def test_serve_sizes_the_cpu_build_for_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU defaults (92% of the node's RAM, one core of two kept for its scheduler) do not fit a
    small machine: glyd serve sizes the KV cache from the free RAM and uses every core, unless told."""
    from glyd_engine import machine
    from glyd_engine.commands import serve

    monkeypatch.setattr(serve, "available_memory", lambda: 12 << 30)
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    env: dict[str, str] = {}
    cmd, notes = serve.vllm_command("/m", [], env, cpu=True)
    assert cmd[-2:] == ["--kv-cache-memory-bytes", str(1536 << 20)] and len(notes) == 2
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert serve.cpu_kv_cache_bytes(1 << 30) == 512 << 20 and serve.cpu_kv_cache_bytes(1 << 40) == 4096 << 20
    for given in (["--gpu-memory-utilization", "0.3"], ["--kv-cache-memory-bytes=1000000"]):
        cmd, _ = serve.vllm_command("/m", given, {}, cpu=True)
        assert cmd[-len(given):] == given and "--kv-cache-memory-bytes" not in cmd  # the user's size stands
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    serve.vllm_command("/m", [], env, cpu=True)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"  # the user's own setting stands
    cmd, notes = serve.vllm_command("/m", [], {}, cpu=False)
    assert "--kv-cache-memory-bytes" not in cmd and not notes  # CUDA: vLLM's own sizing
    monkeypatch.setattr(machine, "usable_cores", lambda: 16)
    env = {}
    assert machine.model_gets_every_core(env) is None and not env  # a large machine: vLLM's own binding


def test_bench_kv_parser() -> None:
    import argparse

    from glyd_engine.commands.bench_kv import add_kv_parser, run_kv

    parser = argparse.ArgumentParser()
    add_kv_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["kv", "--model", "/m", "--json", "--kv-bytes", "1000"])
    assert args.func is run_kv and args.model == "/m" and args.json and args.kv_bytes == 1000


def test_weight_layout_by_setting_shape_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from glyd_engine.errors import SettingError
    from glyd_engine.vllm_plugin.weights import weight_layout

    cpu = torch.device("cpu")
    monkeypatch.delenv(settings.ENV_WEIGHT_LAYOUT, raising=False)
    assert weight_layout(cpu, (576, 576)) == "resident"  # auto: the fragment layout is for the CUDA matmul
    monkeypatch.setenv(settings.ENV_WEIGHT_LAYOUT, "fragment")
    assert weight_layout(cpu, (576, 576)) == "fragment"
    assert weight_layout(cpu, (576, 100)) == "resident"  # a shape the layout cannot hold keeps the resident code
    monkeypatch.setenv(settings.ENV_WEIGHT_LAYOUT, "tiles")
    with pytest.raises(SettingError, match="GLYD_WEIGHT_LAYOUT='tiles'.*auto, resident, fragment"):
        weight_layout(cpu, (576, 576))


class _RecordingLayer:
    """Records the builder's reservations (the CUDA layer's are tested with the kernels on a GPU:
    tests/kernels/test_kv_cuda.py)."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.reserved = 0
        self.codec = None

    def reserve(self, tokens: int) -> None:
        self.calls.append(tokens)
        self.reserved = tokens


def _step(query_lens: list[int], max_seq_len: int) -> SimpleNamespace:
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    n, t = len(query_lens), int(qsl[-1])
    lens = torch.full((n,), max_seq_len, dtype=torch.int32)
    return SimpleNamespace(max_query_len=max(query_lens), num_reqs=n, num_actual_tokens=t, query_start_loc_cpu=qsl,
                           query_start_loc=qsl, seq_lens=lens, seq_lens_cpu=lens, max_seq_len=max_seq_len,
                           block_table_tensor=torch.zeros(n, 4, dtype=torch.int32), slot_mapping=torch.arange(t))


def test_gpu_builder_graph_support_and_step_reservations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU backend's builder: full CUDA graphs for decode steps with the CUDA kernels, none where host code runs
    each step (check mode, the reference kernels). Before each step of up to vLLM's largest capture size it reserves
    each layer's overflow room for the write and counts the values written (a replay runs no host code); a decode
    step that a full graph may replay sizes its context split for the model's longest context."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from glyd_engine.vllm_plugin import gpu_backend, state

    builder_cls = gpu_backend.GlydGPUMetadataBuilder
    spec = SimpleNamespace(num_kv_heads=3, head_size=64)
    for section, want in (({"kernels": "cuda"}, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
                          ({"kernels": "cuda", "check": True}, AttentionCGSupport.NEVER),
                          ({"kernels": "reference"}, AttentionCGSupport.NEVER)):
        assert builder_cls.get_cudagraph_support(_config(additional_config={"glyd": section}), spec) == want
    with monkeypatch.context() as m:  # exact decodes each step's pages for FlashAttention: host code every step
        m.setattr(settings, "platform_name", lambda: "cuda")
        exact = _config(additional_config={"glyd": {"kv": "exact"}})
        assert builder_cls.get_cudagraph_support(exact, spec) == AttentionCGSupport.NEVER

    layers = {f"model.layers.{i}.self_attn.attn": _RecordingLayer() for i in range(2)}
    stats = {name: SimpleNamespace(values=0) for name in layers}
    monkeypatch.setattr(state, "LAYERS", {name: SimpleNamespace(extra={"kernels": kv}, codec=SimpleNamespace(
        stats=stats[name])) for name, kv in layers.items()})

    def builder(mode: CUDAGraphMode) -> gpu_backend.GlydGPUMetadataBuilder:
        cfg = _config(compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=8))
        cfg.model_config.max_model_len = 4096
        return builder_cls(spec, [*layers, "model.layers.2.self_attn.attn"], cfg, torch.device("cpu"))

    full = builder(CUDAGraphMode.FULL_AND_PIECEWISE)
    md = full.build(0, _step([1, 1, 1, 1], 100))  # a decode step a full graph may replay
    assert md.num_decodes == 4 and md.split_len == 4096
    assert all(kv.calls == [4] for kv in layers.values())
    assert all(s.values == 2 * 3 * 64 * 4 for s in stats.values())
    md = full.build(0, _step([1, 1, 5], 100))  # mixed: attention from Python, the write still reserved
    assert md.num_decodes == 2 and md.split_len == 100 and md.seq_lens_cpu == [100] * 3
    assert all(kv.calls[-1] == 7 for kv in layers.values())
    md = full.build(0, _step([1] * 9, 100))  # past the largest capture size: the write checks for itself
    assert md.split_len == 100 and all(kv.calls[-1] == 0 for kv in layers.values())
    md = builder(CUDAGraphMode.NONE).build(0, _step([1, 1], 100))  # no graphs at all
    assert md.split_len == 100 and all(kv.calls[-1] == 0 for kv in layers.values())


def test_weights_mode_from_either_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLYD_WEIGHTS or additional_config glyd.weights (which wins): lossless by default, exact on request, and a typo
    refused naming where it came from and what it accepts."""
    monkeypatch.delenv("GLYD_WEIGHTS", raising=False)
    assert settings.weights_mode(_config()) == "lossless"
    monkeypatch.setenv("GLYD_WEIGHTS", "exact")
    assert settings.weights_mode(_config()) == "exact"
    assert settings.weights_mode(_config(additional_config={"glyd": {"weights": "lossless"}})) == "lossless"
    with pytest.raises(ValueError, match=r"glyd.weights='fast' is not a Glyd weights mode; use one of auto, lossless"):
        settings.weights_mode(_config(additional_config={"glyd": {"weights": "fast"}}))


def test_a_ranks_kv_heads_follow_vllms_split() -> None:
    """Consecutive heads a rank; fewer KV heads than ranks: each head on tp / heads consecutive ranks (vLLM's
    QKVParallelLinear), so a rank's table slice is its heads' own."""
    from glyd_engine.vllm_plugin.rank_share import kv_heads_of_rank

    assert [kv_heads_of_rank(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(ValueError, match="3 KV heads cannot be split evenly over 2 ranks"):
        kv_heads_of_rank(3, 2, 0)


@pytest.fixture
def no_channel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No refusal channel named, and none left behind: the process's environment and its workers' folder restored."""
    from glyd_engine.vllm_plugin import refusals

    monkeypatch.setenv(refusals.CHANNEL_ENV, "")  # recorded, so that the test's channel is unset afterwards
    monkeypatch.delenv(refusals.CHANNEL_ENV)
    before = refusals._worker_channel[0]
    refusals._worker_channel[0] = None
    yield
    refusals._worker_channel[0] = before


def _engine_config(executor: str = "uni", cls: object = None, dp_index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(scheduler_config=SimpleNamespace(scheduler_cls=cls),
                           parallel_config=SimpleNamespace(distributed_executor_backend=executor, nnodes=1,
                                                           data_parallel_index=dp_index, data_parallel_rank=0))


def test_the_refusing_scheduler_goes_wherever_a_shared_folder_reaches_the_workers(no_channel: None) -> None:
    pytest.importorskip("vllm")
    from glyd_engine.vllm_plugin import refusals, scheduler

    names = []
    for executor in ("uni", "mp"):  # a worker of its own process reports through the channel it inherits
        c = _engine_config(executor)
        assert scheduler.install(c) is None and c.scheduler_config.scheduler_cls == scheduler.QUALNAME
        names.append(os.environ[refusals.CHANNEL_ENV])
        assert not Path(names[-1]).exists()  # made when a scheduler listens
        assert scheduler.install(c) is None and os.environ[refusals.CHANNEL_ENV] == names[-1]  # a copy keeps it
    assert names[0] != names[1]  # each engine's config its own
    theirs = _engine_config("uni", "my.Scheduler")
    assert "its own scheduler" in scheduler.install(theirs) and theirs.scheduler_config.scheduler_cls == "my.Scheduler"
    assert refusals.CHANNEL_ENV not in os.environ  # nobody would read a report: the write raises
    assert "Ray" in scheduler.install(_engine_config("ray")) and refusals.CHANNEL_ENV not in os.environ


def _report_in_another_process(channel: str, layer_blocks: list[int], saw: Path) -> None:
    """A worker of its own process: a report, then the releases the scheduler wrote back, applied to a stand-in
    store whose releases are written down."""
    from glyd_engine.vllm_plugin import refusals, state

    os.environ[refusals.CHANNEL_ENV] = channel
    refusals.join(_engine_config())  # as its attention layers do when they are made
    refusals.report(torch.tensor(layer_blocks), 16, "a test", layer=3)
    assert refusals.unstored_blocks(3) == {b // 16 for b in layer_blocks}  # the check's record stays in the worker
    released: list[list[int]] = []
    layout = SimpleNamespace(block_size=16, tiles=2)
    store = SimpleNamespace(ptr=torch.full((16, 1, 2), -1), release=lambda tiles: released.append(tiles.tolist()))
    state.LAYERS["w"] = SimpleNamespace(codec=SimpleNamespace(layout=layout), overflow=store)
    deadline = time.monotonic() + 60
    while not released and time.monotonic() < deadline:
        state.apply_releases()
        time.sleep(0.01)
    state.apply_releases()  # a release is applied once
    saw.write_text(json.dumps(released))


def test_a_worker_in_another_process_reports_and_applies_the_releases(no_channel: None, tmp_path: Path) -> None:
    import multiprocessing

    from glyd_engine.format.kv_page import OverflowRoomError
    from glyd_engine.vllm_plugin import refusals

    with pytest.raises(OverflowRoomError, match="GLYD_KV_ARENA_MB"):  # no scheduler to refuse: the engine stops
        refusals.report(torch.tensor([33]), 16, "a test")
    name = refusals.name_channel()
    refusals.join(_engine_config())
    with pytest.raises(OverflowRoomError):  # named, nothing listens yet: only vLLM's null block is a start-up's
        refusals.report(torch.tensor([33]), 16, "a test")
    channel = refusals.listen(_engine_config())
    try:
        worker = multiprocessing.get_context("spawn").Process(target=_report_in_another_process,
                                                              args=(name, [33, 34, 70], tmp_path / "saw"))
        worker.start()
        deadline = time.monotonic() + 60
        got: dict = {}
        while not got and time.monotonic() < deadline:
            got = refusals.take(channel)
            time.sleep(0.01)
        assert got == {(2, 16): "a test", (4, 16): "a test"} and refusals.take(channel) == {}
        refusals.release(channel, {2, 4}, 16)
        worker.join(60)
        assert worker.exitcode == 0
        # blocks 2 and 4 of the scheduler's 16 tokens are tiles 4, 5 and 8, 9 of the pages' 16-token blocks
        assert json.loads((tmp_path / "saw").read_text()) == [[4, 5, 8, 9]]
    finally:
        refusals.stop(channel)
    assert not Path(name).exists()
    with pytest.raises(OverflowRoomError):  # its workers' writes raise from now on
        refusals.report(torch.tensor([33]), 16, "a test")
    refusals.release(channel, {2}, 16)  # after the shutdown: nothing to tell, no error


def test_the_warm_up_drops_what_finds_no_room_and_its_runs_go_back_at_the_first_step(
        no_channel: None, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM runs dummy steps (profile, graph capture) before it makes the scheduler, their slots padding; should one
    store values in its null block (0) and find no room, the engine's start must not stop (no request is given that
    block), and runs taken before serving must not count against the requests' arena: the worker's first step after
    the scheduler listens gives every one back. Other blocks raise before then; a report after that is a refusal;
    after the scheduler stops, the write raises."""
    from glyd_engine.format.kv_page import OverflowRoomError, OverflowStore
    from glyd_engine.vllm_plugin import refusals, state

    refusals.name_channel()
    refusals.join(_engine_config())
    store = OverflowStore(8, 2, initial_entries=64)
    store.reserve_entries(torch.tensor([0, 5]), torch.tensor([1, 0]), 1, torch.tensor([3, 20]))  # warm-up runs
    assert store.runs_in_use == 2
    layout = SimpleNamespace(block_size=16, tiles=1)
    state.LAYERS["warm"] = SimpleNamespace(codec=SimpleNamespace(layout=layout), overflow=store)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.glyd"):
            for _ in range(3):  # every layer of a dummy run, into vLLM's null block
                refusals.report(torch.tensor([0, 1]), 16, "a test")
        assert [r.getMessage().count("dummy tokens of vLLM's start-up") for r in caplog.records] == [1]
        with pytest.raises(OverflowRoomError):  # a block a request may hold: not a start-up's, nothing listens yet
            refusals.report(torch.tensor([1, 16]), 16, "a test")
        state.apply_releases()  # a dummy run's step: nothing listens yet, the runs stay
        assert store.runs_in_use == 2 and not refusals.serving_began()
        channel = refusals.listen(_engine_config())
        try:
            state.apply_releases()  # the first step that serves
            assert store.runs_in_use == 0 and sorted(store.free) == [8, 32]
            store.reserve_entries(torch.tensor([2]), torch.tensor([0]), 0, torch.tensor([3]))
            state.apply_releases()  # later steps give back only what the scheduler releases
            assert store.runs_in_use == 1
            refusals.report(torch.tensor([33]), 16, "a test")
            assert refusals.take(channel) == {(2, 16): "a test"}
        finally:
            refusals.stop(channel)
        with pytest.raises(OverflowRoomError):  # the scheduler has gone: nothing can refuse the write
            refusals.report(torch.tensor([33]), 16, "a test")
    finally:
        del state.LAYERS["warm"]


def test_the_check_forgets_a_block_written_again_from_its_first_token(no_channel: None) -> None:
    from glyd_engine.vllm_plugin import refusals

    refusals.name_channel()
    channel = refusals.listen(_engine_config())
    try:
        refusals.report(torch.tensor([33, 34, 70]), 16, "a test", layer=7)
        assert refusals.unstored_blocks(7) == {2, 4} and refusals.unstored_blocks(8) == set()
        refusals.restarted(7, torch.tensor([64, 65]), 16)  # block 4 rewritten from token 0
        assert refusals.unstored_blocks(7) == {2}
    finally:
        refusals.stop(channel)
    assert refusals.unstored_blocks(7) == set()


def test_a_steps_layers_reporting_the_same_blocks_log_one_line(no_channel: None,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Every attention layer's write of a refused step reports the same blocks: the log says so once a step, and
    again in a later step (the blocks may then hold another request)."""
    from glyd_engine.vllm_plugin import refusals

    refusals.name_channel()
    refusals.join(_engine_config())
    channel = refusals.listen(_engine_config())
    try:
        with caplog.at_level(logging.ERROR, logger="vllm.glyd"):
            for _ in range(30):  # the demo model's layers
                refusals.report(torch.tensor([33, 34]), 16, "a test")
            refusals.report(torch.tensor([70]), 16, "a test")
            assert [r.getMessage().count("found no room") for r in caplog.records] == [1, 1]
            assert refusals.take(channel) == {(2, 16): "a test", (4, 16): "a test"}
            refusals.releases()  # the worker's next step
            refusals.report(torch.tensor([33]), 16, "a test")
            assert len(caplog.records) == 3
    finally:
        refusals.stop(channel)


def test_engines_of_data_parallelism_keep_their_reports_apart(no_channel: None) -> None:
    """Every engine core of data parallelism inherits the one channel the config check named, and vLLM resets each
    one's data_parallel_rank to 0 where they run independently (dense models): a report of rank 1's workers must
    not refuse rank 0's requests (their block numbers mean other blocks)."""
    pytest.importorskip("vllm")
    from vllm.config import ParallelConfig

    from glyd_engine.vllm_plugin import refusals

    def engine(rank: int) -> SimpleNamespace:
        pc = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank)
        pc.data_parallel_index = rank  # as vLLM's engine core sets it, before the reset
        pc.reconfigure_for_independent_dp_rank()
        assert pc.data_parallel_rank == 0
        return SimpleNamespace(parallel_config=pc)

    refusals.name_channel()
    zero, one = refusals.listen(engine(0)), refusals.listen(engine(1))
    try:
        assert zero != one
        refusals.join(engine(1))  # a worker of rank 1
        refusals.report(torch.tensor([33]), 16, "rank 1's")
        assert refusals.take(zero) == {}
        assert refusals.take(one) == {(2, 16): "rank 1's"}
    finally:
        refusals.stop(zero)
        assert one.is_dir()  # rank 1 still runs
        refusals.stop(one)
    assert not one.parent.exists()


def test_an_api_client_reads_the_refusals_own_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front end's generate, wrapped where this process has one: a refused request's last output becomes vLLM's
    GenerationError carrying the refusal's message (the server's answer to the client); other outputs pass."""
    import asyncio
    import types

    pytest.importorskip("vllm")
    from vllm.exceptions import GenerationError

    from glyd_engine.vllm_plugin import refusals, server_errors

    def output(finish: str | None, reason: object = None) -> SimpleNamespace:
        return SimpleNamespace(outputs=[SimpleNamespace(finish_reason=finish, stop_reason=reason)])

    class AsyncLLM:  # the front end's shape: an async generator of a request's outputs
        def __init__(self, outs: list[SimpleNamespace]) -> None:
            self.outs = outs

        async def generate(self, *args: Any, **kwargs: Any) -> Any:
            for o in self.outs:
                yield o

    module = types.ModuleType("vllm.v1.engine.async_llm")
    module.AsyncLLM = AsyncLLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", module)
    assert server_errors.install() and server_errors.install()  # once: a second call wraps nothing more

    async def run(outs: list[SimpleNamespace]) -> list[SimpleNamespace]:
        return [o async for o in AsyncLLM(outs).generate("prompt")]

    plain = [output(None), output("length")]
    assert asyncio.run(run(plain)) == plain
    assert asyncio.run(run([output(None), output("error", "other")]))[-1].outputs[0].stop_reason == "other"
    why = refusals.message("a layer's arena is limited to 0.0 MB")
    with pytest.raises(GenerationError, match="GLYD_KV_ARENA_MB"):
        asyncio.run(run([output(None), output("error", why)]))


def test_the_process_that_named_a_channel_takes_it_when_it_exits() -> None:
    """A server stopped by a signal never runs its scheduler's shutdown: the folder goes when the process that named
    it (the server's, or glyd-chat's engine) exits."""
    import subprocess

    from glyd_engine.vllm_plugin import refusals

    code = ("import os, sys; from types import SimpleNamespace as N; from glyd_engine.vllm_plugin import refusals as r;"
            "os.environ.pop(r.CHANNEL_ENV, None); name = r.name_channel();"
            "c = r.listen(N(parallel_config=N(data_parallel_index=0))); print(name); assert c.is_dir()")
    env = {k: v for k, v in os.environ.items() if k != refusals.CHANNEL_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    name = out.stdout.strip().splitlines()[-1]
    assert name.startswith(str(Path(tempfile.gettempdir()) / "glyd-refusals-")) and not Path(name).exists()


def test_the_run_pointer_reserve_follows_the_engines_kv_budget(caplog: pytest.LogCaptureFixture) -> None:
    """What a GPU layer takes for its run pointers before vLLM's memory profile: the pointers of every block the
    budget can buy at this many layers; where the budget cannot be known, nothing (the table comes with the cache)."""
    pytest.importorskip("vllm")
    from glyd_engine.vllm_plugin.gpu_backend import pointer_reserve
    from glyd_kernels import kv_overflow

    def config(budget: int | None, layers: int, sleep: bool = False) -> SimpleNamespace:
        def attention_layers(pc: object, kind: str) -> int:
            assert kind == "attention"
            return layers

        return SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=budget, gpu_memory_utilization=0.9),
                               model_config=SimpleNamespace(get_num_layers_by_block_type=attention_layers,
                                                            enable_sleep_mode=sleep), parallel_config=None)

    got = pointer_reserve(config(1 << 30, 30), 200, torch.device("cpu"))
    assert got is not None and got.dtype == torch.int32
    assert got.numel() == kv_overflow.pointer_entries_bound(1 << 30, 30, 200) == -(-(1 << 30) // (8 * 30 * 200))
    # a level-2 sleep frees what the model's load took without saving it: the pointers stay with the cache
    assert pointer_reserve(config(1 << 30, 30, sleep=True), 200, torch.device("cpu")) is None
    if not torch.cuda.is_available():  # the budget is a share of a GPU's memory that this machine lacks
        with caplog.at_level(logging.INFO, logger="vllm.glyd"):
            assert pointer_reserve(config(None, 30), 200, torch.device("cpu")) is None
        assert "run pointers taken with the cache" in caplog.text
