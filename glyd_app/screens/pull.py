"""Downloading a model from the Hugging Face hub, from the model picker: first what it is, then the download.

The screen asks the hub (in a thread worker) for the model's files and config.json and shows its size, its
architecture and whether it fits this machine's memory; a model that cannot run or does not fit is refused
with why, and nothing is downloaded. Download shows a bar with the engine's ETA; Esc stops it, and what
arrived is kept, so the next download of the same id resumes. Returns the id to start, or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar, Static

if TYPE_CHECKING:
    from pathlib import Path

    from glyd_engine.models.pull import CancelToken, ProgressEvent, PullPlan

Planner = Callable[[str], "PullPlan"]


def default_planner(repo_id: str) -> PullPlan:
    from glyd_engine.models.pull import plan_pull

    return plan_pull(repo_id)


class PullScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "close", "Stop / close")]

    DEFAULT_CSS = """
    PullScreen { align: center middle; }
    PullScreen > Vertical { width: 90; height: auto; padding: 1 2; border: thick $primary; background: $surface; }
    PullScreen .title { text-style: bold; margin-bottom: 1; }
    PullScreen #plan { width: 100%; }
    PullScreen #plan.refused { color: $error; }
    PullScreen #notes { color: $text-muted; width: 100%; }
    PullScreen ProgressBar { margin-top: 1; display: none; }
    PullScreen ProgressBar.shown { display: block; }
    PullScreen #phase { color: $text-muted; width: 100%; display: none; }
    PullScreen #phase.shown { display: block; }
    PullScreen #notes.empty { display: none; }
    PullScreen Horizontal { height: auto; align-horizontal: right; margin-top: 1; }
    PullScreen Button { margin-left: 2; }
    """

    def __init__(self, repo_id: str, planner: Planner = default_planner) -> None:
        super().__init__()
        self.repo_id = repo_id
        self.planner = planner
        self.plan: PullPlan | None = None
        self.cancel: CancelToken | None = None
        self.error: str = ""

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Download {self.repo_id} from the Hugging Face hub", classes="title")
            yield Static("Looking it up: files, size, architecture…", id="plan", markup=False)
            yield Static("", id="notes", markup=False, classes="empty")
            yield ProgressBar(total=None, show_eta=False, id="bar")
            yield Static("", id="phase", markup=False)
            with Horizontal():
                yield Button("Close", id="close")
                yield Button("Download", id="download", variant="primary", disabled=True)

    def on_mount(self) -> None:
        self.look_up()

    @work(thread=True, exclusive=True, exit_on_error=False, group="pull", name="pull-plan",
          description="Asking the hub what the model is")
    def look_up(self) -> None:
        try:
            plan = self.planner(self.repo_id)
        except Exception as exc:  # GlydError (unknown id, offline) or anything the hub client raised
            self.app.call_from_thread(self.failed, str(exc))
            return
        self.app.call_from_thread(self.show_plan, plan)

    def show_plan(self, plan: PullPlan) -> None:
        self.plan = plan
        text = self.query_one("#plan", Static)
        why = plan.refusal or ("" if plan.fit.fits else f"it {plan.fit.describe()}")
        if why:
            text.update(f"{plan.summary()}\nNot downloaded: {why}.")
            text.add_class("refused")
        else:
            text.update(plan.summary())
            button = self.query_one("#download", Button)
            button.disabled = False
            button.focus()
        notes = self.query_one("#notes", Static)
        notes.update("\n".join(f"Note: {n}" for n in plan.notes))
        notes.set_class(not plan.notes, "empty")

    def failed(self, message: str) -> None:
        self.error = message
        text = self.query_one("#plan", Static)
        text.update(message)
        text.add_class("refused")
        self.query_one("#bar", ProgressBar).remove_class("shown")
        self.query_one("#download", Button).disabled = self.plan is None or bool(self.plan.refusal)
        self.query_one("#download", Button).label = "Resume"
        self.cancel = None

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "download":
            self.start_download()
        else:
            self.action_close()

    def start_download(self) -> None:
        from glyd_engine.models.pull import CancelToken

        if self.plan is None or self.cancel is not None:
            return
        self.cancel = CancelToken()
        self.query_one("#download", Button).disabled = True
        self.query_one("#bar", ProgressBar).add_class("shown")
        self.query_one("#phase", Static).add_class("shown")
        self.download(self.plan, self.cancel)

    @work(thread=True, exclusive=True, exit_on_error=False, group="pull", name="pull-download",
          description="Downloading a model")
    def download(self, plan: PullPlan, cancel: CancelToken) -> None:
        from glyd_engine.models.pull import Cancelled, pull

        def progress(event: ProgressEvent) -> None:
            self.app.call_from_thread(self.show_progress, event)

        try:
            path = pull(plan, progress, cancel)
        except Cancelled:
            return
        except Exception as exc:
            self.app.call_from_thread(self.failed, str(exc))
            return
        self.app.call_from_thread(self.finished, path)

    def show_progress(self, event: ProgressEvent) -> None:
        bar = self.query_one("#bar", ProgressBar)
        bar.update(total=event.total, progress=event.done)
        eta = f" · about {event.eta_s:.0f} s left" if event.eta_s is not None else ""
        done = f" · {event.done / (1 << 20):,.0f} of {(event.total or 0) / (1 << 20):,.0f} MiB" if event.total else ""
        self.query_one("#phase", Static).update(f"{event.phase}{done}{eta}")

    def finished(self, path: Path) -> None:
        self.notify(f"Downloaded {self.repo_id} into {path}")
        self.dismiss(self.repo_id)

    def action_close(self) -> None:
        if self.cancel is not None:
            self.cancel.cancel()  # what arrived stays; the next download resumes it
            self.notify(f"Download of {self.repo_id} stopped; downloading it again resumes where it stopped")
        self.dismiss(None)
