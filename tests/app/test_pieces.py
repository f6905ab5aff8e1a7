"""Small pure pieces of the app: code-block extraction, settings validation, progress text, numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from glyd_app.screens.settings import parse_settings
from glyd_app.screens.start import describe
from glyd_app.widgets.messages import code_blocks
from glyd_app.widgets.stats_bar import gib, memory_line, mode_line, ratio, stats_line
from glyd_engine.engine.protocol import Progress, Ready, Stats


def test_code_blocks_in_order_including_an_unclosed_last_one() -> None:
    text = "a\n```python\nx = 1\n```\nb\n~~~\nls -l\n~~~\n```sh\necho hi"
    assert code_blocks(text) == ["x = 1", "ls -l", "echo hi"]
    assert code_blocks("no code") == []


def test_settings_are_validated_with_the_field_named() -> None:
    s = parse_settings("  be brief ", "0.3", "0.9", "128")
    assert (s.system_prompt, s.temperature, s.top_p, s.max_tokens) == ("be brief", 0.3, 0.9, 128)
    for args, field in [
        (("", "3", "0.9", "10"), "temperature"),
        (("", "1", "0", "10"), "top-p"),
        (("", "1", "1", "0"), "max tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            parse_settings(*args)
    with pytest.raises(ValueError):
        parse_settings("", "warm", "1", "1")
    # empty: the model's own temperature and top-p, a fresh seed every reply
    s = parse_settings("", "", " ", "64", "")
    assert (s.temperature, s.top_p, s.seed) == (None, None, None)
    assert parse_settings("", "", "", "64", "42").seed == 42
    with pytest.raises(ValueError, match="seed"):
        parse_settings("", "", "", "64", "forty")


def test_progress_text_has_step_phase_and_eta() -> None:
    title, detail = describe(Progress("kv-tables", "calibrating over a 4,096-token window", 3, 48, 125.0))
    assert title.startswith("Building KV tables")
    assert detail == "Calibrating over a 4,096-token window · about 2 min 05 s left"
    assert describe(Progress("engine", "Loading the weights", 1, None, None))[1] == "Loading the weights"


def test_numbers_in_the_stats_bar() -> None:
    assert gib(3 << 30) == "3.00 GiB" and gib(50 << 20) == "50 MiB" and gib(50 << 20, 2 << 30) == "0.05 GiB"
    assert ratio(100, 140) == "1.40x less" and ratio(100, 100) == "same"
    line = stats_line(Stats("r", 10, 20, 500.0, 12.345, 0.25, 30, 100, 2, True), busy=True).plain
    assert "prompt 500 tok/s" in line and "gen 12.3 tok/s" in line and "TTFT 0.25 s" in line
    assert "2 older messages left out" in line and "generating" in line
    ready = Ready(
        weights_bytes=100 << 20,
        weights_bf16_bytes=140 << 20,
        kv_capacity_tokens=4096,
        kv_bytes_per_token=1024,
        kv_bf16_bytes_per_token=2048,
        dtype="bfloat16",
        weights_dtype="glyd",
        rss_bytes=900 << 20,
    )
    mem = memory_line(ready, 12).plain
    assert "weights 100 MiB Glyd (bf16 140: 1.40x less)" in mem and "KV 12/4,096 tok, 1.0 KiB/tok" in mem
    assert "RAM 900 MiB" in mem and len(mem) <= 100  # fits a 110-column terminal
    assert "RAM 1.50 GiB" in memory_line(ready, 12, rss=3 << 29).plain  # live, from the stats
    # an fp32 model runs as bf16: the figure is what the engine holds, labelled with both dtypes
    fp32 = Ready(weights_bytes=257 << 20, weights_bf16_bytes=257 << 20, dtype="bfloat16", weights_dtype="float32")
    assert "weights 257 MiB bf16 (from fp32 weights, rounded on load)" in memory_line(fp32, 0).plain
    # a long prompt: how far vLLM has read it, not the previous reply's numbers
    reading = stats_line(Stats("r", prompt_tokens=5000, prompt_done=1024), busy=True).plain
    assert reading == "reading the prompt 1,024/5,000 tok · Esc stops"
    # the mode line: one short reason, no mode named twice
    mode = mode_line(Ready(kv_mode="lossless", kv_reason="every value exact, 1.42x the tokens of bf16",
                           engine="vLLM 0.32.0 (CPU build, eager)")).plain
    assert mode == "KV mode Glyd lossless: every value exact, 1.42x the tokens of bf16 · vLLM 0.32.0 (CPU build, eager)"
    auto = Ready(kv_mode="off", engine="vLLM", kv_reason="the lossless cache is not measured as fast as vLLM's own on "
                 "cpu (set GLYD_KV=lossless to hold ~1.4x the tokens anyway)")
    assert mode_line(auto).plain.startswith("KV mode vLLM's own cache: the lossless cache is not measured as fast")
    assert len(mode_line(auto).plain) < 120


def test_a_kv_switch_says_what_it_costs_here(glyd_home: Path) -> None:
    """The build line follows the tables this machine holds (read from their file, no torch); the speed line
    the device; the room line the cache in force."""
    from safetensors.numpy import save_file

    from glyd_app.screens.kv_mode import Here, switch_cost
    from glyd_engine.models import model_fingerprint
    from glyd_engine.models.tables_here import last_build_seconds, model_tables_seconds, tables_file

    model = glyd_home / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    save_file({"w": np.zeros(4, np.float32)}, str(model / "model.safetensors"))
    assert model_tables_seconds(model) is None and last_build_seconds() is None
    cpu = Here("cpu", "off", 10_000, 9.6, None, None)
    text = switch_cost("lossless", cpu)
    assert "Build, once" in text and "1.5 to 5 min" in text and "11x slower on this CPU" in text
    assert "about 14,200 tokens instead of 10,000" in text and "last load took 10 s" in text
    assert all(len(line) < 200 for line in text.splitlines())

    path = tables_file(model_fingerprint(model))
    path.parent.mkdir(parents=True)
    save_file({"floor": np.zeros(1, np.uint8)}, str(path), metadata={"build_seconds": "165.0"})
    assert model_tables_seconds(model) == 165.0 and last_build_seconds() == 165.0
    built = switch_cost("exact", Here("cpu", "off", 0, None, model_tables_seconds(model), 165.0))
    assert "Build: none, this model's KV tables are built (took 2.8 min)" in built and "Room" not in built
    other = switch_cost("lossless", Here("cpu", "off", 0, None, None, 165.0))
    assert "the last build here took 2.8 min" in other
    back = switch_cost("off", Here("cuda", "lossless", 14_200, 30.0, None, None))
    assert "Build: none" in back and "full speed" in back and "about 10,000 tokens instead of 14,200" in back
    assert "CUDA kernels" in switch_cost("lossless", Here("cuda", "off", 0, None, None, None))
