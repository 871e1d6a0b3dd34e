"""The store's size on disk: the file and its WAL, free pages, and what gives them back
(`incremental_vacuum`: the SQLite file is auto_vacuum=INCREMENTAL, see store/schema.py;
`checkpoint_wal` empties the -wal file). controller/maintenance.py decides when. On
PostgreSQL these are no-ops: autovacuum reclaims space and the server manages its WAL."""

from __future__ import annotations

import os

from trainguard.controller.store import schema
from trainguard.controller.store.database import Database


class SpaceRepository:
    """Sizes, vacuum and WAL checkpoints of the store's file."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def page_counts(self) -> tuple[int, int]:
        """(pages in the file, of which free): what incremental_vacuum can give back.
        PostgreSQL: (0, 0), its space is autovacuum's."""
        if self._db.dialect.postgres:
            return 0, 0
        with self._db.sqlite_connection() as conn:
            pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
            free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
        return pages, free

    def incremental_vacuum(self, *, pages: int) -> int:
        """Give up to `pages` free pages back to the filesystem; returns how many went.
        In WAL mode the file itself shrinks at the next checkpoint. PostgreSQL: 0 (autovacuum
        reclaims dead rows; the store never runs VACUUM FULL, which locks the tables)."""
        if pages < 1 or self._db.dialect.postgres:
            return 0
        with self._db.sqlite_connection() as conn:
            if conn.in_transaction:
                raise RuntimeError("incremental_vacuum inside a transaction")
            before = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
            # executescript steps the pragma to the end; execute() would free a single page
            conn.executescript(f"PRAGMA incremental_vacuum({int(pages)})")
            after = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
        return before - after

    def checkpoint_wal(self, *, mode: str = "TRUNCATE") -> tuple[bool, int, int]:
        """PRAGMA wal_checkpoint(mode): (busy, frames in the WAL, frames checkpointed).
        TRUNCATE copies every frame into the file and cuts the -wal file to 0 bytes; with this
        store's one connection held by the lock, nothing in this process can be reading or
        writing meanwhile, so only another process (a backup) can make it busy."""
        if mode not in ("PASSIVE", "FULL", "RESTART", "TRUNCATE"):
            raise ValueError(f"unknown checkpoint mode {mode!r}")
        if self._db.dialect.postgres:  # the server checkpoints its own WAL
            return False, 0, 0
        with self._db.sqlite_connection() as conn:
            row = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        return bool(row[0]), int(row[1]), int(row[2])

    def file_sizes(self) -> tuple[int, int]:
        """(bytes of the database file, bytes of its -wal file); 0 for what does not exist.
        PostgreSQL: (pg_database_size, 0); (0, 0) while the server cannot be asked."""
        if self._db.dialect.postgres:
            try:
                rows = self._db.query("SELECT pg_database_size(current_database())")
            except Exception:  # a metrics scrape must not fail with the database away
                return 0, 0
            return int(rows[0][0]), 0
        if self._db.path == ":memory:":
            return 0, 0
        sizes = []
        for name in (self._db.path, self._db.path + "-wal"):
            try:
                sizes.append(os.stat(name).st_size)
            except OSError:
                sizes.append(0)
        return sizes[0], sizes[1]

    def auto_vacuum_mode(self) -> int:
        """PRAGMA auto_vacuum: 0 none, 1 full, 2 incremental."""
        return schema.auto_vacuum_mode(self._db)


__all__ = ["SpaceRepository"]
