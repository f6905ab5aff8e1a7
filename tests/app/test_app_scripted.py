"""The app driven by Pilot on a scripted engine: chat flow, stop, failures, switching, chats, settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import focus_input, type_text, wait_for
from scripted import READY, Script

from glyd_app.app import GlydApp
from glyd_app.screens.dialogs import EngineFailed
from glyd_app.screens.start import StartScreen
from glyd_app.widgets.chat_input import ChatInput
from glyd_app.widgets.messages import MessageView
from glyd_app.widgets.stats_bar import StatsBar
from glyd_engine.engine.protocol import Error, Progress

pytestmark = pytest.mark.anyio

SIZE = (110, 36)
MakeApp = Callable[..., GlydApp]


async def _ready(pilot, app: GlydApp) -> None:  # type: ignore[no-untyped-def]
    await wait_for(pilot, lambda: app.session.engine_state == "ready", what="engine ready")


async def test_send_streams_a_reply_with_numbers_and_stores_it(scripted_app: MakeApp) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await type_text(pilot, "Capital of France?")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.busy and len(app.query(MessageView)) == 2)
        views = list(app.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant"]
        assert "Paris" in views[1].content
        bar = app.chat_screen.query_one(StatsBar)
        text = bar.render().plain
        assert "gen 41.3 tok/s" in text and "TTFT 0.06 s" in text and "prompt 672 tok/s" in text
        assert "weights 179 MiB" in text and "KV 56/16,320 tok" in text and "Glyd lossless" in text
        chat = app.session.chat
        assert chat is not None and chat.title == "Capital of France?"
        stored = app.session.store.messages(chat.id)
        assert [(m.role, m.status) for m in stored] == [("user", "done"), ("assistant", "done")]
        assert stored[1].stats["gen_tps"] == 41.3
        engine = app.session.engine_factory.engines[-1]  # type: ignore[attr-defined]
        messages, params = engine.requests[0]
        assert messages == [{"role": "user", "content": "Capital of France?"}]
        assert params.max_tokens == 512


async def test_newline_key_and_enter_sends_whole_text(scripted_app: MakeApp) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await type_text(pilot, "one")
        await pilot.press("ctrl+j")
        await type_text(pilot, "two")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.query(MessageView)) == 2)
        assert app.query(MessageView).first().content == "one\ntwo"


@pytest.mark.parametrize("key", ["escape", "ctrl+c"])
async def test_escape_stops_the_reply_and_keeps_the_text(scripted_app: MakeApp, key: str) -> None:
    app = scripted_app(Script(hold=True))
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await type_text(pilot, "tell me a story")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.session.busy)
        await pilot.press(key)
        await wait_for(pilot, lambda: not app.session.busy)
        reply = app.session.store.messages(app.session.chat.id)[-1]  # type: ignore[union-attr]
        assert reply.status == "stopped" and "Paris" in reply.content
        assert "Stopped" in list(app.query(MessageView))[-1].note


async def test_the_start_eta_counts_down_between_events(scripted_app: MakeApp) -> None:
    """The engine's ETA comes with each step of work (a table build's run: seconds apart); between two the
    start screen counts it down instead of standing still and then jumping."""
    from textual.clock import MockClock

    app = scripted_app(Script(start=[Progress("kv-tables", "calibrating", 3, 48, 60.0)]))
    app.progress_clock = MockClock()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, StartScreen) and bool(app.screen.query("#start-detail")))
        detail = app.screen.query_one("#start-detail")
        await wait_for(pilot, lambda: "about 1 min 00 s left" in str(detail.render()), 5, "the engine's ETA")
        app.progress_clock.set_time(12)  # type: ignore[attr-defined]
        await wait_for(pilot, lambda: "about 48 s left" in str(detail.render()), 5, "the countdown")
        app.progress_clock.set_time(112)  # type: ignore[attr-defined]
        await wait_for(pilot, lambda: "about 0 s left" in str(detail.render()), 5, "no negative ETA")


async def test_message_typed_while_starting_is_sent_when_ready(scripted_app: MakeApp) -> None:
    app = scripted_app(Script(start=[Progress("kv-tables", "calibrating", 3, 48, 60.0)]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, StartScreen))
        await pilot.pause(0.1)
        shown = " ".join(str(w.render()) for w in app.screen.query("Label, ProgressBar *"))
        assert shown.count("left") == 1 and "about 1 min 00 s left" in shown  # one ETA: the engine's
        assert "--:--:--" not in shown and "00:00:" not in shown  # the bar has none of its own
        await pilot.press("escape")  # hide the progress, keep typing
        await type_text(pilot, "hello")
        await pilot.press("enter")
        await pilot.pause(0.1)
        engine = app.session.engine_factory.engines[-1]  # type: ignore[attr-defined]
        assert engine.requests == []
        engine.on_event(READY)
        await wait_for(pilot, lambda: len(engine.requests) == 1 and not app.session.busy)
        assert app.session.store.messages(app.session.chat.id)[-1].role == "assistant"  # type: ignore[union-attr]


async def test_failed_start_shows_the_reason_and_app_stays_usable(scripted_app: MakeApp) -> None:
    app = scripted_app(Script(start=[Error("not enough memory for the KV cache (needs 2.1 GiB, 1.2 free)", "oom")]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, EngineFailed))
        assert app.screen.kind == "oom" and "not enough memory" in app.screen.message  # type: ignore[attr-defined]
        await pilot.press("escape")
        assert app.session.engine_state == "failed"
        assert "not enough memory" in app.chat_screen.query_one("#banner").render().plain  # type: ignore[attr-defined]
        await type_text(pilot, "still here")
        await pilot.press("enter")
        await pilot.pause(0.1)
        # kept, not lost: the message waits in the chat for an engine
        assert app.session.store.messages(app.session.chat.id)[-1].content == "still here"  # type: ignore[union-attr]


async def test_switching_model_restarts_engine_and_keeps_history(scripted_app: MakeApp, tmp_path: Path) -> None:
    model_dir = tmp_path / "other-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await type_text(pilot, "first")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.query(MessageView)) == 2 and not app.session.busy)
        await pilot.press("f2")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ModelPicker")
        await pilot.click("#model-input")
        await type_text(pilot, str(model_dir))
        await pilot.press("enter")
        engines = app.session.engine_factory.engines  # type: ignore[attr-defined]
        await wait_for(pilot, lambda: len(engines) == 2 and app.session.engine_state == "ready")
        assert not engines[0].running and engines[1].started[0][0] == str(model_dir.resolve())
        assert app.session.store.model_dirs() == [model_dir.resolve()]
        assert len(app.query(MessageView)) == 2  # the chat stayed
        assert app.session.store.chat(app.session.chat.id).model == str(model_dir.resolve())  # type: ignore[union-attr]
        await pilot.press("f2")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ModelPicker")
        await wait_for(pilot, lambda: len(app.screen.entries) >= 2)  # type: ignore[attr-defined]
        labels = [e.label for e in app.screen.entries]  # type: ignore[attr-defined]
        assert labels[0].endswith("(demo)") and "other-model" in labels


async def test_chat_list_rename_export_delete_and_new_chat(scripted_app: MakeApp, tmp_path: Path) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await type_text(pilot, "about cats")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.busy and len(app.query(MessageView)) == 2)
        first = app.session.chat.id  # type: ignore[union-attr]
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.session.chat.id != first)  # type: ignore[union-attr]
        assert len(app.query(MessageView)) == 0
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatList")
        await pilot.press("down")  # the older chat, "about cats"
        await pilot.press("r")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "TextPrompt")
        await pilot.press("ctrl+a", "ctrl+k")
        await type_text(pilot, "Cats")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.session.store.chat(first).title == "Cats")
        await pilot.press("e")
        exported = tmp_path / "exports" / "glyd-cats.md"
        await wait_for(pilot, exported.exists)
        assert "about cats" in exported.read_text()
        await pilot.press("enter")  # open it
        await wait_for(pilot, lambda: app.session.chat.id == first)  # type: ignore[union-attr]
        assert len(app.query(MessageView)) == 2
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatList")
        await pilot.press("d")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm")
        await pilot.press("y")
        await wait_for(pilot, lambda: all(c.id != first for c in app.session.store.chats()))
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.session.chat.id != first)  # type: ignore[union-attr]


async def test_chat_settings_reach_the_engine(scripted_app: MakeApp) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatSettingsScreen")
        await type_text(pilot, "Answer in French.")
        await pilot.click("#temperature")
        await pilot.press("ctrl+a", "ctrl+k")  # clear
        await type_text(pilot, "0.2")
        await pilot.click("#max_tokens")
        await pilot.press("ctrl+a", "ctrl+k")
        await type_text(pilot, "64")
        await pilot.press("ctrl+s")
        await focus_input(pilot, app)
        await type_text(pilot, "hi")
        await pilot.press("enter")
        engine = app.session.engine_factory.engines[-1]  # type: ignore[attr-defined]
        await wait_for(pilot, lambda: len(engine.requests) == 1)
        params = engine.requests[0][1]
        assert (params.system_prompt, params.temperature, params.max_tokens) == ("Answer in French.", 0.2, 64)


async def test_bad_setting_is_refused_with_a_reason(scripted_app: MakeApp) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatSettingsScreen")
        await pilot.click("#top_p")
        await pilot.press("ctrl+a", "ctrl+k")
        await type_text(pilot, "7")
        await pilot.press("ctrl+s")
        await pilot.pause(0.1)
        assert "top-p" in str(app.screen.query_one("#error").render())


async def test_palette_help_and_remapped_key(scripted_app: MakeApp, glyd_home: Path) -> None:
    (glyd_home / "config").mkdir(parents=True)
    (glyd_home / "config" / "keymap.toml").write_text('[keymap]\n"glyd.new_chat" = "ctrl+b"\n')
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await type_text(pilot, "x")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.busy and len(app.query(MessageView)) == 2)
        first = app.session.chat.id  # type: ignore[union-attr]
        await pilot.press("ctrl+b")
        await wait_for(pilot, lambda: app.session.chat.id != first)  # type: ignore[union-attr]
        await pilot.press("f1")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen")
        rows = {k: i for k, _, i in app.screen.rows}  # type: ignore[attr-defined]
        assert rows["ctrl+b"] == "glyd.new_chat" and rows["ctrl+g"] == "glyd.regenerate"
        help_text = app.screen.query_one("Markdown").source  # type: ignore[attr-defined]
        assert "| `ctrl+p` | Command palette (Textual's own key) | (fixed) |" in help_text  # no empty cell
        await pilot.press("escape")
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "CommandPalette")
        await type_text(pilot, "open chat")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatList")


async def test_copy_message_and_code_block(scripted_app: MakeApp) -> None:
    app = scripted_app()
    copied: list[str] = []
    async with app.run_test(size=SIZE) as pilot:
        app.copy_to_clipboard = copied.append  # type: ignore[method-assign]
        await _ready(pilot, app)
        await type_text(pilot, "code please")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.busy and len(app.query(MessageView)) == 2)
        reply = list(app.query(MessageView))[-1]
        reply.focus()
        await pilot.press("b")
        await pilot.press("c")
        assert copied == ['print("Bonjour, Paris")', reply.content]


async def test_quit_shuts_the_engine_down(scripted_app: MakeApp) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        engine = app.session.engine_factory.engines[-1]  # type: ignore[attr-defined]
        await pilot.press("ctrl+q")
        await pilot.pause(0.1)
    assert not engine.running


async def test_quick_successive_switches_leave_one_engine(scripted_app: MakeApp, tmp_path: Path) -> None:
    dirs = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        dirs.append(d)
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        app.switch_model(str(dirs[0]))
        app.switch_model(str(dirs[1]))
        engines = app.session.engine_factory.engines  # type: ignore[attr-defined]
        await wait_for(
            pilot,
            lambda: (
                app.session.engine_state == "ready"
                and app.session.engine is not None
                and app.session.engine.started[-1][0] == str(dirs[1].resolve())
            ),
        )  # type: ignore[attr-defined]
        await pilot.pause(0.2)
        assert [e for e in engines if e.running] == [app.session.engine]


def _shown_text(widget) -> str:  # type: ignore[no-untyped-def]
    """The text a widget draws in its region (what a user sees, wrapped), one line per row."""
    return "\n".join(strip.text.rstrip() for strip in widget.render_lines(widget.region.reset_offset))


async def test_kv_mode_is_chosen_in_the_app_confirmed_saved_and_the_engine_restarts(scripted_app: MakeApp,
                                                                                   glyd_home: Path) -> None:
    """F5 lists the modes with what each costs, in an 80-column terminal with nothing clipped; picking one
    asks first, saying what the switch costs here (the table build once, the speed); No keeps everything;
    Yes keeps the user's config.toml lines, saves the mode there and restarts the engine with it."""
    from glyd_app.config import config_path, load_engine_settings
    from glyd_app.screens.dialogs import Confirm

    config_path().parent.mkdir(parents=True)
    config_path().write_text("# mine\n[engine]\nmax_model_len = 2048\n")
    app = scripted_app()
    async with app.run_test(size=(80, 30)) as pilot:
        await _ready(pilot, app)
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "KVModeScreen")
        options = app.screen.query_one("#kv-modes")
        texts = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert any("lossless" in t and "KV tables" in t and "slower" in t for t in texts), texts
        now = app.screen.query_one("#kv-now")
        assert now.region.right <= 80
        assert " ".join(_shown_text(now).split()) == f"Now: Glyd lossless ({READY.kv_reason})"  # wrapped, whole
        await pilot.press("up", "up", "enter")  # from the current mode (off, the fixture's) to lossless
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm), what="the switch's cost, asked first")
        question = app.screen.query_one(".title")
        shown = " ".join(_shown_text(question).split())
        assert question.region.right <= 80
        assert "Switch the KV cache to lossless?" in shown and "last load took 10 s" in shown
        assert "Build, once: this model's KV tables" in shown and "about 11x slower on this CPU" in shown
        await pilot.press("escape")  # No: nothing changes
        await pilot.pause(0.2)
        engines = app.session.engine_factory.engines  # type: ignore[attr-defined]
        assert len(engines) == 1 and app.settings.kv == "off" and "kv =" not in config_path().read_text()
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "KVModeScreen")
        await pilot.press("up", "up", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.press("y")
        await wait_for(pilot, lambda: len(engines) == 2 and app.session.engine_state == "ready")
        assert engines[-1].started[-1][1].kv == "lossless" and app.settings.kv == "lossless"
    text = config_path().read_text()
    assert text.startswith("# mine\n[engine]\n") and 'kv = "lossless"' in text and "max_model_len = 2048" in text
    settings, error = load_engine_settings()
    assert error is None and settings.kv == "lossless" and settings.max_model_len == 2048


async def test_ctrl_c_copies_when_no_reply_streams(scripted_app: MakeApp) -> None:
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await focus_input(pilot, app)
        await type_text(pilot, "copy me")
        await pilot.press("shift+home", "ctrl+c")  # no reply streaming: the selection is copied
        await wait_for(pilot, lambda: app.clipboard == "copy me")


async def test_regenerate_and_edit_the_last_message(scripted_app: MakeApp) -> None:
    """Ctrl+G asks again (the previous reply is replaced); Ctrl+T takes the last message back into the box
    (it and its reply leave the chat) to be sent again as edited."""
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await type_text(pilot, "Capital of France?")
        await pilot.press("enter")
        chat_id = app.session.chat.id  # type: ignore[union-attr]
        await wait_for(pilot, lambda: len(app.session.store.messages(chat_id)) == 2 and not app.session.busy)
        first_reply = app.session.store.messages(chat_id)[1].created
        engine = app.session.engine_factory.engines[-1]  # type: ignore[attr-defined]
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: len(engine.requests) == 2 and not app.session.busy)
        stored = app.session.store.messages(chat_id)
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].created > first_reply
        assert engine.requests[1][0] == engine.requests[0][0]  # the same conversation, asked again
        assert len(app.query(MessageView)) == 2
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: app.chat_screen.query_one(ChatInput).text == "Capital of France?")
        assert app.session.store.messages(chat_id) == [] and len(app.query(MessageView)) == 0
        await type_text(pilot, " And of Italy?")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(engine.requests) == 3 and not app.session.busy)
        assert engine.requests[2][0] == [{"role": "user", "content": "Capital of France? And of Italy?"}]


async def test_a_cancelled_start_reads_as_cancelled_not_failed(scripted_app: MakeApp) -> None:
    app = scripted_app(Script(start=[Progress("kv-tables", "calibrating", 3, 48, 60.0)]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, StartScreen))
        await pilot.press("ctrl+x")
        await wait_for(pilot, lambda: app.session.engine_state == "failed")
        await pilot.pause(0.1)
        bar = app.chat_screen.query_one(StatsBar).render().plain
        assert "engine: start cancelled" in bar and "failed" not in bar and "Cancelled:" not in bar
        assert app.screen is app.chat_screen  # no failure dialog for the user's own cancel
