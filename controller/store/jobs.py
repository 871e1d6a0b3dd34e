"""The job table of the closed loop: spec, state, placement, attempts, checkpoint and ETTR
accounting. `submit` and `begin_attempt` read a row and write it in one transaction (the row
locked on PostgreSQL); `set_placement` moves a job and its nodes in one transaction."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from trainguard.controller.records import JobRecord
from trainguard.controller.store.connection import Row
from trainguard.controller.store.database import Database
from trainguard.controller.store.rows import from_row, json_list, to_json, update_row

# the columns `update` may set
_JOB_COLUMNS = frozenset(
    {
        "state",
        "nodes",
        "nproc_per_node",
        "ckpt_step",
        "last_step",
        "hwm_step",
        "started_at",
        "ended_at",
        "productive_s",
        "sampled_at",
        "state_reason",
        "attempt_started_at",
    }
)


class JobRepository:
    """The job rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @staticmethod
    def _job(row: Row) -> JobRecord:
        return from_row(
            JobRecord,
            row,
            spec=json.loads(row["spec"]),
            nodes=tuple(json.loads(row["nodes"])),
            attempt_nodes=tuple(json.loads(row["attempt_nodes"])),
        )

    def upsert(self, name: str, *, state: str, nodes: Sequence[str]) -> None:
        now = self._db.now()
        with self._db.transaction() as c:
            c.execute(
                "INSERT INTO jobs (name, state, nodes, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET"
                " state = excluded.state, nodes = excluded.nodes, updated_at = excluded.updated_at",
                (name, state, to_json(sorted(nodes)), now, now),
            )

    def summaries(self) -> list[dict[str, Any]]:
        return [
            {
                "name": r["name"],
                "state": r["state"],
                "nodes": tuple(json.loads(r["nodes"])),
                "attempt": r["attempt"],
                "spec": json.loads(r["spec"]),
            }
            for r in self._db.query("SELECT * FROM jobs ORDER BY name")
        ]

    def get(self, name: str) -> JobRecord | None:
        rows = self._db.query("SELECT * FROM jobs WHERE name = ?", (name,))
        return self._job(rows[0]) if rows else None

    def all(self) -> list[JobRecord]:
        return [self._job(r) for r in self._db.query("SELECT * FROM jobs ORDER BY name")]

    def submit(
        self,
        name: str,
        *,
        spec: dict[str, Any],
        nodes: Sequence[str],
        nproc_per_node: int,
        min_nodes: int,
        ts: float,
        replace_states: Sequence[str],
    ) -> JobRecord | None:
        """Insert a job in state `pending`, or replace one whose state is in `replace_states`
        (a finished job resubmitted; its attempt counter carries on so rendezvous ids and
        command ids never repeat). None when a job of that name exists in another state."""
        with self._db.transaction() as c:
            row = c.execute(
                f"SELECT state FROM jobs WHERE name = ?{self._db.dialect.for_update}",  # noqa: S608
                (name,),
            ).fetchone()
            if row is not None and row[0] not in replace_states:
                return None
            values = (to_json(spec), to_json(list(nodes)), nproc_per_node, min_nodes, ts)
            if row is None:
                c.execute(
                    "INSERT INTO jobs (name, spec, state, nodes, nproc_per_node, min_nodes,"
                    " created_at, updated_at) VALUES (?, ?, 'pending', ?, ?, ?, ?, ?)",
                    (name, *values[:-1], ts, ts),
                )
            else:
                c.execute(
                    "UPDATE jobs SET spec = ?, nodes = ?, nproc_per_node = ?, min_nodes = ?,"
                    " updated_at = ?, state = 'pending', state_reason = '', restarts = 0,"
                    " started_at = NULL, ended_at = NULL, productive_s = 0, sampled_at = NULL,"
                    " ckpt_step = NULL, last_step = NULL, hwm_step = NULL, attempt_nodes = '[]'"
                    " WHERE name = ?",
                    (*values, name),
                )
        return self.get(name)

    def update(self, name: str, **changes: Any) -> JobRecord:
        """Set columns of one job; tuples/lists (nodes) are stored as JSON."""
        update_row(self._db, "job", name, changes, _JOB_COLUMNS, encode={"nodes": json_list})
        job = self.get(name)
        if job is None:
            raise KeyError(name)
        return job

    def begin_attempt(
        self,
        name: str,
        *,
        key: str,
        rdzv_port: Callable[[int], int],
        ts: float,
        counts_restart: bool = True,
    ) -> tuple[JobRecord, bool]:
        """The attempt that step `key` starts: the current one if this key began it already
        (a re-run after a crash), else attempt+1 on the job's current nodes, in one
        transaction; a later attempt counts as a restart unless `counts_restart` is False (a
        grow back to full size). Returns (job, began_now)."""
        with self._db.transaction() as c:
            row = c.execute(
                "SELECT attempt, attempt_key, nodes FROM jobs WHERE name = ?"  # noqa: S608
                + self._db.dialect.for_update,
                (name,),
            ).fetchone()
            if row is None:
                raise KeyError(name)
            began = row["attempt_key"] != key
            if began:
                attempt = int(row["attempt"]) + 1
                c.execute(
                    "UPDATE jobs SET attempt = ?, attempt_key = ?, attempt_nodes = nodes,"
                    " rdzv_port = ?, restarts = restarts + CASE WHEN ? > 1 THEN 1 ELSE 0 END,"
                    " state = 'starting', state_reason = '', attempt_started_at = ?,"
                    " updated_at = ? WHERE name = ?",
                    (
                        attempt,
                        key,
                        rdzv_port(attempt),
                        attempt if counts_restart else 0,
                        ts,
                        ts,
                        name,
                    ),
                )
        job = self.get(name)
        assert job is not None
        return job, began

    def set_placement(
        self,
        name: str,
        *,
        nodes: Sequence[str],
        nproc_per_node: int,
        assign: Sequence[str],
        release: Sequence[str],
        to_spares: Sequence[str] = (),
    ) -> JobRecord:
        """Move a job to a new node set in one transaction: `assign` nodes become active
        members of the job (a spare leaves the pool), `release` nodes leave it, and those of
        them in `to_spares` (healthy, leaving for the job's recovery) join the spare pool."""
        now = self._db.now()
        with self._db.transaction() as c:
            c.execute(
                "UPDATE jobs SET nodes = ?, nproc_per_node = ?, updated_at = ? WHERE name = ?",
                (to_json(list(nodes)), nproc_per_node, now, name),
            )
            for node in release:
                c.execute(
                    "UPDATE nodes SET job = NULL, updated_at = ? WHERE name = ? AND job = ?",
                    (now, node, name),
                )
            for node in to_spares:
                c.execute(
                    "UPDATE nodes SET role = 'spare', updated_at = ?"
                    " WHERE name = ? AND job IS NULL",
                    (now, node),
                )
            for node in assign:
                c.execute(
                    "UPDATE nodes SET job = ?, role = 'active', updated_at = ? WHERE name = ?",
                    (name, now, node),
                )
        job = self.get(name)
        assert job is not None
        return job


__all__ = ["JobRepository"]
