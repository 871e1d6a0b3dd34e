"""Checks of an SQLite store file before and after it is opened: a file that cannot be a
trainguard store (empty, another format, damaged, another application's database) is refused
with a message that says how to recover. Used at open (store/database.py) and by backup and
restore (controller/backup.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from trainguard.controller.store.errors import StoreError

SQLITE_HEADER = b"SQLite format 3\x00"
RESTORE_HINT = (
    "restore the newest backup with 'trainguard-controller restore BACKUP_FILE' "
    "(docs/controller.md, Backup and restore), or move the file away to start an empty store"
)


def check_existing_file(path: str | Path) -> None:
    """Refuse a store file that cannot be a trainguard store before SQLite touches it: SQLite
    would treat a 0-byte file as a new empty database and the controller would start fresh over
    it (every node, incident and job gone without a word)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except OSError as e:
        raise StoreError(f"{p}: cannot read: {e.strerror or e}") from None
    if size == 0:
        raise StoreError(f"{p}: the store file is empty (0 bytes); {RESTORE_HINT}")
    if header != SQLITE_HEADER:
        raise StoreError(f"{p}: not an SQLite database (wrong file header); {RESTORE_HINT}")


def verify_connection(conn: sqlite3.Connection, path: str) -> None:
    """`PRAGMA quick_check` and the schema_version table: a damaged or foreign file fails."""
    try:
        result = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path}: damaged store ({e}); {RESTORE_HINT}") from None
    if result != ["ok"]:
        detail = "; ".join(result[:3])
        raise StoreError(f"{path}: damaged store (quick_check: {detail}); {RESTORE_HINT}")
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if row is None:
        raise StoreError(
            f"{path}: an SQLite database, but not a trainguard store (no schema_version table); "
            "point store.path at the controller's own file"
        )


__all__ = ["RESTORE_HINT", "SQLITE_HEADER", "check_existing_file", "verify_connection"]
