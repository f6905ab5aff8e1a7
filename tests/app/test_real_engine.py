"""glyd-chat on the real engine (vLLM's CPU build) and the demo model, driven by Pilot.

Grouped to pay for few vLLM starts (each ~10-30 s here): one session streams a reply, stops one with
Esc, switches to a second model and back; a second session (after quitting) finds the chat and
continues it. The second model is a directory copy of the demo model (symlinks) unless
GLYD_TEST_SECOND_MODEL points at another model directory (e.g. the demo model packed by `glyd pack`).
The KV setting is "off" by default to keep the first-start table build out of these timings;
GLYD_TEST_KV=auto runs them with it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import focus_input, type_text, wait_for

from glyd_app.app import GlydApp
from glyd_app.store import Store
from glyd_app.widgets.chat_input import ChatInput
from glyd_app.widgets.messages import MessageView
from glyd_app.widgets.stats_bar import StatsBar
from glyd_engine.engine.protocol import EngineSettings

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
TEST_HOME = Path(__file__).resolve().parents[2] / ".cache" / "test-home"  # as in tests/conftest.py
SIZE = (120, 40)
START_TIMEOUT = 300.0
REPLY_TIMEOUT = 180.0


def _settings() -> EngineSettings:
    return EngineSettings(kv=os.environ.get("GLYD_TEST_KV", "off"))


@pytest.fixture
def real_env(demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """GLYD_HOME is the persistent test home (the demo model is built there once); chats go to tmp."""
    monkeypatch.setenv("GLYD_HOME", str(TEST_HOME))
    monkeypatch.delenv("GLYD_ENGINE_BACKEND", raising=False)
    second = os.environ.get("GLYD_TEST_SECOND_MODEL")
    if second:
        other = Path(second)
    else:
        other = tmp_path / "smollm2-copy"
        other.mkdir()
        for f in demo_model_dir.iterdir():
            if f.is_file():
                (other / f.name).symlink_to(f)
    return {"db": tmp_path / "chats.sqlite3", "second": other, "exports": tmp_path}


def _gone(pid: int | None) -> bool:
    """The engine child has exited (a zombie not yet reaped counts as exited)."""
    assert pid is not None
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _app(env: dict[str, Path], **kwargs: object) -> GlydApp:
    return GlydApp(
        model="demo",
        settings=_settings(),
        store=Store(env["db"]),
        export_dir=env["exports"],
        install_if_missing=False,
        **kwargs,
    )  # type: ignore[arg-type]


async def _ready(pilot, app: GlydApp) -> None:  # type: ignore[no-untyped-def]
    await wait_for(pilot, lambda: app.session.engine_state in ("ready", "failed"), START_TIMEOUT, "engine start")
    assert app.session.engine_state == "ready", app.session.last_error


async def _send(pilot, app: GlydApp, text: str) -> MessageView:  # type: ignore[no-untyped-def]
    await focus_input(pilot, app)
    box = app.chat_screen.query_one(ChatInput)
    await type_text(pilot, text)
    await wait_for(pilot, lambda: box.text == text, 10, f"the input holding {text!r} (it holds {box.text!r})")
    chat_id = app.session.chat.id  # type: ignore[union-attr]
    before = len(app.session.store.messages(chat_id))
    await pilot.press("enter")
    # the user's message and the reply's row are stored when the reply starts; a short reply can also be over
    # between two polls, so "busy" alone may never be seen
    await wait_for(pilot, lambda: len(app.session.store.messages(chat_id)) >= before + 2, 30, "reply started")
    await wait_for(pilot, lambda: not app.session.busy, REPLY_TIMEOUT, "reply finished")
    return list(app.query(MessageView))[-1]


async def test_chat_stop_switch_and_back_on_the_real_engine(real_env: dict[str, Path]) -> None:
    app = _app(real_env)
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        ready = app.session.ready_info
        assert ready is not None and ready.device == "cpu" and ready.kv_capacity_tokens > 1000
        assert f"{len(os.sched_getaffinity(0))} threads" in ready.engine  # every core, not vLLM's one
        assert ready.sampling_defaults.get("temperature") == 0.0  # the demo's generation_config: greedy

        # 1. the first answer of a fresh chat, with the chat's default settings (the model's own sampling),
        #    streamed, with tokens a second and memory on screen
        reply = await _send(pilot, app, "What is the capital of France?")
        assert reply.role == "assistant" and "Paris" in reply.content, reply.content
        bar = app.chat_screen.query_one(StatsBar).render().plain
        assert "gen " in bar and "tok/s" in bar and "TTFT" in bar and "– tok/s" not in bar.split("·")[1]
        assert "weights " in bar and ("MiB" in bar or "GiB" in bar) and " RAM " in bar
        assert f"/{ready.kv_capacity_tokens:,} tok" in bar and "KV mode" in bar
        chat_id = app.session.chat.id  # type: ignore[union-attr]
        stored = app.session.store.messages(chat_id)
        assert stored[-1].status in ("done", "length") and stored[-1].stats.get("gen_tps")

        # 2. Esc stops a long reply; the text so far is kept
        await focus_input(pilot, app)
        await type_text(pilot, "Write a very long story about a dragon and a knight.")
        await pilot.press("enter")
        await wait_for(
            pilot,
            lambda: app.session.reply is not None and len(app.session.reply.text) > 20,
            REPLY_TIMEOUT,
            "some tokens",
        )
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.session.busy, 60, "stopped")
        stopped = app.session.store.messages(chat_id)[-1]
        assert stopped.status == "stopped" and len(stopped.content) > 20
        assert stopped.stats["generated_tokens"] < 512

        # 2b. a long paste: the bar says how much of the prompt vLLM has read, and Esc stops it there
        box = app.chat_screen.query_one(ChatInput)
        box.text = " ".join(f"Note {i}: the river rose again and the mill stayed shut." for i in range(300))
        await pilot.press("enter")
        bar_widget = app.chat_screen.query_one(StatsBar)
        await wait_for(pilot, lambda: bar_widget.stats is not None and bar_widget.stats.prompt_done > 0,
                       REPLY_TIMEOUT, "prompt progress")
        progress = bar_widget.stats
        assert progress.ttft_s is None and progress.prompt_done < progress.prompt_tokens  # type: ignore[union-attr]
        assert "reading the prompt" in bar_widget.render().plain
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.session.busy, 60, "stopped while reading the prompt")
        stopped = app.session.store.messages(chat_id)[-1]
        assert stopped.status == "stopped" and stopped.stats["generated_tokens"] == 0

        # 3. switch to a second model and back; the chat stays on screen, the old numbers do not
        before = len(app.query(MessageView))
        first_pid = app.session.engine.pid  # type: ignore[union-attr]
        app.switch_model(str(real_env["second"]))
        assert bar_widget.stats is None and "prompt – tok/s" in bar_widget.render().plain
        await wait_for(pilot, lambda: app.session.engine_state == "starting", 10)
        await _ready(pilot, app)
        assert app.session.ready_info is not None and Path(app.session.ready_info.path) == real_env["second"].resolve()
        assert _gone(first_pid)
        assert len(app.query(MessageView)) == before
        reply = await _send(pilot, app, "Say hello.")
        assert reply.content.strip()
        app.switch_model("demo")
        await wait_for(pilot, lambda: app.session.engine_state == "starting", 10)
        await _ready(pilot, app)
        assert app.session.ready_info is not None and app.session.ready_info.model == "demo"
        last_pid = app.session.engine.pid  # type: ignore[union-attr]
        await pilot.press("ctrl+q")
    assert _gone(last_pid)


async def test_quit_start_again_find_and_continue_the_chat(real_env: dict[str, Path]) -> None:
    app = _app(real_env)
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        await _send(pilot, app, "My name is Ada. Remember it.")
        chat_id = app.session.chat.id  # type: ignore[union-attr]
        await pilot.press("ctrl+q")

    again = _app(real_env)
    async with again.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: again.session.chat is not None, 10)
        assert again.session.chat.id == chat_id  # type: ignore[union-attr]  # reopens the last chat
        assert len(again.query(MessageView)) == 2  # shown before the engine is even ready
        await wait_for(pilot, lambda: again.screen.__class__.__name__ == "StartScreen", 10)
        await pilot.press("escape")  # hide the start progress; the app is usable while the engine loads
        await pilot.press("f3")  # and the chat is in the list
        await wait_for(pilot, lambda: again.screen.__class__.__name__ == "ChatList", 10)
        assert any(c.id == chat_id for c in again.screen.chats)  # type: ignore[attr-defined]
        await pilot.press("enter")
        await _ready(pilot, again)
        reply = await _send(pilot, again, "What is my name?")
        assert reply.content.strip()
        stored = again.session.store.messages(chat_id)
        assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]
        # the whole conversation went to the engine, not just the last message
        assert stored[-1].stats["prompt_tokens"] > stored[1].stats["prompt_tokens"] + 10
        await pilot.press("ctrl+q")
