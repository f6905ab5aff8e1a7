"""First-start progress: which step, its phase, a bar with ETA, and a way out (hide or cancel).

A start is up to four jobs in a row (engine install, model build or download, KV table build, engine
load); each resets the bar. Hiding keeps the start going while the user reads old chats; the stats
bar keeps showing the percentage.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.clock import Clock
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar

from glyd_engine.engine.protocol import Progress

JOB_TITLES = {
    "engine-install": "Installing the engine",
    "demo-model": "Preparing the demo model (first start only)",
    "download": "Downloading the model",
    "kv-tables": "Building KV tables (first start of this model only)",
    "engine": "Loading the model into vLLM",
}
JOB_ORDER = ["engine-install", "demo-model", "download", "kv-tables", "engine"]


def describe(progress: Progress, elapsed: float = 0.0) -> tuple[str, str]:
    """(step title, detail line) for an event, its ETA counted down by the `elapsed` seconds since it came."""
    title = JOB_TITLES.get(progress.job, progress.job)
    detail = progress.phase[:1].upper() + progress.phase[1:] if progress.phase else ""
    if progress.eta_s is not None and progress.total:
        minutes, seconds = divmod(int(max(0.0, progress.eta_s - elapsed) + 0.5), 60)
        detail += f" · about {minutes} min {seconds:02d} s left" if minutes else f" · about {seconds} s left"
    return title, detail


class StartScreen(ModalScreen[str]):
    """Dismissed with "hide" or "cancel" by the user, or "done" by the app when the engine is ready."""

    BINDINGS = [
        Binding("escape", "hide", "Hide", id="glyd.start_hide"),
        Binding("ctrl+x", "cancel_start", "Cancel start", id="glyd.start_cancel"),
    ]

    DEFAULT_CSS = """
    StartScreen { align: center middle; }
    StartScreen > Vertical {
        width: 76; height: auto; padding: 1 2; border: thick $primary; background: $surface;
    }
    StartScreen #start-title { text-style: bold; width: 100%; }
    StartScreen #start-step { color: $accent; margin-top: 1; width: 100%; }
    StartScreen #start-detail { color: $text-muted; width: 100%; height: 2; }
    StartScreen ProgressBar { margin: 1 0; width: 100%; }
    StartScreen ProgressBar Bar { width: 1fr; }
    StartScreen #start-hint { color: $text-muted; width: 100%; }
    StartScreen Horizontal { height: auto; align-horizontal: right; margin-top: 1; }
    StartScreen Button { margin-left: 2; }
    """

    def __init__(self, model_name: str, clock: Clock | None = None) -> None:
        super().__init__()
        self.model_name = model_name
        self.clock = clock  # tests pass a MockClock so the bar's own ETA is deterministic
        self.job: str | None = None
        self.last: Progress | None = None
        self.last_at = 0.0  # when `last` came (self.now()): its ETA counts down from there between events

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Starting {self.model_name}", id="start-title")
            yield Label("Starting the engine process…", id="start-step")
            yield Label("", id="start-detail")
            # one ETA, the engine's (smoothed, in the detail line): the bar's own would disagree with it
            yield ProgressBar(total=None, show_eta=False, id="start-bar", clock=self.clock)
            yield Label("The chat stays usable: Esc hides this, Ctrl+X cancels the start.", id="start-hint")
            with Horizontal():
                yield Button("Hide", id="hide", variant="default")
                yield Button("Cancel start", id="cancel", variant="error")

    def on_mount(self) -> None:
        if self.last is not None:
            self.show(self.last)
        self.set_interval(1.0, self._count_down)

    def now(self) -> float:
        return self.clock.time if self.clock is not None else time.monotonic()

    def _count_down(self) -> None:
        """The engine's ETA comes with each step of work (a table build's run: seconds apart); between two,
        it counts down here rather than standing still and then jumping."""
        details = self.query("#start-detail").results(Label)
        if self.last is not None and self.last.eta_s is not None:
            for label in details:
                label.update(describe(self.last, self.now() - self.last_at)[1])

    def show(self, progress: Progress) -> None:
        """Draw one (coalesced) progress event; a new job resets the bar and its ETA."""
        self.last, self.last_at = progress, self.now()
        if not self.is_mounted or not self.query(ProgressBar):
            return  # drawn by on_mount, once the widgets are there
        title, detail = describe(progress)
        bar = self.query_one(ProgressBar)
        if progress.job != self.job:
            self.job = progress.job
            bar.update(total=progress.total, progress=0)
            self.query_one("#start-step", Label).update(title)
        if progress.total:
            bar.update(total=progress.total, progress=min(progress.done, progress.total))
        else:
            bar.update(total=None)
        self.query_one("#start-detail", Label).update(detail)

    def action_hide(self) -> None:
        self.dismiss("hide")

    def action_cancel_start(self) -> None:
        self.dismiss("cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss("hide" if event.button.id == "hide" else "cancel")
