"""Retention: the `expire_*` methods delete one bounded batch of old rows each (one
transaction, so the API and the tick wait for one batch at most). What is kept whatever its
age is what a later decision still reads (an unresolved incident's evidence, a job's current
attempt, a drained node's drain). controller/maintenance.py decides when and how much; the
same on SQLite and PostgreSQL."""

from __future__ import annotations

from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import to_json

# What a resolved incident must not be deleted with: a step not in a final state, the step
# that began a job's current attempt (the job attributes its attempt to that incident), a
# circuit breaker's incident, a drain of a node still out of service (undrain and the
# correlation of later faults look that drain up).
_INCIDENT_EXPIRED = """
    i.state = 'resolved' AND COALESCE(i.resolved_at, i.updated_at) < :cutoff
    AND NOT EXISTS (SELECT 1 FROM actions a WHERE a.incident_id = i.id
                    AND a.state NOT IN ('succeeded', 'failed', 'skipped'))
    AND NOT EXISTS (SELECT 1 FROM actions a JOIN jobs j ON j.attempt_key = a.idempotency_key
                    WHERE a.incident_id = i.id)
    AND NOT EXISTS (SELECT 1 FROM breakers b WHERE b.incident_id = i.id)
    AND NOT EXISTS (SELECT 1 FROM actions a JOIN nodes n ON n.name = a.target
                    WHERE a.incident_id = i.id AND a.kind = 'drain' AND n.state != 'active')
"""


class RetentionRepository:
    """Deletes of old rows, one batch per call."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def expire_events(self, *, now: float, max_age_s: float, limit: int) -> int:
        """Delete up to `limit` events received more than `max_age_s` before `now`, oldest
        first, in one transaction; returns how many. Kept whatever their age: the events of a
        node with an unresolved incident received within `max_age_s` before that incident
        opened (its evidence: the age counts from the opening while it is unresolved), and
        each node's newest event of its current agent instance (the high-water mark a restarted
        controller acknowledges from, `max_event_id`)."""
        with self._db.transaction() as c:
            cur = c.execute(
                """
                DELETE FROM events WHERE id IN (
                    SELECT e.id FROM events e LEFT JOIN (
                        SELECT node, MIN(opened_at) - :age AS since FROM incidents
                        WHERE state != 'resolved' AND node IS NOT NULL GROUP BY node
                    ) h ON h.node = e.node
                    WHERE e.received_at < :cutoff
                    AND (h.node IS NULL OR e.received_at < h.since)
                    AND NOT EXISTS (
                        SELECT 1 FROM nodes n WHERE n.name = e.node AND n.instance = e.instance
                        AND NOT EXISTS (
                            SELECT 1 FROM events m WHERE m.node = e.node
                            AND m.instance = e.instance AND m.event_id > e.event_id
                        )
                    )
                    ORDER BY e.received_at LIMIT :limit
                )
                """,
                {"age": max_age_s, "cutoff": now - max_age_s, "limit": limit},
            )
            return cur.rowcount

    def expire_commands(self, *, now: float, max_age_s: float, limit: int) -> int:
        """Delete up to `limit` finished commands whose result came more than `max_age_s`
        before `now`; a command still waiting for its result is never deleted."""
        with self._db.transaction() as c:
            cur = c.execute(
                "DELETE FROM commands WHERE id IN (SELECT id FROM commands"
                " WHERE done_at IS NOT NULL AND done_at < ? ORDER BY done_at LIMIT ?)",
                (now - max_age_s, limit),
            )
            return cur.rowcount

    def expire_incidents(self, *, now: float, max_age_s: float, limit: int) -> dict[str, int]:
        """Delete resolved incidents resolved more than `max_age_s` before `now`, each with its
        timeline and actions, in one transaction of about `limit` rows (whole incidents: one
        larger than `limit` goes alone). Never an unresolved incident, nor one holding a step
        that is not final (see _INCIDENT_EXPIRED). Returns rows deleted per table."""
        with self._db.transaction() as c:
            rows = c.execute(
                f"""
                SELECT i.id,
                    (SELECT COUNT(*) FROM incident_timeline t WHERE t.incident_id = i.id)
                    + (SELECT COUNT(*) FROM actions a WHERE a.incident_id = i.id) + 1
                FROM incidents i WHERE {_INCIDENT_EXPIRED} ORDER BY i.id LIMIT :limit
                """,  # noqa: S608 (a constant of this module)
                {"cutoff": now - max_age_s, "limit": limit},
            ).fetchall()
            ids: list[int] = []
            total = 0
            for incident_id, n in rows:
                if ids and total + int(n) > limit:
                    break
                ids.append(int(incident_id))
                total += int(n)
            if not ids:
                return {"incidents": 0, "incident_timeline": 0, "actions": 0}
            chosen = (to_json(ids),)
            id_list = self._db.dialect.id_list()
            timeline = c.execute(
                f"DELETE FROM incident_timeline WHERE incident_id IN {id_list}",  # noqa: S608
                chosen,
            ).rowcount
            actions = c.execute(
                f"DELETE FROM actions WHERE incident_id IN {id_list}",  # noqa: S608
                chosen,
            ).rowcount
            incidents = c.execute(
                f"DELETE FROM incidents WHERE id IN {id_list}",  # noqa: S608
                chosen,
            ).rowcount
        return {"incidents": incidents, "incident_timeline": timeline, "actions": actions}

    def expire_operator_actions(self, *, now: float, max_age_s: float, limit: int) -> int:
        """Delete up to `limit` steps of no incident (operator drains, job submissions and
        restarts) in a final state, last changed more than `max_age_s` before `now`. Kept: the
        step that began a job's current attempt and a drain of a node still out of service."""
        with self._db.transaction() as c:
            cur = c.execute(
                """
                DELETE FROM actions WHERE id IN (
                    SELECT a.id FROM actions a
                    WHERE a.incident_id IS NULL AND a.state IN ('succeeded', 'failed', 'skipped')
                    AND a.updated_at < ?
                    AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.attempt_key = a.idempotency_key)
                    AND NOT (a.kind = 'drain' AND EXISTS (
                        SELECT 1 FROM nodes n WHERE n.name = a.target AND n.state != 'active'))
                    ORDER BY a.id LIMIT ?
                )
                """,
                (now - max_age_s, limit),
            )
            return cur.rowcount

    def expire_audit(self, *, now: float, max_age_s: float, limit: int) -> int:
        """Delete up to `limit` audit entries older than `max_age_s` before `now`."""
        with self._db.transaction() as c:
            cur = c.execute(
                "DELETE FROM audit_log WHERE id IN"
                " (SELECT id FROM audit_log WHERE ts < ? ORDER BY ts LIMIT ?)",
                (now - max_age_s, limit),
            )
            return cur.rowcount


__all__ = ["RetentionRepository"]
