"""Stored responses of the Responses API, in SQLite (the standard library's sqlite3: an embedded database that
needs no server, survives a restart and takes concurrent readers; docs/design.md).

One row per response: its JSON as returned to the client, the input items it was asked with (with their ids),
and the id of the response it continued (`previous_response_id`). A conversation is the chain of those rows, read
back from the newest. The store keeps the newest `max_responses` rows; older ones are deleted as new ones come
(a chain that reaches a deleted response is then refused, naming it). All access is serialized by one lock: the
handlers call it from worker threads (`asyncio.to_thread`), never from the event loop.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

DEFAULT_MAX_RESPONSES = 10_000
MAX_CHAIN = 1_000  # responses followed back through previous_response_id; deeper is refused, never walked

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    previous_id TEXT,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


class ChainError(LookupError):
    """A previous_response_id that is not (or no longer) stored."""


class ResponseStore:
    def __init__(self, path: str | Path = ":memory:", max_responses: int = DEFAULT_MAX_RESPONSES):
        if str(path) != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            path = Path(path).expanduser()
        self.path, self.max_responses = str(path), max_responses
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL") if self.path != ":memory:" else None
        self._db.executescript(_SCHEMA)

    def put(self, response: dict, input_items: list[dict]) -> None:
        """Store (or replace) a response; then the oldest beyond `max_responses` go."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                             (response["id"], time.time(), response.get("previous_response_id"),
                              json.dumps(response, ensure_ascii=False), json.dumps(input_items, ensure_ascii=False)))
            self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC "
                             "LIMIT -1 OFFSET ?)", (self.max_responses,))

    def get(self, response_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT response FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def input_items(self, response_id: str) -> list[dict] | None:
        with self._lock:
            row = self._db.execute("SELECT input_items FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def conversation(self, response_id: str) -> list[dict]:
        """The items of the chain ending with `response_id`, oldest first: each response's input items, then its
        output items. ChainError names a response of the chain that is not stored."""
        chain, rid = [], response_id
        with self._lock:
            while rid is not None:
                if len(chain) >= MAX_CHAIN:
                    raise ChainError(f"the conversation is longer than {MAX_CHAIN} responses")
                row = self._db.execute("SELECT previous_id, response, input_items FROM responses WHERE id = ?",
                                       (rid,)).fetchone()
                if row is None:
                    raise ChainError(f"no stored response {rid!r}" + ("" if rid == response_id else
                                     f" (the conversation of {response_id!r} goes back to it)"))
                chain.append((json.loads(row[2]), json.loads(row[1])["output"]))
                rid = row[0]
        return [item for inputs, outputs in reversed(chain) for item in (*inputs, *outputs)]

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
