"""The KV cache mode (auto, lossless, exact, off), chosen in the app: what each costs here, then a restart.

The choice is kept in config.toml (`[engine] kv`), so the next start uses it too; the engine restarts at
once with it. The costs are the measured ones (docs/benchmarks.md): on the CPU, Glyd's pages hold ~1.4x
the tokens but decode in plain torch, so replies are much slower, and a model's first start with them
builds its KV tables.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from glyd_engine.kv_mode import DEFAULT, KVMode
from glyd_engine.kv_mode import MODES as KV_MODES

COSTS: dict[KVMode, str] = {
    "auto": "Glyd's pages where they are measured as fast as vLLM's own cache, else vLLM's own cache. Today that "
            "is vLLM's own everywhere: no table build, full speed.",
    "lossless": "Glyd's pages: ~1.42x the tokens in the same memory, every value exact. The first start of each "
                "model builds its KV tables (1.5 to 5 min for the demo model on 2 shared CPU cores). On a CPU, "
                "replies are about 10x slower than with vLLM's own cache (decode at batch 8: 13.2 vs 145.1 tok/s).",
    "exact": "The same pages, and attention runs on the decoded values with vLLM's own kernel, so replies equal "
             "vLLM's own cache's bit for bit. On a CPU it costs what lossless costs (the same code runs); not on "
             "CUDA.",
    "off": "vLLM's own bf16 cache; the Glyd plugin does nothing for the KV cache.",
}
# (mode, label, cost) in glyd_engine.kv_mode's order
MODES: list[tuple[str, str, str]] = [(m, f"{m} (default)" if m == DEFAULT else m, COSTS[m]) for m in KV_MODES]


class KVModeScreen(ModalScreen[str | None]):
    """Dismissed with the mode picked (the app saves it and restarts the engine), or None."""

    BINDINGS = [Binding("escape", "dismiss_none", "Cancel")]
    DEFAULT_CSS = """
    KVModeScreen { align: center middle; }
    KVModeScreen > Vertical { width: 96; height: auto; padding: 1 2; border: thick $primary; background: $surface; }
    KVModeScreen .title { text-style: bold; }
    KVModeScreen OptionList { height: auto; margin: 1 0; }
    KVModeScreen #kv-now { color: $text-muted; }
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
