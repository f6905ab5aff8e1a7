"""The KV cache mode (auto, lossless, exact, off), chosen in the app: what each costs here, then a restart.

The choice is kept in config.toml (`[engine] kv`), so the next start uses it too; the engine restarts at
once with it. The costs are the measured ones (docs/benchmarks.md): on the CPU, Glyd's pages hold ~1.4x
the tokens but decode in plain torch, so replies are much slower, and a model's first start with them
builds its KV tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from glyd_engine.kv_mode import DEFAULT, PAGE_MODES, KVMode
from glyd_engine.kv_mode import MODES as KV_MODES

COSTS: dict[KVMode, str] = {
    "auto": "Glyd's pages where they are measured as fast as vLLM's own cache, else vLLM's own cache. Today that "
            "is vLLM's own everywhere: no table build, full speed.",
    "lossless": "Glyd's pages: ~1.42x the tokens in the same memory, every value exact. The first start of each "
                "model builds its KV tables (1.5 to 5 min for the demo model on 2 shared CPU cores). On a CPU, "
                "replies are about 11x slower than with vLLM's own cache (decode at batch 8: 13.2 vs 145.1 tok/s).",
    "exact": "The same pages, and attention runs on the decoded values with vLLM's own kernel, so replies equal "
             "vLLM's own cache's bit for bit. On a CPU it costs what lossless costs (the same code runs); not on "
             "CUDA.",
    "off": "vLLM's own bf16 cache; the Glyd plugin does nothing for the KV cache.",
}
PAGE_GAIN = 1.42  # Glyd's pages hold this many times vLLM's bf16 tokens in the same memory (3-bit code)
CPU_DECODE = (13.2, 145.1)  # tok/s at batch 8, Glyd lossless vs vLLM's own cache (docs/benchmarks.md)
DEMO_BUILD = "1.5 to 5 min for the demo model on 2 shared CPU cores, longer for larger models"


@dataclass(frozen=True)
class Here:
    """What a switch costs depends on: this engine and the KV tables this machine holds."""

    device: str  # "cpu" | "cuda"
    running: str  # the cache in force: "off" (vLLM's own) | "lossless" | "exact"
    capacity: int  # tokens the cache holds now (0: unknown)
    load_s: float | None  # the last load of this model
    tables_s: float | None  # this model's KV tables' build time (None: not built here)
    last_build_s: float | None  # the newest table build here, any model


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def switch_cost(mode: str, here: Here) -> str:
    """What switching to `mode` costs on this machine, in lines that fit an 80-column terminal's dialog."""
    pages = mode in PAGE_MODES  # auto keeps vLLM's own cache wherever Glyd's pages are not measured faster
    restart = "The engine restarts" + (f" (its last load took {_minutes(here.load_s)})." if here.load_s else ".")
    lines = [restart]
    if pages:
        if here.tables_s is not None:
            lines.append(f"Build: none, this model's KV tables are built (took {_minutes(here.tables_s)}).")
        elif here.last_build_s is not None:
            lines.append("Build, once: this model's KV tables, before it loads; the last build here took "
                         f"{_minutes(here.last_build_s)} (longer for a larger model).")
        else:
            lines.append(f"Build, once: this model's KV tables, before it loads ({DEMO_BUILD}).")
        if here.device == "cpu":
            glyd, own = CPU_DECODE
            lines.append(f"Speed: replies about {own / glyd:.0f}x slower on this CPU than with vLLM's own cache "
                         f"(decode at batch 8: {glyd} vs {own} tok/s).")
        else:
            lines.append("Speed: Glyd's CUDA kernels read the compressed pages (measured faster than vLLM's "
                         "Triton kernel on an H200; not yet run inside vLLM on a GPU).")
        if here.capacity and here.running == "off":
            lines.append(f"Room: about {round(here.capacity * PAGE_GAIN):,} tokens instead of "
                         f"{here.capacity:,} in the same memory, every value exact.")
    else:
        lines.append("Build: none. Speed: vLLM's own cache, full speed.")
        if here.capacity and here.running in PAGE_MODES:
            lines.append(f"Room: about {round(here.capacity / PAGE_GAIN):,} tokens instead of {here.capacity:,}.")
    return "\n".join(lines)


# (mode, label, cost) in glyd_engine.kv_mode's order
MODES: list[tuple[str, str, str]] = [(m, f"{m} (default)" if m == DEFAULT else m, COSTS[m]) for m in KV_MODES]


class KVModeScreen(ModalScreen[str | None]):
    """Dismissed with the mode picked (the app saves it and restarts the engine), or None."""

    BINDINGS = [Binding("escape", "dismiss_none", "Cancel")]
    DEFAULT_CSS = """
    KVModeScreen { align: center middle; }
    KVModeScreen > Vertical { width: 100%; max-width: 96; height: auto; max-height: 100%; padding: 1 2;
                              border: thick $primary; background: $surface; }
    KVModeScreen .title { text-style: bold; width: 100%; }
    KVModeScreen OptionList { height: auto; max-height: 1fr; margin: 1 0; }
    KVModeScreen #kv-now { color: $text-muted; width: 100%; }
    """

    def __init__(self, current: str, in_force: str = "") -> None:
        super().__init__()
        self.current, self.in_force = current, in_force

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("KV cache mode (Enter picks it; the engine restarts)", classes="title")
            yield Label(self.in_force, id="kv-now")
            options = [Option(f"{'●' if mode == self.current else '○'} {label}\n   {cost}", id=mode)
                       for mode, label, cost in MODES]
            yield OptionList(*options, id="kv-modes")

    def on_mount(self) -> None:
        modes = self.query_one(OptionList)
        modes.highlighted = next(i for i, (mode, _, _) in enumerate(MODES) if mode == self.current)
        modes.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
