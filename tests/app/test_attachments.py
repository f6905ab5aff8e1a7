"""Files in the prompt: attach a text file with path completion, shown in the chat, sent to the model with the
message, counted against the context; a file that does not fit is refused with the numbers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import type_text, wait_for
from textual.widgets import Input, Static, TextArea

from glyd_app.app import GlydApp
from glyd_app.attachments import AttachmentError, TokenCounter, read_attachment
from glyd_app.screens.attach import AttachScreen, complete_path
from glyd_app.widgets.messages import MessageView

pytestmark = pytest.mark.anyio
SIZE = (110, 36)


async def test_attach_complete_send_and_reload(scripted_app: Callable[..., GlydApp], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes-2026.md").write_text("Buy milk.\nCall Ada.\n")
    (tmp_path / "project" / "numbers.txt").write_text("1 2 3\n")
    monkeypatch.chdir(tmp_path)
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        await pilot.press("f8")
        await wait_for(pilot, lambda: isinstance(app.screen, AttachScreen))
        box = app.screen.query_one(Input)
        await type_text(pilot, "pro")
        await pilot.press("tab")  # one match, a directory: completed with its slash
        assert box.value == "project/"
        await pilot.press("tab")  # two files: completed as far as they agree, and listed
        assert box.value == "project/n"
        assert str(app.screen.query_one("#matches", Static).render()) == "notes-2026.md  numbers.txt"
        await type_text(pilot, "o")
        await pilot.press("tab", "enter")
        assert box.value == "project/notes-2026.md"
        await wait_for(pilot, lambda: app.screen is app.chat_screen)
        bar = str(app.chat_screen.query_one("#attached", Static).render())
        assert "📎 notes-2026.md · 20 B" in bar  # counted by the byte bound: the scripted model has no tokenizer
        await type_text(pilot, "What is on my list?")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.busy and len(app.query(MessageView)) == 2)
        engine = app.session.engine_factory.engines[-1]  # type: ignore[attr-defined]
        sent = engine.requests[0][0][-1]["content"]
        assert sent == "File `notes-2026.md`:\n````\nBuy milk.\nCall Ada.\n````\n\nWhat is on my list?"
        user = app.query(MessageView).first()
        assert user.content == "What is on my list?" and user.files[0].startswith("📎 notes-2026.md")
        assert not app.chat_screen.query_one("#attached").has_class("shown")
        await pilot.press("ctrl+n")  # then back: the attachment is shown from the store
        await wait_for(pilot, lambda: len(app.query(MessageView)) == 0)
        first = app.session.store.chats()[-1].id
        await app.open_chat(first)
        await wait_for(pilot, lambda: len(app.query(MessageView)) == 2)
        assert app.query(MessageView).first().files == ["📎 notes-2026.md · 51 tokens"]  # its fenced text, by bytes
        await pilot.press("ctrl+g")  # a regenerate sends the file again
        await wait_for(pilot, lambda: len(engine.requests) == 2 and not app.session.busy)
        assert engine.requests[1][0][-1]["content"] == sent


async def test_a_file_that_does_not_fit_is_refused_with_the_numbers(scripted_app: Callable[..., GlydApp],
                                                                    tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_text("word " * 800)  # 4,000 bytes: with 512 tokens kept for the reply, over a 4,096 context
    small = tmp_path / "small.txt"
    small.write_text("word " * 600)
    app = scripted_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session.engine_state == "ready")
        notes: list[str] = []
        app.chat_screen.notify = lambda text, **_: notes.append(text)  # type: ignore[method-assign]
        assert not app.chat_screen.attach(big)
        assert notes[-1] == ("Not attached: big.txt does not fit the context: 4,025 tokens (a bound of one token a "
                             "byte) plus 512 kept for the reply is over this model's 4,096. Attach a smaller file "
                             "or a part of it, or lower the chat's max tokens (F4)")
        assert app.chat_screen.pending == []
        assert app.chat_screen.attach(small)
        app.chat_screen.query_one("#input", TextArea).text = "x" * 600  # the straw: refused at send, nothing lost
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert "small.txt does not fit the context" in notes[-1]
        assert len(app.query(MessageView)) == 0 and app.chat_screen.pending and app.session.store.messages(
            app.session.chat.id) == []  # type: ignore[union-attr]
        await pilot.press("shift+f8")
        assert app.chat_screen.pending == []
        for bad, why in [(tmp_path, "is a directory"), (tmp_path / "nope.txt", "does not exist")]:
            assert not app.chat_screen.attach(bad) and why in notes[-1]


def test_reading_files_and_counting_with_a_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = TokenCounter(str(tmp_path))
    assert counter.method == "the model's tokenizer" and counter.count("hello world hello") == 3
    assert TokenCounter(str(tmp_path / "none")).method == "a bound of one token a byte"
    (tmp_path / "a.txt").write_text("hello world")
    assert read_attachment(tmp_path / "a.txt", counter).tokens < read_attachment(
        tmp_path / "a.txt", TokenCounter(None)).tokens
    (tmp_path / "b.bin").write_bytes(b"\x00\x01")
    (tmp_path / "c.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(AttachmentError, match="not a text file"):
        read_attachment(tmp_path / "b.bin", counter)
    with pytest.raises(AttachmentError, match="not UTF-8 text"):
        read_attachment(tmp_path / "c.txt", counter)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"


def test_path_completion(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("")
    (tmp_path / "setup.cfg").write_text("")
    (tmp_path / ".hidden").write_text("")
    assert complete_path("s", tmp_path) == ("s", ["setup.cfg", "src/"])
    assert complete_path("sr", tmp_path) == ("src/", ["src/"])
    assert complete_path("src/m", tmp_path) == ("src/main.py", ["main.py"])
    assert complete_path(str(tmp_path) + "/.h") == (str(tmp_path) + "/.hidden", [".hidden"])
    assert complete_path("zzz", tmp_path) == ("zzz", [])
