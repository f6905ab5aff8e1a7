"""Small pure pieces of the app: code-block extraction, settings validation, progress text, numbers."""

from __future__ import annotations

import pytest

from glyd_app.screens.settings import parse_settings
from glyd_app.screens.start import describe
from glyd_app.widgets.messages import code_blocks
from glyd_app.widgets.stats_bar import gib, memory_line, ratio, stats_line
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
    )
    mem = memory_line(ready, 12).plain
    assert "weights 100 MiB (bf16 140 MiB: 1.40x less)" in mem and "KV 12/4,096 tok" in mem
    assert "1.0 KiB/tok (bf16 2.0: 2.00x less)" in mem
