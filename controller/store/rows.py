"""What the repositories share: JSON as the store writes it, a record built from a row, and
the one incident timeline insert (incidents and actions both add timeline entries, each in its
own write's transaction)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from trainguard.controller.store.connection import Connection, Row
from trainguard.controller.store.database import Database


def to_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


def json_list(values: Iterable[Any]) -> str:
    return to_json(list(values))


_R = TypeVar("_R")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def from_row(cls: type[_R], row: Row, **decoded: Any) -> _R:
    """The dataclass `cls` from the row's columns of the same names; `decoded` gives the
    fields not stored as they are read (JSON text, another column's name, computed)."""
    stored = {name: row[name] for name in _field_names(cls) if name not in decoded}
    return cls(**stored, **decoded)


TIMELINE_INSERT = (
    "INSERT INTO incident_timeline (incident_id, ts, kind, message, data) VALUES (?, ?, ?, ?, ?)"
)


def add_note(
    c: Connection,
    incident_id: int,
    *,
    ts: float,
    kind: str,
    message: str,
    data: dict[str, Any],
    touch: bool,
) -> None:
    """Add one timeline entry; `touch`: also move the incident's updated_at to `ts`."""
    c.execute(TIMELINE_INSERT, (incident_id, ts, kind, message, to_json(data)))
    if touch:
        c.execute("UPDATE incidents SET updated_at = ? WHERE id = ?", (ts, incident_id))


def update_row(
    db: Database,
    kind: str,
    name: str,
    changes: dict[str, Any],
    allowed: frozenset[str],
    *,
    encode: dict[str, Callable[[Any], str]],
) -> None:
    """Set `changes` (columns in `allowed`; those in `encode` stored as it writes them) and
    updated_at on the row `name` of the `kind` table (nodes, jobs)."""
    bad = set(changes) - allowed
    if bad:
        raise ValueError(f"cannot update {kind} columns {sorted(bad)}")
    for column, to_text in encode.items():
        if column in changes:
            changes[column] = to_text(changes[column])
    sets = ", ".join(f"{k} = ?" for k in changes)
    with db.transaction() as c:
        c.execute(
            f"UPDATE {kind}s SET {sets}, updated_at = ? WHERE name = ?",  # noqa: S608
            (*changes.values(), db.now(), name),
        )


__all__ = ["TIMELINE_INSERT", "add_note", "from_row", "json_list", "to_json", "update_row"]
