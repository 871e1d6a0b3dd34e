"""The node table: the nodes the controller knows, their role (active or spare), state
(active, draining, drained), labels, job and report freshness."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from trainguard.controller.records import FreshNode, NodeRecord
from trainguard.controller.store.connection import Row
from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import from_row, to_json, update_row

# the columns `update` may set
_NODE_COLUMNS = frozenset({"role", "state", "drain_reason", "job", "labels"})


class NodeRepository:
    """The node rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @staticmethod
    def _node(row: Row) -> NodeRecord:
        return from_row(NodeRecord, row, labels=json.loads(row["labels"]))

    def all(self) -> list[NodeRecord]:
        return [self._node(r) for r in self._db.query("SELECT * FROM nodes ORDER BY name")]

    def get(self, name: str) -> NodeRecord | None:
        rows = self._db.query("SELECT * FROM nodes WHERE name = ?", (name,))
        return self._node(rows[0]) if rows else None

    def add(self, name: str, *, role: str, labels: dict[str, str]) -> NodeRecord:
        now = self._db.now()
        with self._db.transaction() as c:
            c.execute(
                "INSERT INTO nodes (name, role, state, labels, created_at, updated_at)"
                " VALUES (?, ?, 'active', ?, ?, ?) ON CONFLICT DO NOTHING",
                (name, role, to_json(labels), now, now),
            )
        node = self.get(name)
        assert node is not None
        return node

    def update(self, name: str, **changes: Any) -> NodeRecord:
        """Set columns of one node (role, state, drain_reason, job, labels)."""
        update_row(self._db, "node", name, changes, _NODE_COLUMNS, encode={"labels": to_json})
        node = self.get(name)
        if node is None:
            raise KeyError(name)
        return node

    def flush_freshness(self, fresh: Iterable[FreshNode]) -> int:
        """Write a batch of in-memory report freshness in one transaction: on SQLite one
        UPDATE per node (in-process, microseconds each); on PostgreSQL one UPDATE of the
        whole batch joined to its columns as arrays (one round trip and one statement to
        plan, instead of one per node: what a tick at 1,024 nodes pays)."""
        rows = [
            (f.last_report_at, f.instance, f.agent_version, to_json(f.labels), f.name)
            for f in fresh
        ]
        if not rows:
            return 0
        with self._db.transaction() as c:
            if self._db.dialect.postgres:
                at, instance, version, labels, name = (list(col) for col in zip(*rows, strict=True))
                c.execute(
                    "UPDATE nodes SET last_report_at = v.at, instance = v.instance,"
                    " agent_version = v.version, labels = v.labels"
                    " FROM unnest(CAST(? AS DOUBLE PRECISION[]), CAST(? AS TEXT[]),"
                    " CAST(? AS TEXT[]), CAST(? AS TEXT[]), CAST(? AS TEXT[]))"
                    " AS v(at, instance, version, labels, name) WHERE nodes.name = v.name",
                    (at, instance, version, labels, name),
                )
            else:
                c.executemany(
                    "UPDATE nodes SET last_report_at = ?, instance = ?, agent_version = ?,"
                    " labels = ? WHERE name = ?",
                    rows,
                )
        return len(rows)


__all__ = ["NodeRepository"]
