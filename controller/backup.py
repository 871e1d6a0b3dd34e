"""Online backup and offline restore of the controller's SQLite store (a PostgreSQL store is
backed up with PostgreSQL's own tools, pg_dump / pg_basebackup: refused here, naming them).

`backup` copies a consistent snapshot with SQLite's backup API while the controller keeps
running (readers and the writer are not blocked for more than a page batch at a time).
`restore` is for a stopped controller: it verifies the backup, never overwrites the current
file without keeping it (it is renamed aside), and installs the copy with one rename.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.controller.config import load_config
from trainguard.controller.store.errors import StoreError
from trainguard.controller.store.schema import SCHEMA_VERSION
from trainguard.controller.store.sqlitefile import check_existing_file, verify_connection
from trainguard.controller.storeurl import redact_url
from trainguard.strict import ConfigError

PROG = "trainguard-controller"
PAGES_PER_STEP = 1024  # pages copied per step of the backup API: short holds on the source


def _verified(path: Path) -> sqlite3.Connection:
    """A read-only connection to `path` after the header, quick_check and schema checks."""
    check_existing_file(path)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        verify_connection(conn, str(path))
        (version,) = conn.execute("SELECT version FROM schema_version").fetchone()
    except BaseException:
        conn.close()
        raise
    if int(version) > SCHEMA_VERSION:
        conn.close()
        raise StoreError(
            f"{path}: schema version {version} is newer than this controller knows "
            f"({SCHEMA_VERSION})"
        )
    return conn


def _copy(src: sqlite3.Connection, dest: Path) -> None:
    """Write `src` into a new file `dest` (temporary name, fsync, rename)."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    out = sqlite3.connect(tmp)
    try:
        src.backup(out, pages=PAGES_PER_STEP)
        out.execute("PRAGMA journal_mode=DELETE")  # one self-contained file, no -wal beside it
    finally:
        out.close()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dest)
    dir_fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def backup(*, store_path: Path, dest: Path) -> None:
    """A consistent copy of the live store at `dest` (refuses to overwrite a file)."""
    if dest.exists():
        raise StoreError(f"{dest}: already exists; name a new file")
    if not dest.parent.is_dir():
        raise StoreError(f"{dest.parent}: no such directory")
    src = _verified(store_path)
    try:
        _copy(src, dest)
    finally:
        src.close()
    _verified(dest).close()


def restore(*, backup_path: Path, store_path: Path, clock: Clock = SYSTEM_CLOCK) -> Path | None:
    """Install `backup_path` as the store; the file it replaces is kept beside it, renamed.
    Returns where the old file went (None if there was none). The controller must be stopped."""
    src = _verified(backup_path)
    aside: Path | None = None
    try:
        store_path.parent.mkdir(parents=True, exist_ok=True)
        staged = store_path.with_name(f".{store_path.name}.restore-{os.getpid()}")
        staged.unlink(missing_ok=True)
        _copy(src, staged)
    finally:
        src.close()
    _verified(staged).close()
    if store_path.exists():
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(clock.now()))
        aside = store_path.with_name(f"{store_path.name}.replaced-{stamp}")
        os.replace(store_path, aside)
        for suffix in ("-wal", "-shm"):  # the old file's journal must not be applied to the new
            side = Path(f"{store_path}{suffix}")
            if side.exists():
                os.replace(side, Path(f"{aside}{suffix}"))
    os.replace(staged, store_path)
    return aside


def main(argv: Sequence[str]) -> int:
    """`trainguard-controller backup DEST` / `trainguard-controller restore BACKUP`."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Back up the live store (online) or restore a backup (controller stopped).",
        epilog=(
            "examples:\n"
            f"  {PROG} backup /var/backups/trainguard/c-$(date +%F).db\n"
            f"  systemctl stop trainguard-controller && {PROG} restore /var/backups/c.db"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="controller config (for store.path)")
    p.add_argument("--db", help="the store file (overrides store.path)")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("backup", help="copy the live store to DEST (a new file)")
    b.add_argument("dest")
    r = sub.add_parser("restore", help="install BACKUP as the store (stop the controller first)")
    r.add_argument("backup")
    args = p.parse_args(argv)
    try:
        store = None if args.db else load_config(args.config).store
    except ConfigError as e:
        print(f"{PROG}: bad configuration: {e}", file=sys.stderr)
        return 2
    if store is not None and store.url is not None:
        print(
            f"{PROG}: {args.command}: the store is PostgreSQL ({redact_url(store.url)}); "
            "back it up and restore it with PostgreSQL's tools (pg_dump / pg_restore, or "
            "pg_basebackup): docs/controller.md, Store",
            file=sys.stderr,
        )
        return 2
    store_path = Path(args.db) if args.db else Path(store.path if store else "")
    try:
        if args.command == "backup":
            backup(store_path=store_path, dest=Path(args.dest))
            print(f"{PROG}: backed up {store_path} to {args.dest}")
        else:
            aside = restore(backup_path=Path(args.backup), store_path=store_path)
            kept = f"; the previous file is kept as {aside}" if aside else ""
            print(f"{PROG}: restored {args.backup} to {store_path}{kept}")
    except StoreError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except (OSError, sqlite3.Error) as e:
        print(f"{PROG}: {args.command} failed: {e}", file=sys.stderr)
        return 1
    return 0
