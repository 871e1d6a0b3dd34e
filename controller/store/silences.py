"""The silence table: operators' silences of a rule, a node or both, until they expire or are
deleted."""

from __future__ import annotations

from trainguard.controller.store.connection import Row
from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import from_row
from trainguard.controller.views import SilenceView


class SilenceRepository:
    """The silence rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @staticmethod
    def _silence(row: Row, now: float) -> SilenceView:
        active = row["deleted_at"] is None and row["expires_at"] > now
        return from_row(SilenceView, row, active=active)

    def add(
        self,
        *,
        rule: str | None,
        node: str | None,
        created_by: str,
        created_at: float,
        expires_at: float,
        comment: str,
    ) -> SilenceView:
        with self._db.transaction() as c:
            cur = c.execute(
                "INSERT INTO silences (rule, node, created_by, created_at, expires_at, comment)"  # noqa: S608
                f" VALUES (?, ?, ?, ?, ?, ?){self._db.dialect.returning_id}",
                (rule, node, created_by, created_at, expires_at, comment),
            )
            silence_id = self._db.dialect.inserted_id(cur)
        rows = self._db.query("SELECT * FROM silences WHERE id = ?", (silence_id,))
        return self._silence(rows[0], created_at)

    def find(self, *, now: float, include_expired: bool) -> list[SilenceView]:
        rows = self._db.query("SELECT * FROM silences ORDER BY id")
        out = [self._silence(r, now) for r in rows]
        return out if include_expired else [s for s in out if s.active]

    def delete(self, silence_id: int, *, now: float) -> bool:
        with self._db.transaction() as c:
            cur = c.execute(
                "UPDATE silences SET deleted_at = ? WHERE id = ? AND deleted_at IS NULL",
                (now, silence_id),
            )
            return cur.rowcount == 1


__all__ = ["SilenceRepository"]
