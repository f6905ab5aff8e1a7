"""The glyd-chat App: holds the chat session, hands it the engine's events, draws the engine's life, holds the
actions.

Thin on purpose: drawing is in screens/ and widgets/; the chat, its store, the engine and the reply in flight
are the session's (session.py, no UI), the one writer of that state: the app asks it for changes and renders
what it reports (`EngineView`), and never touches the store. The engine runs in a child process behind
`glyd_engine.engine.EngineClient`. Blocking work (spawning or shutting down the child, installing the
engine) runs in named thread workers; their results come back as messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.clock import Clock
from textual.screen import Screen
from textual.worker import Worker, WorkerState

from glyd_app.commands import Command, GlydCommands
from glyd_app.config import keymap_path, load_keymap
from glyd_app.engine_link import EngineEvent, poster
from glyd_app.screens.chat import ChatScreen
from glyd_app.screens.start import StartScreen
from glyd_app.session import ChatSession, EngineFactory, default_factory
from glyd_app.store import Store
from glyd_app.widgets.stats_bar import StatsBar
from glyd_engine.engine.protocol import EngineSettings, Error, Progress, Ready
from glyd_engine.errors import CANCELLED, CRASH, OFFLINE, OfflineError
from glyd_engine.kv_mode import running_name

if TYPE_CHECKING:
    from glyd_app.screens.chats import ChatsChanged, ExportChat
    from glyd_app.screens.kv_mode import Here
    from glyd_app.screens.models import ForgetModelDir
    from glyd_app.screens.settings import ChatSettings

# Screens other than the chat and start screens are imported when first opened: the first frame
# only pays for what it draws.


class GlydApp(App[None]):
    TITLE = "glyd-chat"
    COMMANDS = App.COMMANDS | {GlydCommands}
    BINDINGS = [
        Binding("f1", "help", "Help", id="glyd.help"),
        Binding("f2", "models", "Model", id="glyd.models"),
        Binding("f3,ctrl+o", "chats", "Chats", id="glyd.chats"),
        Binding("f4", "chat_settings", "Settings", id="glyd.chat_settings"),
        Binding("f5", "kv_mode", "KV mode", id="glyd.kv_mode"),
        Binding("ctrl+n", "new_chat", "New chat", id="glyd.new_chat"),
        Binding("ctrl+s", "export", "Export", id="glyd.export", show=False),
        Binding("ctrl+r", "restart_engine", "Restart engine", id="glyd.restart", show=False),
        Binding("ctrl+q", "quit", "Quit", id="glyd.quit", priority=True),
    ]

    def __init__(
        self,
        model: str = "demo",
        settings: EngineSettings | None = None,
        engine_factory: EngineFactory = default_factory,
        store: Store | None = None,
        export_dir: Path | None = None,
        chat_id: int | None = None,
        install_if_missing: bool = True,
    ) -> None:
        super().__init__()
        self.session = ChatSession(model, settings, engine_factory, store, chat_id, install_if_missing)
        self.session.engine_view = self
        self.export_dir = export_dir or Path.cwd()
        self.slow_ok: set[str] = set()  # models the user said to load although they will be slow here
        self.start_screen: StartScreen | None = None
        self.chat_screen = ChatScreen(self.session)
        self.progress_clock: Clock | None = None  # tests: a MockClock for deterministic ETAs

    # ------------------------------------------------------------------ set-up

    @property
    def settings(self) -> EngineSettings:
        return self.session.settings

    @property
    def model_spec(self) -> str:
        return self.session.model_spec

    def get_default_screen(self) -> Screen:
        return self.chat_screen

    def on_mount(self) -> None:
        keymap, error = load_keymap()
        if keymap:
            self.set_keymap(keymap)
        if error:
            self.notify(f"Key map not loaded: {error}", severity="error")

    def on_chat_screen_shown(self, _: ChatScreen.Shown) -> None:
        # After the first frame: spawning the child competes for the CPU with the first paint.
        self.call_after_refresh(self.start_engine, self.model_spec)

    async def open_chat(self, chat_id: int) -> None:
        await self.chat_screen.show_chat(self.session.open(chat_id))

    # ------------------------------------------------------------------ engine lifecycle

    @property
    def stats_bar(self) -> StatsBar:
        return self.chat_screen.stats_bar

    def asked_first(self, spec: str, then: Callable[[str], None]) -> bool:
        """Where `spec` is a model that will be slow here (a Glyd checkpoint with no CUDA GPU) and the user has
        not said to load it anyway: ask, then call `then` with the model chosen. True: the question is asked."""
        from glyd_app.screens.dialogs import SlowModel
        from glyd_engine.engine.install import engine_flavor
        from glyd_engine.models.packed import bf16_source, slow_here

        path = Path(spec).expanduser()
        if spec in self.slow_ok or not (path / "config.json").is_file():
            return False
        why = slow_here(path, gpu=engine_flavor() == "gpu")
        if why is None:
            return False
        source = bf16_source(path)
        source_spec = None if source is None else ("demo" if source.kind == "demo" else str(source.path))

        def chosen(what: str | None) -> None:
            if what == "load":
                self.slow_ok.add(spec)
                then(spec)
            elif what == "bf16" and source_spec is not None:
                self.switch_model(source_spec)
            elif self.session.engine_state != "ready":
                self.stats_bar.state = f"{_short(spec)} not loaded: F2 picks a model"

        self.push_screen(SlowModel(why, None if source is None else source.name), chosen)
        return True

    def start_engine(self, spec: str, show_progress: bool = True) -> None:
        """Stop the running engine (if any) and start `spec`; progress shows on the start screen."""
        if self.asked_first(spec, lambda chosen: self.start_engine(chosen, show_progress)):
            return
        generation = self.session.begin_start(spec)
        bar = self.stats_bar
        bar.ready = None
        bar.stats = None  # the previous engine's last reply says nothing about this one
        bar.state = f"starting {_short(spec)}…"
        self.chat_screen.show_banner("")
        if show_progress:
            self.show_start_screen()
        self._engine_start(spec, generation)

    def show_start_screen(self) -> None:
        if self.start_screen is not None or self.session.engine_state != "starting":
            return
        screen = StartScreen(_short(self.model_spec), clock=self.progress_clock)
        self.start_screen = screen

        def closed(result: str | None) -> None:
            self.start_screen = None
            if result == "cancel":
                self.cancel_start()

        self.push_screen(screen, closed)

    def _close_start_screen(self) -> None:
        if self.start_screen is not None:
            screen, self.start_screen = self.start_screen, None
            if screen.is_current:
                screen.dismiss("done")

    @work(
        thread=True,
        exclusive=True,
        exit_on_error=False,
        group="engine",
        name="engine-start",
        description="Starting the engine process",
    )
    def _engine_start(self, spec: str, generation: int) -> None:
        self.session.spawn(spec, generation, poster(self))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """The one place worker failures land: an engine that cannot even be spawned is a failed start."""
        if event.state != WorkerState.ERROR or event.worker.group != "engine":
            return
        error = event.worker.error
        kind = OFFLINE if isinstance(error, OfflineError) else CRASH
        self.session.engine_failed(Error(f"{type(error).__name__}: {error}", kind, fatal=True))

    def cancel_start(self) -> None:
        if self.session.engine_state != "starting":
            return
        engine = self.session.begin_cancel()
        self.stats_bar.state = "start cancelled"
        if engine is not None:
            self.run_worker(
                lambda: engine.cancel_start(),
                thread=True,
                group="engine-cancel",
                name="engine-cancel",
                exit_on_error=False,
            )

    # ------------------------------------------------------------------ what the session reports (EngineView)

    def engine_failed(self, error: Error) -> None:
        self._close_start_screen()
        self.stats_bar.ready = None
        self.stats_bar.stats = None
        cancelled = error.kind == CANCELLED
        self.stats_bar.state = "start cancelled" if cancelled else f"failed ({error.kind}): {error.message}"
        what = "start cancelled" if cancelled else error.message
        self.chat_screen.show_banner(f"Engine: {what}  ·  Ctrl+R restarts, F2 picks another model")
        if cancelled:
            self.notify("Start cancelled. Ctrl+R starts again; F2 picks another model.")
            return

        def chosen(what: str | None) -> None:
            if what == "restart":
                self.action_restart_engine()
            elif what == "models":
                self.action_models()

        from glyd_app.screens.dialogs import EngineFailed

        self.push_screen(EngineFailed(error.kind, error.message, error.log_path, error.fix), chosen)

    def engine_progress(self, ev: Progress) -> None:
        if self.start_screen is not None:
            self.start_screen.show(ev)
        pct = f" {ev.fraction * 100:.0f}%" if ev.fraction is not None else ""
        self.stats_bar.state = f"starting {_short(self.model_spec)}: {ev.phase}{pct}"

    def engine_ready(self, ev: Ready) -> None:
        self._close_start_screen()
        self.stats_bar.ready = ev
        self.stats_bar.stats = None
        self.notify(f"{ev.name} is ready ({ev.engine}, loaded in {ev.load_seconds:.0f} s)", timeout=4)
        if ev.weights_dtype not in ("", "glyd", ev.dtype):
            self.notify(f"{ev.name}'s weights are {ev.weights_dtype}; they run as {ev.dtype} (rounded on "
                        "load, so not bit-exact to the file)", severity="warning", timeout=10)

    def engine_error(self, error: Error) -> None:
        self.notify(error.message, severity="error")

    def engine_stopped(self) -> None:
        self.stats_bar.state = "stopped"

    async def on_engine_event(self, message: EngineEvent) -> None:
        await self.session.on_event(message.event, message.generation)

    # ------------------------------------------------------------------ asked for by other screens

    def on_forget_model_dir(self, message: ForgetModelDir) -> None:
        self.session.forget_model_dir(message.path)

    def on_export_chat(self, message: ExportChat) -> None:
        self.export_chat(message.chat_id)

    def export_chat(self, chat_id: int) -> None:
        try:
            target = self.session.export_chat(chat_id, self.export_dir)
        except OSError as exc:
            self.notify(f"Export failed: {exc}", severity="error")
            return
        self.notify(f"Exported to {target}")

    # ------------------------------------------------------------------ actions

    def action_help(self) -> None:
        from glyd_app.screens.help import HelpScreen
        from glyd_app.store import db_path
        from glyd_engine import paths
        from glyd_engine.engine.client import log_path

        rows = []
        for screen_or_app in (self, self.chat_screen):
            for binding in screen_or_app.BINDINGS:  # type: ignore[attr-defined]
                if isinstance(binding, Binding) and binding.id:
                    keys = self._current_keys(binding)
                    rows.append((keys, binding.description, binding.id))
        rows += [
            ("enter", "Send the message", "glyd.send"),
            ("ctrl+j", "New line in the message", "glyd.newline"),
            (
                "c / b",
                "On a focused message: copy it / its last code block",
                "glyd.copy_message / glyd.copy_code",
            ),
            ("ctrl+p", "Command palette (Textual's own key)", ""),
        ]
        places = {
            "keymap": str(keymap_path()),
            "db": str(db_path()),
            "cache": str(paths.cache_dir()),
            "log": str(log_path()),
        }
        self.push_screen(HelpScreen(rows, places))

    def _current_keys(self, binding: Binding) -> str:
        return self._keymap.get(binding.id or "", binding.key) if hasattr(self, "_keymap") else binding.key

    def action_models(self) -> None:
        from glyd_app.screens.models import ModelPicker

        def chosen(spec: str | None) -> None:
            if spec:
                self.switch_model(spec)

        self.push_screen(ModelPicker(self.model_spec, self.session.model_dirs()), chosen)

    def switch_model(self, spec: str) -> None:
        path = Path(spec).expanduser()
        if path.is_dir():
            spec = str(path.resolve())
            if self.asked_first(spec, self.switch_model):
                return
        self.session.use_model(spec, added_dir=path.is_dir())
        self.start_engine(spec)

    def action_restart_engine(self) -> None:
        self.start_engine(self.model_spec)

    def action_kv_mode(self) -> None:
        from glyd_app.screens.dialogs import Confirm
        from glyd_app.screens.kv_mode import KVModeScreen, switch_cost

        ready = self.session.ready_info
        in_force = ""
        if ready is not None:
            in_force = f"Now: {running_name(ready.kv_mode)}" + (f" ({ready.kv_reason})" if ready.kv_reason else "")

        def switch(mode: str) -> None:
            from glyd_app.config import save_engine_setting

            try:
                save_engine_setting("kv", mode)
            except OSError as exc:
                self.notify(f"KV mode not saved to config.toml ({exc}); used for this run only", severity="error")
            self.session.use_kv_mode(mode)
            self.notify(f"KV mode {mode}: restarting the engine")
            self.start_engine(self.model_spec)

        def chosen(mode: str | None) -> None:
            if mode is None:
                return
            if mode == self.settings.kv:
                self.notify(f"KV mode is {mode} already")
                return
            question = f"Switch the KV cache to {mode}?\n\n{switch_cost(mode, self.kv_here())}"
            self.push_screen(Confirm(question, yes="Switch and restart"), lambda yes: switch(mode) if yes else None)

        self.push_screen(KVModeScreen(self.settings.kv, in_force), chosen)

    def kv_here(self) -> Here:
        """What a KV switch costs depends on, from the engine's last ready event and the tables held here."""
        from glyd_app.screens.kv_mode import Here
        from glyd_engine.models.tables_here import last_build_seconds, model_tables_seconds

        ready = self.session.ready_info
        return Here(
            device=ready.device if ready is not None else "cpu",
            running=ready.kv_mode if ready is not None else "off",
            capacity=ready.kv_capacity_tokens if ready is not None else 0,
            load_s=ready.load_seconds if ready is not None and ready.load_seconds else None,
            tables_s=model_tables_seconds(Path(ready.path)) if ready is not None and ready.path else None,
            last_build_s=last_build_seconds(),
        )

    def action_chats(self, search: bool = False) -> None:
        from glyd_app.screens.chats import ChatList

        current = self.session.chat.id if self.session.chat else None

        async def chosen(chat_id: int | None) -> None:
            if chat_id is not None and chat_id != current:
                if self.session.busy:
                    self.notify("A reply is streaming: Esc stops it first.", severity="warning")
                    return
                await self.open_chat(chat_id)

        self.push_screen(ChatList(self.session, current, search), chosen)

    async def on_chats_changed(self, message: ChatsChanged) -> None:
        chat = self.session.chat
        if chat is None:
            return
        if message.deleted == chat.id:
            await self.open_chat(self.session.chat_after_delete().id)
        else:
            self.chat_screen.retitle()

    async def action_new_chat(self) -> None:
        new = self.session.new_chat()
        if new is not None:
            await self.open_chat(new.id)

    def action_chat_settings(self) -> None:
        from glyd_app.screens.settings import ChatSettingsScreen

        chat = self.session.chat
        if chat is None:
            return

        def saved(settings: ChatSettings | None) -> None:
            if settings is not None:
                self.session.save_chat_settings(chat.id, settings.system_prompt, settings.temperature,
                                                settings.top_p, settings.max_tokens, settings.seed)
                self.chat_screen.retitle()
                self.notify("Chat settings saved")

        ready = self.session.ready_info
        defaults = ready.sampling_defaults if ready is not None else None
        self.push_screen(ChatSettingsScreen(self.session.chat_by_id(chat.id), defaults), saved)

    def action_export(self) -> None:
        if self.session.chat is not None:
            self.export_chat(self.session.chat.id)

    def action_rename_chat(self) -> None:
        from glyd_app.screens.dialogs import TextPrompt

        chat = self.session.chat
        if chat is None:
            return

        def done(title: str | None) -> None:
            if title:
                self.session.rename_chat(chat.id, title)
                self.chat_screen.retitle()

        self.push_screen(TextPrompt("Rename chat", chat.title), done)

    def copy_last_reply(self) -> None:
        view = self.chat_screen.last_reply()
        if view is None:
            self.notify("No reply yet", severity="warning")
            return
        view.action_copy()

    def copy_code_block(self, block: str) -> None:
        self.copy_to_clipboard(block)
        self.notify("Code block copied to the clipboard")

    def palette_commands(self) -> list[Command]:
        from glyd_app.widgets.messages import code_blocks

        commands: list[Command] = [
            ("Switch model", "Pick another model; the chat stays", self.action_models),
            ("New chat", "Start an empty conversation", self.action_new_chat),
            ("Open chat…", "List, open, rename, delete, export chats", self.action_chats),
            ("Search chats…", "Full-text search over every chat's title and messages",
             lambda: self.action_chats(search=True)),
            (
                "Export chat to Markdown",
                f"Write this chat as a .md file into {self.export_dir}",
                self.action_export,
            ),
            ("Rename chat", "Give this chat a title", self.action_rename_chat),
            ("Attach a file…", "A text file sent with the next message, counted against the context (F8)",
             self.chat_screen.action_attach),
            ("Chat settings", "System prompt, temperature, top-p, max tokens, seed", self.action_chat_settings),
            ("Copy last reply", "Copy the last assistant message", self.copy_last_reply),
            ("Regenerate the last reply", "Ask again; the last reply is replaced (Ctrl+G)",
             self.chat_screen.action_regenerate),
            ("Edit the last message", "Take it back into the box; it and its reply leave the chat (Ctrl+T)",
             self.chat_screen.action_edit_last),
            ("Stop reply", "Stop the reply being generated", self.chat_screen.action_stop),
            ("Restart engine", "Shut the engine down and start it again", self.action_restart_engine),
            ("KV cache mode…", "auto, lossless, exact or off: what each costs here; restarts the engine",
             self.action_kv_mode),
            ("Show start progress", "Show the engine start screen again", self.show_start_screen),
            ("Help", "Keys, files and what the numbers mean", self.action_help),
        ]
        view = self.chat_screen.last_reply()
        for i, block in enumerate(code_blocks(view.content) if view else [], 1):
            first = block.strip().splitlines()[0][:40] if block.strip() else ""
            commands.append(
                (
                    f"Copy code block {i} of the last reply",
                    first,
                    lambda block=block: self.copy_code_block(block),
                )
            )
        return commands

    async def action_quit(self) -> None:
        """Save the reply in flight, shut the engine child down (so its memory is freed), exit."""
        engine = self.session.stop_for_quit()
        if engine is not None:
            self.stats_bar.state = "shutting the engine down…"
            await asyncio.to_thread(engine.shutdown, 10.0)
        self.exit()


def _short(spec: str) -> str:
    if spec in ("", "demo"):
        return "the demo model"
    return Path(spec).name if "/" in spec and Path(spec).expanduser().exists() else spec
