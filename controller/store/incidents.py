"""The incident table and each incident's timeline. At most one unresolved incident per
(rule, target) (a unique index); an incident is created with its first timeline entries, and
a state change adds its entry, in one transaction."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from trainguard.controller.store.connection import Row
from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import TIMELINE_INSERT, add_note, from_row, to_json
from trainguard.controller.views import IncidentView, TimelineEntry

# rule names about the GPU itself: their incidents count as hardware ones (controller.lemons)
_HARDWARE_RULE_PATTERNS = ("%xid%", "%ecc%", "%dbe%", "%gpu_lost%")


class IncidentRepository:
    """The incident rows and their timelines."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @staticmethod
    def _incident(row: Row) -> IncidentView:
        # the view's `target` is the key; the table's `target` column is the JSON target
        return from_row(IncidentView, row, target=row["target_key"])

    def create(
        self,
        *,
        rule: str,
        target_key: str,
        target: dict[str, Any],
        target_text: str,
        severity: str,
        summary: str,
        node: str | None,
        job: str | None,
        ts: float,
        timeline: Sequence[tuple[str, str, dict[str, Any]]],
    ) -> int:
        with self._db.transaction() as c:
            cur = c.execute(
                "INSERT INTO incidents (rule, target_key, target, target_text, severity, state,"
                " summary, node, job, opened_at, updated_at) VALUES"
                " (?, ?, ?, ?, ?, 'open', ?, ?, ?, ?, ?)" + self._db.dialect.returning_id,
                (
                    rule,
                    target_key,
                    to_json(target),
                    target_text,
                    severity,
                    summary,
                    node,
                    job,
                    ts,
                    ts,
                ),
            )
            incident_id = self._db.dialect.inserted_id(cur)
            c.executemany(
                TIMELINE_INSERT, [(incident_id, ts, k, m, to_json(d)) for k, m, d in timeline]
            )
        return incident_id

    def set_state(
        self,
        incident_id: int,
        state: str,
        *,
        ts: float,
        kind: str,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> None:
        with self._db.transaction() as c:
            c.execute(
                "UPDATE incidents SET state = ?, updated_at = ?,"
                " resolved_at = CASE WHEN ? = 'resolved' THEN ? ELSE resolved_at END"
                " WHERE id = ?",
                (state, ts, state, ts, incident_id),
            )
            add_note(
                c, incident_id, ts=ts, kind=kind, message=message, data=data or {}, touch=False
            )

    def add_timeline(
        self,
        incident_id: int,
        *,
        ts: float,
        kind: str,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> None:
        with self._db.transaction() as c:
            add_note(c, incident_id, ts=ts, kind=kind, message=message, data=data or {}, touch=True)

    def get(self, incident_id: int) -> IncidentView | None:
        rows = self._db.query("SELECT * FROM incidents WHERE id = ?", (incident_id,))
        return self._incident(rows[0]) if rows else None

    def target(self, incident_id: int) -> dict[str, Any]:
        rows = self._db.query("SELECT target FROM incidents WHERE id = ?", (incident_id,))
        return json.loads(rows[0][0]) if rows else {}

    def find(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        limit: int = 100,
        before_id: int | None = None,
    ) -> list[IncidentView]:
        where: list[str] = []
        args: list[object] = []
        if state is not None:
            where.append("state = ?")
            args.append(state)
        if node is not None:
            where.append("node = ?")
            args.append(node)
        if before_id is not None:  # the next page of a newest-first listing
            where.append("id < ?")
            args.append(before_id)
        sql = "SELECT * FROM incidents"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC LIMIT ?"
        return [self._incident(r) for r in self._db.query(sql, (*args, limit))]

    def unresolved(self) -> list[IncidentView]:
        rows = self._db.query("SELECT * FROM incidents WHERE state != 'resolved' ORDER BY id")
        return [self._incident(r) for r in rows]

    def last(self, rule: str, target_key: str) -> IncidentView | None:
        rows = self._db.query(
            "SELECT * FROM incidents WHERE rule = ? AND target_key = ? ORDER BY id DESC LIMIT 1",
            (rule, target_key),
        )
        return self._incident(rows[0]) if rows else None

    def nodes_tripping_rule(self, rule: str, *, since: float) -> set[str]:
        rows = self._db.query(
            "SELECT DISTINCT node FROM incidents WHERE rule = ? AND opened_at >= ?"
            " AND node IS NOT NULL",
            (rule, since),
        )
        return {r[0] for r in rows}

    def hardware_history(self, *, since: float, node: str | None = None) -> list[IncidentView]:
        """Hardware incidents opened at or after `since` (of `node`, else every node), oldest
        first: a node's incidents whose plan drains it, or whose rule is about the GPU itself
        (xid, ecc, gpu lost; controller.lemons counts them)."""
        rows = self._db.query(
            "SELECT i.* FROM incidents i WHERE i.node IS NOT NULL AND i.opened_at >= ?"
            " AND (? = '' OR i.node = ?)"
            " AND (EXISTS (SELECT 1 FROM actions a WHERE a.incident_id = i.id"
            " AND a.kind = 'drain') OR i.rule LIKE ? OR i.rule LIKE ? OR i.rule LIKE ?"
            " OR i.rule LIKE ?)"
            " ORDER BY i.opened_at, i.id",
            (since, node or "", node or "", *_HARDWARE_RULE_PATTERNS),
        )
        return [self._incident(r) for r in rows]

    def open_counts(self) -> dict[str, int]:
        """Unresolved incidents per node."""
        rows = self._db.query(
            "SELECT node, COUNT(*) FROM incidents WHERE state != 'resolved' AND node IS NOT NULL"
            " GROUP BY node"
        )
        return {r[0]: int(r[1]) for r in rows}

    def timeline(self, incident_id: int) -> list[TimelineEntry]:
        # by time, then insertion: the tick and the action worker stamp entries with the "now"
        # each read, so insertion order can trail time by the width of a race
        rows = self._db.query(
            "SELECT * FROM incident_timeline WHERE incident_id = ? ORDER BY ts, id", (incident_id,)
        )
        return [from_row(TimelineEntry, r, data=json.loads(r["data"])) for r in rows]


__all__ = ["IncidentRepository"]
