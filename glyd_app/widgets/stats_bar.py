"""The always-visible numbers: speed of the last reply, and the memory the engine holds against bf16.

Three lines under the chat: the reply (prompt and generation tokens a second, time to first token),
memory (weights, KV tokens held and in use, KV bytes a token), and the KV mode in force and why.
Before the engine is ready it shows the engine's state instead of zeros.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from glyd_engine.engine.protocol import Ready, Stats
from glyd_engine.kv_mode import PAGE_MODES, running_name

GIB = 1 << 30


def gib(n: float, scale: float | None = None) -> str:
    """GiB from 1 GiB up, MiB below; `scale` picks the unit (so a pair of sizes shares one)."""
    return f"{n / GIB:.2f} GiB" if (scale if scale is not None else n) >= GIB else f"{n / (1 << 20):.0f} MiB"


def ratio(small: float, big: float) -> str:
    if not small or not big:
        return ""
    return f"{big / small:.2f}x less" if big > small * 1.005 else "same"


def rate(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def stats_line(stats: Stats | None, busy: bool) -> Text:
    text = Text()
    if stats is not None and busy and stats.ttft_s is None and stats.prompt_tokens:
        # a long prompt takes many engine steps before the first token: say how far it is
        text.append("reading the prompt ", style="italic")
        text.append(f"{stats.prompt_done:,}/{stats.prompt_tokens:,} tok", style="bold")
        text.append(" · Esc stops", style="dim")
        return text
    if stats is None:
        text.append("prompt – tok/s · gen – tok/s · TTFT –", style="dim")
        if busy:
            text.append(" · reading the prompt…", style="italic")
        return text
    text.append("prompt ", style="dim")
    text.append(f"{rate(stats.prompt_tps)} tok/s", style="bold")
    text.append(" · gen ", style="dim")
    text.append(f"{rate(stats.gen_tps)} tok/s", style="bold")
    text.append(" · TTFT ", style="dim")
    text.append("–" if stats.ttft_s is None else f"{stats.ttft_s:.2f} s", style="bold")
    text.append(f" · {stats.prompt_tokens:,} in / {stats.generated_tokens:,} out", style="dim")
    if stats.trimmed_messages:
        text.append(f" · {stats.trimmed_messages} older messages left out to fit", style="yellow")
    if busy:
        text.append(" · generating…", style="italic")
    return text


DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def memory_line(ready: Ready, in_use: int, rss: int | None = None) -> Text:
    """Weights as the engine holds them, labelled with what they are; KV tokens; the engine's RAM."""
    text = Text()
    text.append("weights ", style="dim")
    scale = max(ready.weights_bytes, ready.weights_bf16_bytes)
    text.append(gib(ready.weights_bytes, scale), style="bold")
    run = DTYPES.get(ready.dtype, ready.dtype) or "bf16"
    if ready.weights_dtype == "glyd":
        saved = ratio(ready.weights_bytes, ready.weights_bf16_bytes)
        text.append(f" Glyd (bf16 {gib(ready.weights_bf16_bytes, scale).split()[0]}: {saved})", style="dim")
    elif ready.weights_dtype and ready.weights_dtype != ready.dtype:
        text.append(f" {run} (from {DTYPES.get(ready.weights_dtype, ready.weights_dtype)} weights, rounded on load)",
                    style="yellow")
    else:
        text.append(f" {run}", style="dim")
    text.append(" · KV ", style="dim")
    text.append(f"{in_use:,}/{ready.kv_capacity_tokens:,} tok", style="bold")
    if ready.kv_bytes_per_token:  # against bf16: in the KV mode line's reason, where Glyd's pages hold it
        text.append(", ", style="dim")
        text.append(f"{ready.kv_bytes_per_token / 1024:,.1f} KiB/tok", style="bold")
    rss = rss if rss is not None else ready.rss_bytes
    if rss:
        text.append(" · RAM ", style="dim")  # the engine process's resident memory (Help says so)
        text.append(gib(rss), style="bold")
    return text


def short_reason(reason: str) -> str:
    """The reason's first clause: the bar has one line for it (the KV mode screen, F5, has the whole)."""
    return reason.split(" (", 1)[0].split("; ", 1)[0]


def mode_line(ready: Ready) -> Text:
    text = Text("KV mode ", style="dim")
    text.append(running_name(ready.kv_mode), style="bold green" if ready.kv_mode in PAGE_MODES else "bold")
    if ready.kv_reason:
        text.append(f": {short_reason(ready.kv_reason)}", style="dim")
    text.append(f" · {ready.engine}", style="dim")
    return text


class StatsBar(Static):
    """Redraws from three reactives; the app sets them from engine events (coalesced upstream)."""

    DEFAULT_CSS = """
    StatsBar { height: 3; padding: 0 1; background: $panel; color: $text; }
    """

    ready: reactive[Ready | None] = reactive(None, always_update=True)
    stats: reactive[Stats | None] = reactive(None, always_update=True)
    state: reactive[str] = reactive("engine not started")
    busy: reactive[bool] = reactive(False)

    def render(self) -> Text:
        first = stats_line(self.stats, self.busy)
        if self.ready is None:
            lines = [Text.assemble(("engine: ", "dim"), (self.state, "bold")), Text("")]
        else:
            in_use = self.stats.kv_tokens_in_use if self.stats is not None else 0
            rss = self.stats.rss_bytes if self.stats is not None else None
            lines = [memory_line(self.ready, in_use, rss), mode_line(self.ready)]
        name = self.ready.name if self.ready is not None else ""
        head = Text.assemble((f"{name} · ", "bold cyan")) if name else Text()
        for line in lines:
            line.truncate(max(10, self.size.width), overflow="ellipsis")  # size: the content, padding excluded
        return Text("\n").join([head + first, *lines])
