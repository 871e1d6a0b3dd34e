"""Store backup (online, SQLite backup API) and restore (verified, the old file kept aside)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainguard.clock import FakeClock
from trainguard.controller.backup import backup, main, restore
from trainguard.controller.store import Store
from trainguard.controller.store.errors import StoreError


def _now() -> float:
    return 1000.0


def _store_with_nodes(path: Path, names: list[str]) -> Store:
    s = Store(path, now=_now)
    for n in names:
        s.nodes.add(n, role="active", labels={})
    return s


def test_backup_of_a_live_store_holds_what_was_committed(tmp_path: Path) -> None:
    live = _store_with_nodes(tmp_path / "c.db", ["node-1", "node-2"])  # stays open, WAL mode
    backup(store_path=tmp_path / "c.db", dest=tmp_path / "b.db")
    live.nodes.add("node-3", role="active", labels={})  # after the backup: not in it
    copy = Store(tmp_path / "b.db", now=_now)
    assert [n.name for n in copy.nodes.all()] == ["node-1", "node-2"]
    copy.close()
    live.close()


def test_backup_never_overwrites_a_file(tmp_path: Path) -> None:
    _store_with_nodes(tmp_path / "c.db", ["node-1"]).close()
    (tmp_path / "b.db").write_text("precious")
    with pytest.raises(StoreError, match="already exists"):
        backup(store_path=tmp_path / "c.db", dest=tmp_path / "b.db")
    assert (tmp_path / "b.db").read_text() == "precious"


def test_restore_installs_the_backup_and_keeps_the_old_file(tmp_path: Path) -> None:
    _store_with_nodes(tmp_path / "c.db", ["node-1"]).close()
    backup(store_path=tmp_path / "c.db", dest=tmp_path / "b.db")
    s = Store(tmp_path / "c.db", now=_now)
    s.nodes.add("node-2", role="active", labels={})
    s.close()
    aside = restore(backup_path=tmp_path / "b.db", store_path=tmp_path / "c.db")
    assert aside is not None and aside.exists()
    restored = Store(tmp_path / "c.db", now=_now)
    assert [n.name for n in restored.nodes.all()] == ["node-1"]
    restored.close()
    kept = Store(aside, now=_now)
    assert [n.name for n in kept.nodes.all()] == ["node-1", "node-2"]
    kept.close()


def test_the_replaced_store_is_named_for_the_local_time_on_the_injected_clock(
    tmp_path: Path,
) -> None:
    _store_with_nodes(tmp_path / "c.db", ["node-1"]).close()
    backup(store_path=tmp_path / "c.db", dest=tmp_path / "b.db")
    clock = FakeClock(start=1_700_000_000.0)
    aside = restore(backup_path=tmp_path / "b.db", store_path=tmp_path / "c.db", clock=clock)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(1_700_000_000.0))
    assert aside == tmp_path / f"c.db.replaced-{stamp}"


def test_restore_refuses_a_damaged_backup_and_leaves_the_store(tmp_path: Path) -> None:
    _store_with_nodes(tmp_path / "c.db", ["node-1"]).close()
    before = (tmp_path / "c.db").read_bytes()
    (tmp_path / "b.db").write_bytes(b"")
    with pytest.raises(StoreError, match="empty"):
        restore(backup_path=tmp_path / "b.db", store_path=tmp_path / "c.db")
    assert (tmp_path / "c.db").read_bytes() == before


def test_command_line_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _store_with_nodes(tmp_path / "c.db", ["node-1"]).close()
    db = ["--db", str(tmp_path / "c.db")]
    assert main([*db, "backup", str(tmp_path / "b.db")]) == 0
    assert main([*db, "backup", str(tmp_path / "b.db")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([*db, "restore", str(tmp_path / "b.db")]) == 0
    assert "previous file is kept as" in capsys.readouterr().out
    (tmp_path / "zero.db").write_bytes(b"")
    assert main([*db, "restore", str(tmp_path / "zero.db")]) == 2
