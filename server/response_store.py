"""Stored responses (`store: true`) in SQLite: each response's body, the input items it was
generated from (the whole conversation so far, so a continuation needs one read), its owner
(a hash of the API key that created it: another key's id reads as missing) and the
conversation it belongs to (its first response's id: the session whose KV is offloaded when it
goes idle). Bounded by count and by age; with a file path it survives restarts, beside the disk
KV tier that keeps the conversation's KV."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    conversation TEXT NOT NULL,
    created_at REAL NOT NULL,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    conversation: str
    body: dict[str, Any]
    input_items: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, path: str, max_responses: int, max_age_s: float) -> None:
        self.path = path or ":memory:"
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        # one connection, used from the event loop (and tests): a lock keeps it honest
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)

    @classmethod
    def for_server(
        cls, responses_db: str, disk_path: str, max_responses: int, max_age_s: float
    ) -> ResponseStore:
        """The server's store: `responses_db`, else beside the disk KV tier, else in memory."""
        path = responses_db
        if not path and disk_path:
            path = f"{disk_path.rstrip('/')}/responses.sqlite3"
        if path:  # the disk tier makes its directory later, when the engine loads
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        return cls(path, max_responses, max_age_s)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _oldest_allowed(self) -> float:
        return time.time() - self.max_age_s if self.max_age_s > 0 else float("-inf")

    def put(
        self,
        owner: str,
        conversation: str,
        body: dict[str, Any],
        input_items: list[dict[str, Any]],
    ) -> None:
        row = (
            body["id"],
            owner,
            conversation,
            time.time(),
            json.dumps(body),
            json.dumps(input_items),
        )
        with self._lock, self._db:  # the row and the pruning it triggers: one commit
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
            self._db.execute(
                "DELETE FROM responses WHERE created_at < ?", (self._oldest_allowed(),)
            )
            if self.max_responses > 0:
                self._db.execute(
                    "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                    "ORDER BY created_at DESC LIMIT -1 OFFSET ?)",
                    (self.max_responses,),
                )

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT conversation, body, input_items FROM responses "
                "WHERE id = ? AND owner = ? AND created_at >= ?",
                (response_id, owner, self._oldest_allowed()),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(response_id, row[0], json.loads(row[1]), json.loads(row[2]))

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock, self._db:  # commits
            cur = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            )
        return cur.rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])
