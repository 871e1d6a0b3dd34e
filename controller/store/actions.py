"""The action table: every remediation step, written as intent before it runs (idempotent by
key), moved through pending, running and a final state. A step's row and the timeline entry of
its incident are written in one transaction."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from trainguard.controller.records import NewAction
from trainguard.controller.store.connection import Row
from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import TIMELINE_INSERT, add_note, from_row, to_json
from trainguard.controller.views import ActionView


class ActionRepository:
    """The action rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @staticmethod
    def _action(row: Row) -> ActionView:
        return from_row(ActionView, row, params=json.loads(row["params"]))

    def add(
        self,
        incident_id: int | None,
        actions: Sequence[NewAction],
        *,
        ts: float,
        timeline: Sequence[tuple[str, str, dict[str, Any]]] = (),
    ) -> list[int]:
        """Insert the intent rows (duplicates by idempotency key are ignored) plus timeline
        notes, in one transaction. Returns the ids of the rows for these keys."""
        ids: list[int] = []
        with self._db.transaction() as c:
            for a in actions:
                c.execute(
                    "INSERT INTO actions (incident_id, seq, kind, target, params, state,"
                    " idempotency_key, next_attempt_at, result, created_at, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (
                        incident_id,
                        a.seq,
                        a.kind,
                        a.target,
                        to_json(a.params),
                        a.state,
                        a.idempotency_key,
                        ts,
                        a.result,
                        ts,
                        ts,
                    ),
                )
                row = c.execute(
                    "SELECT id FROM actions WHERE idempotency_key = ?", (a.idempotency_key,)
                ).fetchone()
                ids.append(int(row[0]))
            if incident_id is not None:
                c.executemany(
                    TIMELINE_INSERT, [(incident_id, ts, k, m, to_json(d)) for k, m, d in timeline]
                )
        return ids

    def get(self, action_id: int) -> ActionView | None:
        rows = self._db.query("SELECT * FROM actions WHERE id = ?", (action_id,))
        return self._action(rows[0]) if rows else None

    def by_key(self, idempotency_key: str) -> ActionView | None:
        rows = self._db.query("SELECT * FROM actions WHERE idempotency_key = ?", (idempotency_key,))
        return self._action(rows[0]) if rows else None

    def last_shrink_incident(self, job: str) -> int | None:
        """The incident whose replace or restart step last shrank `job`'s world size (output
        mode "shrink_world"), or None."""
        field = self._db.dialect.json_text
        rows = self._db.query(
            "SELECT incident_id FROM actions WHERE incident_id IS NOT NULL"  # noqa: S608
            f" AND kind IN ('replace', 'restart') AND {field('output', 'job')} = ?"
            f" AND ({field('output', 'mode')} = 'shrink_world'"
            f" OR {field('output', 'replaced', 'mode')} = 'shrink_world')"
            " ORDER BY id DESC LIMIT 1",
            (job,),
        )
        return int(rows[0][0]) if rows else None

    def restarts_of(
        self, job: str, *, since: float, limit: int
    ) -> list[tuple[ActionView, dict[str, Any]]]:
        """The newest `limit` restart and rollback rows of `job` (by the job their output
        names) created at or after `since`, with their outputs, oldest first (the restart-loop
        breaker reads what each resumed from)."""
        field = self._db.dialect.json_text
        rows = self._db.query(
            "SELECT * FROM actions WHERE kind IN ('restart', 'rollback')"  # noqa: S608
            f" AND {field('output', 'job')} = ? AND created_at >= ?"
            " ORDER BY id DESC LIMIT ?",
            (job, since, limit),
        )
        return [(self._action(r), json.loads(r["output"])) for r in reversed(rows)]

    def last_drain(self, node: str) -> ActionView | None:
        """The newest drain row of `node` that was not skipped or failed (an incident's or an
        operator's)."""
        rows = self._db.query(
            "SELECT * FROM actions WHERE kind = 'drain' AND target = ?"
            " AND state IN ('pending', 'running', 'succeeded') ORDER BY id DESC LIMIT 1",
            (node,),
        )
        return self._action(rows[0]) if rows else None

    def recoveries(self, job: str, *, since: float, limit: int = 20) -> list[dict[str, Any]]:
        """The outputs of `job`'s restart and rollback steps of incidents (not a start or an
        operator's restart) that succeeded since `since`, newest first (each holds the phases
        measured, `phases_s`, and `lost_steps`)."""
        field = self._db.dialect.json_text
        rows = self._db.query(
            "SELECT output FROM actions WHERE incident_id IS NOT NULL"  # noqa: S608
            " AND kind IN ('restart', 'rollback')"
            f" AND state = 'succeeded' AND {field('output', 'job')} = ? AND updated_at >= ?"
            " ORDER BY id DESC LIMIT ?",
            (job, since, limit),
        )
        return [json.loads(r[0]) for r in rows if r[0]]

    def output(self, action_id: int) -> dict[str, Any]:
        rows = self._db.query("SELECT output FROM actions WHERE id = ?", (action_id,))
        return json.loads(rows[0][0]) if rows else {}

    def for_incident(self, incident_id: int) -> list[ActionView]:
        rows = self._db.query(
            "SELECT * FROM actions WHERE incident_id = ? ORDER BY seq, id", (incident_id,)
        )
        return [self._action(r) for r in rows]

    def open(self) -> list[tuple[ActionView, float]]:
        """Pending and running rows with their next_attempt_at, oldest first."""
        rows = self._db.query(
            "SELECT * FROM actions WHERE state IN ('pending', 'running') ORDER BY id"
        )
        return [(self._action(r), float(r["next_attempt_at"])) for r in rows]

    def next_attempt_at(self, action_id: int) -> float:
        rows = self._db.query("SELECT next_attempt_at FROM actions WHERE id = ?", (action_id,))
        return float(rows[0][0])

    def update(
        self,
        action_id: int,
        *,
        state: str,
        ts: float,
        result: str | None = None,
        output: dict[str, Any] | None = None,
        attempts_delta: int = 0,
        next_attempt_at: float | None = None,
        timeline: tuple[int, str, str, dict[str, Any]] | None = None,
    ) -> None:
        """Move one action row (and optionally add an incident timeline entry), atomically."""
        sets = ["state = ?", "updated_at = ?", "attempts = attempts + ?"]
        args: list[Any] = [state, ts, attempts_delta]
        if result is not None:
            sets.append("result = ?")
            args.append(result)
        if output is not None:
            sets.append("output = ?")
            args.append(to_json(output))
        if next_attempt_at is not None:
            sets.append("next_attempt_at = ?")
            args.append(next_attempt_at)
        with self._db.transaction() as c:
            c.execute(
                f"UPDATE actions SET {', '.join(sets)} WHERE id = ?",  # noqa: S608
                (*args, action_id),
            )
            if timeline is not None:
                incident_id, kind, message, data = timeline
                add_note(c, incident_id, ts=ts, kind=kind, message=message, data=data, touch=True)

    def recent_of(self, kind: str, *, target: str, limit: int = 1) -> list[ActionView]:
        """The newest `limit` rows of `kind` on `target`, newest first (an auto job's interval
        decisions)."""
        rows = self._db.query(
            "SELECT * FROM actions WHERE kind = ? AND target = ? ORDER BY id DESC LIMIT ?",
            (kind, target, limit),
        )
        return [self._action(r) for r in rows]

    def count_auto_drains(self, *, since: float) -> int:
        """Automatic (incident-driven) drains that were not skipped/failed since `since`."""
        rows = self._db.query(
            "SELECT COUNT(*) FROM actions WHERE kind = 'drain' AND incident_id IS NOT NULL"
            " AND state IN ('pending', 'running', 'succeeded') AND created_at >= ?",
            (since,),
        )
        return int(rows[0][0])

    def count_keyed_since(self, prefix: str, *, since: float) -> int:
        """Rows whose idempotency key starts with `prefix`, created at or after `since` and not
        skipped (the node lifecycle's reboot rate limit counts its reboot steps this way)."""
        rows = self._db.query(
            "SELECT COUNT(*) FROM actions WHERE idempotency_key LIKE ? ESCAPE '\\'"
            " AND created_at >= ? AND state != 'skipped'",
            (_like_prefix(prefix), since),
        )
        return int(rows[0][0])

    def succeeded_at(self, kind: str, *, since: float) -> dict[str, float]:
        """target -> when its newest succeeded `kind` step finished, for steps that finished
        at or after `since` (a restarted controller's replay starts a validated node's signal
        windows over at its validation)."""
        rows = self._db.query(
            "SELECT target, MAX(updated_at) FROM actions WHERE kind = ?"
            " AND state = 'succeeded' AND updated_at >= ? GROUP BY target",
            (kind, since),
        )
        return {str(r[0]): float(r[1]) for r in rows}

    def failed_keyed(
        self, prefix: str, *, since: float, target: str | None = None
    ) -> list[ActionView]:
        """Failed rows whose idempotency key starts with `prefix`, created at or after `since`
        (of `target`, else every target), oldest first."""
        rows = self._db.query(
            "SELECT * FROM actions WHERE idempotency_key LIKE ? ESCAPE '\\'"
            " AND created_at >= ? AND state = 'failed' AND (? = '' OR target = ?)"
            " ORDER BY id",
            (_like_prefix(prefix), since, target or "", target or ""),
        )
        return [self._action(r) for r in rows]


def _like_prefix(prefix: str) -> str:
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


__all__ = ["ActionRepository"]
