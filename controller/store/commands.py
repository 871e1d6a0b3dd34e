"""The command table: commands queued for an agent (idempotent by id), their delivery and
result."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from trainguard.controller.records import CommandRecord
from trainguard.controller.store.connection import Row
from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import from_row, to_json


class CommandRepository:
    """The command rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @staticmethod
    def _command(row: Row) -> CommandRecord:
        return from_row(
            CommandRecord,
            row,
            args=json.loads(row["args"]),
            ok=None if row["ok"] is None else bool(row["ok"]),
            data=json.loads(row["data"]),
        )

    def add(self, command_id: str, *, node: str, kind: str, args: dict[str, Any]) -> bool:
        """Queue a command; False if this id already exists (idempotent by id)."""
        with self._db.transaction() as c:
            cur = c.execute(
                "INSERT INTO commands (id, node, kind, args, created_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (command_id, node, kind, to_json(args), self._db.now()),
            )
            return cur.rowcount == 1

    def get(self, command_id: str) -> CommandRecord | None:
        rows = self._db.query("SELECT * FROM commands WHERE id = ?", (command_id,))
        return self._command(rows[0]) if rows else None

    def last_done(self, node: str, *, kind: str) -> CommandRecord | None:
        """The node's most recently finished command of `kind` (its last preflight), if the
        retention has kept one."""
        rows = self._db.query(
            "SELECT * FROM commands WHERE node = ? AND kind = ? AND done_at IS NOT NULL"
            " ORDER BY done_at DESC LIMIT 1",
            (node, kind),
        )
        return self._command(rows[0]) if rows else None

    def pending(self, node: str | None = None) -> list[CommandRecord]:
        if node is None:
            rows = self._db.query(
                "SELECT * FROM commands WHERE done_at IS NULL ORDER BY created_at"
            )
        else:
            rows = self._db.query(
                "SELECT * FROM commands WHERE done_at IS NULL AND node = ? ORDER BY created_at",
                (node,),
            )
        return [self._command(r) for r in rows]

    def mark_delivered(self, command_ids: Sequence[str]) -> None:
        with self._db.transaction() as c:
            c.executemany(
                "UPDATE commands SET delivered_at = ? WHERE id = ? AND delivered_at IS NULL",
                [(self._db.now(), cid) for cid in command_ids],
            )

    def finish(self, command_id: str, *, ok: bool, result: str) -> bool:
        with self._db.transaction() as c:
            cur = c.execute(
                "UPDATE commands SET done_at = ?, ok = ?, result = ?"
                " WHERE id = ? AND done_at IS NULL",
                (self._db.now(), int(ok), result, command_id),
            )
            return cur.rowcount == 1


__all__ = ["CommandRepository"]
