"""The SQLite store: schema migrations, chats and messages, export."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from glyd_app.store import HIT_END, HIT_START, MIGRATIONS, SCHEMA_VERSION, Store, StoreError, title_from


def test_fresh_database_is_at_the_latest_schema(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    assert store.version == SCHEMA_VERSION == len(MIGRATIONS)


def test_version_1_database_is_upgraded_keeping_its_chats(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0] + "; PRAGMA user_version = 1;")
    db.execute("INSERT INTO chats (title, created, updated) VALUES ('old chat', 1, 1)")
    db.execute("INSERT INTO messages (chat_id, role, content, created) VALUES (1, 'user', 'hi', 1)")
    db.commit()
    db.close()
    store = Store(path)
    assert store.version == SCHEMA_VERSION
    [chat] = store.chats()
    assert chat.title == "old chat"
    [msg] = store.messages(chat.id)
    assert (msg.content, msg.status, msg.stats) == ("hi", "done", {})


def test_version_2_chats_take_the_models_sampling_unless_a_user_chose_theirs(tmp_path: Path) -> None:
    """Schema 3 lets temperature/top-p be the model's default; chats at the old fixed defaults (0.7, 0.95)
    get it, a chat a user set keeps its values, and no message is lost in the table rebuild."""
    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0] + "; " + MIGRATIONS[1] + "; PRAGMA user_version = 2;")
    db.execute("INSERT INTO chats (title, created, updated) VALUES ('defaults', 1, 1)")
    db.execute("INSERT INTO chats (title, temperature, top_p, created, updated) VALUES ('mine', 0.3, 0.8, 2, 2)")
    db.execute("INSERT INTO messages (chat_id, role, content, created) VALUES (1, 'user', 'hi', 1)")
    db.execute("INSERT INTO messages (chat_id, role, content, created) VALUES (2, 'user', 'yo', 2)")
    db.commit()
    db.close()
    store = Store(path)
    assert store.version == SCHEMA_VERSION
    chats = {c.title: c for c in store.chats()}
    assert (chats["defaults"].temperature, chats["defaults"].top_p, chats["defaults"].seed) == (None, None, None)
    assert (chats["mine"].temperature, chats["mine"].top_p) == (0.3, 0.8)
    assert [m.content for c in ("defaults", "mine") for m in store.messages(chats[c].id)] == ["hi", "yo"]
    store.delete_chat(chats["mine"].id)  # foreign keys are back on: its messages go with it
    assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 1


def test_newer_database_is_refused_not_damaged(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer glyd"):
        Store(path)


def test_chats_messages_rename_delete_and_state(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    chat = store.new_chat(model="demo", temperature=0.2)
    assert chat.temperature == 0.2
    store.add_message(chat.id, "user", "hello")
    reply = store.add_message(chat.id, "assistant", "", status="streaming")
    store.update_message(reply.id, content="hi there", status="done", stats={"gen_tps": 12.5})
    assert [(m.role, m.content, m.status) for m in store.messages(chat.id)] == [
        ("user", "hello", "done"),
        ("assistant", "hi there", "done"),
    ]
    assert store.message(reply.id).stats == {"gen_tps": 12.5}
    store.rename_chat(chat.id, "  ")
    assert store.chat(chat.id).title == "Untitled"
    store.add_model_dir(tmp_path)
    assert store.model_dirs() == [tmp_path.resolve()]
    store.set_state("last_chat", str(chat.id))
    assert store.get_state("last_chat") == str(chat.id)
    store.delete_chat(chat.id)
    assert store.chats() == [] and store.messages(chat.id) == []
    with pytest.raises(StoreError):
        store.update_chat(chat.id, colour="red")


def test_export_markdown_never_overwrites(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    chat = store.new_chat(title="Paris & co", system_prompt="Be brief.")
    store.add_message(chat.id, "user", "Capital of France?")
    store.add_message(chat.id, "assistant", "Paris.", status="stopped")
    first = store.export_to(chat.id, tmp_path / "out")
    second = store.export_to(chat.id, tmp_path / "out")
    assert first.name == "glyd-paris-co.md" and second.name == "glyd-paris-co-2.md"
    text = first.read_text()
    assert text.startswith("# Paris & co")
    assert "Be brief." in text and "## You\n\nCapital of France?" in text
    assert "## Assistant *(stopped)*\n\nParis." in text


def test_title_from_first_line() -> None:
    assert title_from("\n  Hello   world \nmore") == "Hello world"
    assert len(title_from("x" * 100)) == 48


def test_version_3_database_gets_a_search_index_of_what_it_already_holds(tmp_path: Path) -> None:
    path = tmp_path / "v3.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(";".join(MIGRATIONS[:3]) + "; PRAGMA user_version = 3;")
    db.execute("INSERT INTO chats (title, created, updated) VALUES ('Trip planning', 1, 1)")
    db.execute("INSERT INTO messages (chat_id, role, content, created) VALUES (1, 'user', 'Trains to Zürich?', 1)")
    db.commit()
    db.close()
    store = Store(path)
    assert store.version == SCHEMA_VERSION
    [hit] = store.search("zurich")  # accents folded, case ignored
    assert (hit.chat_id, hit.title, hit.matches) == (1, "Trip planning", 1)
    assert hit.snippet == f"Trains to {HIT_START}Zürich{HIT_END}?"
    assert [h.title for h in store.search("plan")] == ["Trip planning"]  # a title, by prefix


def test_search_follows_every_write(tmp_path: Path) -> None:
    """The index is kept by triggers: a streamed reply's updates, deletes and renames are found at once."""
    store = Store(tmp_path / "c.sqlite3")
    a = store.new_chat(title="Geography")
    store.add_message(a.id, "user", "What is the capital of France?")
    reply = store.add_message(a.id, "assistant", "", status="streaming")
    b = store.new_chat(title="Code")
    store.add_message(b.id, "user", 'my loop: for i in range(3) print(i) "AND" NEAR(x)')
    assert store.search("paris") == []
    store.update_message(reply.id, content="The capital of France is Paris.")
    [hit] = store.search("paris")
    assert (hit.chat_id, hit.message_id) == (a.id, reply.id)
    assert [(h.chat_id, h.matches) for h in store.search("capital fra")] == [(a.id, 2)]
    assert [h.chat_id for h in store.search('"AND" NEAR( *')] == [b.id]  # operators are words, not syntax
    assert store.search("   ") == [] and store.search("*()") == []
    store.rename_chat(b.id, "Python loops")
    assert [h.chat_id for h in store.search("pyth")] == [b.id]
    assert store.search("code") == []
    store.delete_message(reply.id)
    assert store.search("paris") == []
    store.delete_chat(a.id)
    assert store.search("capital") == [] and store.search("geography") == []


def test_export_is_written_atomically(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    chat = store.new_chat(title="x")
    out = tmp_path / "out"
    target = store.export_to(chat.id, out)
    assert target.read_text().startswith("# x") and sorted(p.name for p in out.iterdir()) == [target.name]
