"""The event table: what the agents sent (deduplicated by node, agent instance and event
id). `insert` also completes the commands named by `command_result` events, in the same
transaction."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from trainguard.controller.records import CommandResultRow
from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import to_json


class EventRepository:
    """The event rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def max_event_id(self, node: str, instance: str) -> int:
        rows = self._db.query(
            "SELECT MAX(event_id) FROM events WHERE node = ? AND instance = ?", (node, instance)
        )
        value = rows[0][0]
        return 0 if value is None else int(value)

    def insert(
        self,
        node: str,
        instance: str,
        events: Sequence[tuple[int, str, float, dict[str, Any]]],
        *,
        command_results: Sequence[CommandResultRow] = (),
    ) -> None:
        """Store (event_id, kind, ts, body) rows (duplicates ignored) and complete commands
        named by `command_result` events, in one transaction."""
        now = self._db.now()
        with self._db.transaction() as c:
            c.executemany(
                "INSERT INTO events (node, instance, event_id, kind, ts, body,"
                " received_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [
                    (node, instance, eid, kind, ts, to_json(body), now)
                    for eid, kind, ts, body in events
                ],
            )
            c.executemany(
                "UPDATE commands SET done_at = ?, ok = ?, result = ?, data = ?"
                " WHERE id = ? AND node = ? AND done_at IS NULL",
                [
                    (now, int(r.ok), r.message, to_json(r.data), r.command_id, node)
                    for r in command_results
                ],
            )

    def count(self, node: str) -> int:
        return int(self._db.query("SELECT COUNT(*) FROM events WHERE node = ?", (node,))[0][0])

    def received_since(
        self, since: float, *, kinds: Collection[str]
    ) -> list[tuple[str, float, dict[str, Any]]]:
        """(node, received_at, event as sent) of the events of `kinds` received at or after
        `since`, in the order they were stored: what a restarted controller replays into its
        signal history before its first tick."""
        rows = self._db.query(
            "SELECT node, received_at, kind, body FROM events WHERE received_at >= ? ORDER BY id",
            (since,),
        )
        return [(str(r[0]), float(r[1]), json.loads(r[3])) for r in rows if r[2] in kinds]

    def of_node_since(
        self, node: str, since: float, *, kinds: Collection[str], limit: int = 200
    ) -> list[dict[str, Any]]:
        """The events of `kinds` that `node` sent, received at or after `since`, oldest first,
        at most `limit` (the newest): what the node lifecycle reads its repair from."""
        if not kinds:
            return []
        marks = ", ".join("?" for _ in kinds)  # placeholders only: the values are bound
        rows = self._db.query(
            f"SELECT body FROM events WHERE received_at >= ? AND node = ? AND kind IN ({marks})"  # noqa: S608
            " ORDER BY id DESC LIMIT ?",
            (since, node, *kinds, limit),
        )
        return [json.loads(r[0]) for r in reversed(rows)]


__all__ = ["EventRepository"]
