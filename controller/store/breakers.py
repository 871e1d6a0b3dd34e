"""The circuit breaker table (controller/safety.py): a rule whose automatic actions tripped
the breaker, when, on which incident and nodes."""

from __future__ import annotations

from collections.abc import Sequence

from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import to_json


class BreakerRepository:
    """The breaker rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def get(self, rule: str) -> tuple[float, int | None] | None:
        rows = self._db.query(
            "SELECT tripped_at, incident_id FROM breakers WHERE rule = ?", (rule,)
        )
        return (float(rows[0][0]), rows[0][1]) if rows else None

    def trip(self, rule: str, *, tripped_at: float, incident_id: int, nodes: Sequence[str]) -> None:
        with self._db.transaction() as c:
            c.execute(
                "INSERT INTO breakers (rule, tripped_at, incident_id, nodes) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (rule) DO UPDATE SET tripped_at = excluded.tripped_at,"
                " incident_id = excluded.incident_id, nodes = excluded.nodes",
                (rule, tripped_at, incident_id, to_json(sorted(nodes))),
            )


__all__ = ["BreakerRepository"]
