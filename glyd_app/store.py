"""Conversations, per-chat settings and the user's model directories, in SQLite under the data dir.

The schema is versioned with `PRAGMA user_version`; `MIGRATIONS[i]` takes a database from version i
to i+1, so an old file is upgraded in place on open and a newer one is refused (rather than damaged).
Every write commits at once: a crash loses at most the reply being streamed, which the chat screen
saves as it goes.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glyd_engine import paths
from glyd_engine.atomic import atomic_write_bytes

MIGRATIONS: list[str] = [
    # 0 -> 1: chats and their messages
    """
    CREATE TABLE chats (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        model TEXT NOT NULL DEFAULT '',
        system_prompt TEXT NOT NULL DEFAULT '',
        temperature REAL NOT NULL DEFAULT 0.7,
        top_p REAL NOT NULL DEFAULT 0.95,
        max_tokens INTEGER NOT NULL DEFAULT 512,
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        created REAL NOT NULL
    );
    CREATE INDEX messages_chat ON messages(chat_id, id);
    """,
    # 1 -> 2: reply status and numbers; model directories the user added; small app state
    """
    ALTER TABLE messages ADD COLUMN status TEXT NOT NULL DEFAULT 'done';
    ALTER TABLE messages ADD COLUMN stats TEXT NOT NULL DEFAULT '';
    ALTER TABLE messages ADD COLUMN model TEXT NOT NULL DEFAULT '';
    CREATE TABLE model_dirs (path TEXT PRIMARY KEY, added REAL NOT NULL);
    CREATE TABLE state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
    # 2 -> 3: temperature and top-p may be NULL (the model's own default, from its generation_config.json),
    # a seed per chat (NULL: a fresh one every reply). Chats still at the old fixed defaults (0.7, 0.95),
    # which no user chose, take the model's. SQLite cannot relax NOT NULL in place: the table is rebuilt
    # (foreign keys are off meanwhile, see migrate(), so the messages stay).
    """
    CREATE TABLE chats_new (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        model TEXT NOT NULL DEFAULT '',
        system_prompt TEXT NOT NULL DEFAULT '',
        temperature REAL,
        top_p REAL,
        max_tokens INTEGER NOT NULL DEFAULT 512,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        seed INTEGER
    );
    INSERT INTO chats_new (id, title, model, system_prompt, temperature, top_p, max_tokens, created, updated)
        SELECT id, title, model, system_prompt, NULLIF(temperature, 0.7), NULLIF(top_p, 0.95), max_tokens,
               created, updated FROM chats;
    DROP TABLE chats;
    ALTER TABLE chats_new RENAME TO chats;
    """,
    # 3 -> 4: full-text search over chat titles and message text (FTS5, external content). Triggers keep the
    # indexes in step with every write, whoever makes it; the rebuilds index what older versions stored.
    """
    CREATE VIRTUAL TABLE messages_fts USING fts5(
        content, content='messages', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
    CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    END;
    CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END;
    INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');
    CREATE VIRTUAL TABLE chats_fts USING fts5(
        title, content='chats', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
    CREATE TRIGGER chats_fts_insert AFTER INSERT ON chats BEGIN
        INSERT INTO chats_fts(rowid, title) VALUES (new.id, new.title);
    END;
    CREATE TRIGGER chats_fts_delete AFTER DELETE ON chats BEGIN
        INSERT INTO chats_fts(chats_fts, rowid, title) VALUES ('delete', old.id, old.title);
    END;
    CREATE TRIGGER chats_fts_update AFTER UPDATE OF title ON chats BEGIN
        INSERT INTO chats_fts(chats_fts, rowid, title) VALUES ('delete', old.id, old.title);
        INSERT INTO chats_fts(rowid, title) VALUES (new.id, new.title);
    END;
    INSERT INTO chats_fts(chats_fts) VALUES ('rebuild');
    """,
    # 4 -> 5: text files attached to a user message (their text goes to the model with the message)
    """
    CREATE TABLE attachments (
        id INTEGER PRIMARY KEY,
        message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        content TEXT NOT NULL,
        tokens INTEGER NOT NULL,
        created REAL NOT NULL
    );
    CREATE INDEX attachments_message ON attachments(message_id, id);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


class StoreError(Exception):
    pass


# Marks around the matched words in a search snippet (control characters: never in a user's text as typed)
HIT_START, HIT_END = "\x02", "\x03"


@dataclass(frozen=True)
class SearchHit:
    """A chat that matches a search: its best matching message (None where only the title matched)."""

    chat_id: int
    title: str
    updated: float
    message_id: int | None
    snippet: str  # the matching text, words that matched between HIT_START and HIT_END
    matches: int  # messages of this chat that match


def fts_query(text: str) -> str:
    """A user's words as an FTS5 query: every word must appear (as a prefix), quotes and operators taken
    literally, so no input is a syntax error."""
    words = re.findall(r"\w+", text, flags=re.UNICODE)
    return " ".join('"' + w.replace('"', '""') + '"*' for w in words)


@dataclass
class Chat:
    id: int
    title: str
    model: str = ""
    system_prompt: str = ""
    temperature: float | None = None  # None: the model's own default
    top_p: float | None = None
    max_tokens: int = 512
    created: float = 0.0
    updated: float = 0.0
    seed: int | None = None  # None: a fresh seed for every reply


@dataclass
class StoredMessage:
    id: int
    chat_id: int
    role: str  # user | assistant | system
    content: str
    created: float = 0.0
    status: str = "done"  # done | stopped | interrupted | streaming
    stats: dict[str, Any] = field(default_factory=dict)
    model: str = ""


@dataclass(frozen=True)
class StoredAttachment:
    id: int
    message_id: int
    name: str
    content: str
    tokens: int  # as counted when attached (glyd_app.attachments says how)
    created: float = 0.0


def db_path() -> Path:
    return paths.data_dir() / "chats.sqlite3"


class Store:
    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The UI thread owns the connection; writes are tiny and commit at once.
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.migrate()

    def migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} was written by a newer glyd (schema {version} > {SCHEMA_VERSION}); "
                "upgrade glyd or move the file away"
            )
        if version == SCHEMA_VERSION:
            return
        # A migration may rebuild a table that others reference; with foreign keys on, dropping it would
        # cascade. The pragma has no effect inside a transaction, so it is switched around them.
        self.db.execute("PRAGMA foreign_keys = OFF")
        try:
            for target in range(version, SCHEMA_VERSION):
                with self.db:
                    self.db.executescript("BEGIN;" + MIGRATIONS[target] + f"; PRAGMA user_version = {target + 1};")
        finally:
            self.db.execute("PRAGMA foreign_keys = ON")

    @property
    def version(self) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------ chats

    def new_chat(self, title: str = "New chat", model: str = "", **settings: Any) -> Chat:
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO chats (title, model, created, updated) VALUES (?, ?, ?, ?)",
                (title, model, now, now),
            )
        chat = self.chat(int(cur.lastrowid or 0))
        if settings:
            self.update_chat(chat.id, **settings)
            chat = self.chat(chat.id)
        return chat

    def chat(self, chat_id: int) -> Chat:
        row = self.db.execute("SELECT * FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise StoreError(f"no chat {chat_id}")
        return Chat(**dict(row))

    def chats(self) -> list[Chat]:
        rows = self.db.execute("SELECT * FROM chats ORDER BY updated DESC, id DESC").fetchall()
        return [Chat(**dict(r)) for r in rows]

    def update_chat(self, chat_id: int, **fields: Any) -> None:
        allowed = {"title", "model", "system_prompt", "temperature", "top_p", "max_tokens", "seed"}
        bad = set(fields) - allowed
        if bad:
            raise StoreError(f"unknown chat fields {sorted(bad)}")
        if not fields:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.db:
            self.db.execute(
                f"UPDATE chats SET {sets}, updated = ? WHERE id = ?", (*fields.values(), time.time(), chat_id)
            )

    def rename_chat(self, chat_id: int, title: str) -> None:
        self.update_chat(chat_id, title=title.strip() or "Untitled")

    def delete_chat(self, chat_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    # ------------------------------------------------------------------ messages

    def add_message(
        self,
        chat_id: int,
        role: str,
        content: str,
        status: str = "done",
        stats: dict[str, Any] | None = None,
        model: str = "",
    ) -> StoredMessage:
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO messages (chat_id, role, content, created, status, stats, model) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, now, status, json.dumps(stats or {}), model),
            )
            self.db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        return self.message(int(cur.lastrowid or 0))

    def update_message(
        self,
        message_id: int,
        content: str | None = None,
        status: str | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        sets, values = [], []
        for name, value in (
            ("content", content),
            ("status", status),
            ("stats", None if stats is None else json.dumps(stats)),
        ):
            if value is not None:
                sets.append(f"{name} = ?")
                values.append(value)
        if sets:
            with self.db:
                self.db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*values, message_id))

    def message(self, message_id: int) -> StoredMessage:
        row = self.db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise StoreError(f"no message {message_id}")
        return _message(row)

    def messages(self, chat_id: int) -> list[StoredMessage]:
        rows = self.db.execute("SELECT * FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)).fetchall()
        return [_message(r) for r in rows]

    def add_attachment(self, message_id: int, name: str, content: str, tokens: int) -> StoredAttachment:
        with self.db:
            cur = self.db.execute(
                "INSERT INTO attachments (message_id, name, content, tokens, created) VALUES (?, ?, ?, ?, ?)",
                (message_id, name, content, tokens, time.time()),
            )
        return StoredAttachment(int(cur.lastrowid or 0), message_id, name, content, tokens)

    def attachments(self, chat_id: int) -> dict[int, list[StoredAttachment]]:
        """Each message's attachments (message id -> in the order attached), for one chat."""
        rows = self.db.execute(
            "SELECT a.* FROM attachments a JOIN messages m ON m.id = a.message_id WHERE m.chat_id = ? "
            "ORDER BY a.message_id, a.id", (chat_id,)).fetchall()
        found: dict[int, list[StoredAttachment]] = {}
        for r in rows:
            found.setdefault(r["message_id"], []).append(StoredAttachment(**dict(r)))
        return found

    def delete_message(self, message_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    # ------------------------------------------------------------------ models and state

    def add_model_dir(self, path: str | Path) -> None:
        with self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO model_dirs (path, added) VALUES (?, ?)",
                (str(Path(path).expanduser().resolve()), time.time()),
            )

    def remove_model_dir(self, path: str | Path) -> None:
        with self.db:
            self.db.execute("DELETE FROM model_dirs WHERE path = ?", (str(path),))

    def model_dirs(self) -> list[Path]:
        return [Path(r[0]) for r in self.db.execute("SELECT path FROM model_dirs ORDER BY added")]

    def get_state(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return default if row is None else str(row[0])

    def set_state(self, key: str, value: str) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO state (key, value) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------------ export

    def export_markdown(self, chat_id: int) -> str:
        chat = self.chat(chat_id)
        lines = [f"# {chat.title}", ""]
        meta = [
            f"model: {chat.model or 'demo'}",
            "temperature " + ("model default" if chat.temperature is None else f"{chat.temperature:g}"),
            "top-p " + ("model default" if chat.top_p is None else f"{chat.top_p:g}"),
            f"max tokens {chat.max_tokens}",
        ]
        lines += [f"*{' · '.join(meta)}*", ""]
        if chat.system_prompt:
            lines += ["**System:**", "", chat.system_prompt, ""]
        for m in self.messages(chat_id):
            who = {"user": "You", "assistant": "Assistant"}.get(m.role, m.role.title())
            note = "" if m.status == "done" else f" *({m.status})*"
            lines += [f"## {who}{note}", "", m.content.rstrip(), ""]
        return "\n".join(lines).rstrip() + "\n"

    def export_to(self, chat_id: int, directory: Path) -> Path:
        """Write the chat as Markdown into `directory`, never overwriting an earlier export."""
        title = self.chat(chat_id).title
        slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:48] or "chat"
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"glyd-{slug}.md"
        n = 2
        while target.exists():
            target = directory / f"glyd-{slug}-{n}.md"
            n += 1
        atomic_write_bytes(target, self.export_markdown(chat_id).encode("utf-8"))
        return target

    # ------------------------------------------------------------------ search

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Chats whose title or messages contain every word of `text` (prefixes match, case and accents are
        ignored), best match first; each with a snippet of its best matching message."""
        query = fts_query(text)
        if not query:
            return []
        rows = self.db.execute(
            f"""
            WITH hits AS (
                SELECT m.chat_id, m.id AS message_id, bm25(messages_fts) AS rank,
                       snippet(messages_fts, 0, '{HIT_START}', '{HIT_END}', '…', 12) AS snippet
                FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid
                WHERE messages_fts MATCH ?
            ), titled AS (
                SELECT rowid AS chat_id, bm25(chats_fts) AS rank FROM chats_fts WHERE chats_fts MATCH ?
            ), best AS (
                SELECT chat_id, message_id, snippet, rank, COUNT(*) OVER (PARTITION BY chat_id) AS n,
                       ROW_NUMBER() OVER (PARTITION BY chat_id ORDER BY rank, message_id) AS k
                FROM hits
            )
            SELECT c.id, c.title, c.updated, b.message_id, COALESCE(b.snippet, '') AS snippet,
                   COALESCE(b.n, 0) AS n,
                   MIN(COALESCE(b.rank, 0), COALESCE(t.rank, 0)) + (CASE WHEN t.chat_id IS NULL THEN 0 ELSE -100 END)
                       AS score
            FROM chats c
            LEFT JOIN best b ON b.chat_id = c.id AND b.k = 1
            LEFT JOIN titled t ON t.chat_id = c.id
            WHERE b.chat_id IS NOT NULL OR t.chat_id IS NOT NULL
            ORDER BY score, c.updated DESC
            LIMIT ?
            """,
            (query, query, limit),
        ).fetchall()
        return [SearchHit(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]

    def __iter__(self) -> Iterator[Chat]:
        return iter(self.chats())


def _message(row: sqlite3.Row) -> StoredMessage:
    data = dict(row)
    try:
        data["stats"] = json.loads(data.get("stats") or "{}")
    except ValueError:
        data["stats"] = {}
    return StoredMessage(**data)


def title_from(text: str, limit: int = 48) -> str:
    """A chat's default title: the first line of its first message."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "New chat")
    first = re.sub(r"\s+", " ", first)
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"
