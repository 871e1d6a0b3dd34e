"""The audit log: who did what to which target through the API, and when."""

from __future__ import annotations

import json
from typing import Any

from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import from_row, to_json
from trainguard.controller.views import AuditEntry


class AuditRepository:
    """The audit log rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def record(
        self, *, ts: float, actor: str, action: str, target: str, detail: dict[str, Any]
    ) -> int:
        with self._db.transaction() as c:
            cur = c.execute(
                "INSERT INTO audit_log (ts, actor, action, target, detail)"  # noqa: S608
                f" VALUES (?, ?, ?, ?, ?){self._db.dialect.returning_id}",
                (ts, actor, action, target, to_json(detail)),
            )
            return self._db.dialect.inserted_id(cur)

    def recent(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        """The newest `limit` entries (older than `before_id`: the next page), newest first."""
        if before_id is None:
            rows = self._db.query("SELECT * FROM audit_log ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._db.query(
                "SELECT * FROM audit_log WHERE id < ? ORDER BY id DESC LIMIT ?", (before_id, limit)
            )
        return [from_row(AuditEntry, r, detail=json.loads(r["detail"])) for r in rows]


__all__ = ["AuditRepository"]
