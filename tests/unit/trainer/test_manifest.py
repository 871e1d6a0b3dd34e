"""Checkpoint directories: commit, verification, corruption handling, retention, stale cleanup.

Pure file-system tests (no torch): each corruption is made on real files and the loader must
skip the bad checkpoint with a log line naming the file, falling back to the previous one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from trainguard.trainer.manifest import (
    CheckpointInvalid,
    HashingWriter,
    Manifest,
    apply_retention,
    clean_stale,
    commit_dir,
    find_latest_good,
    hash_file,
    list_committed,
    new_tmp_dir,
    step_dir_name,
    verify_dir,
    write_manifest,
)
from trainguard.trainer.retention import RetentionPolicy


def make_checkpoint(ckpt_dir: Path, step: int, payload: bytes = b"") -> Path:
    tmp = new_tmp_dir(ckpt_dir, step)
    tmp.mkdir(parents=True)
    files = {}
    for name, data in {
        "rank_00000.pt": payload or f"state of step {step}".encode() * 100,
        "dcp/__0_0.distcp": b"shard" * 50,
    }.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        with open(tmp / name, "wb") as f:
            hw = HashingWriter(f)
            hw.write(data)
        files[name] = {"size": hw.size, "sha256": hw.hexdigest()}
    write_manifest(
        tmp,
        Manifest(
            step=step,
            world_size=1,
            format="torch",
            files=files,
            created_at=1.0,
            loss_finite=True,
            trainguard_version="test",
        ),
    )
    final = ckpt_dir / step_dir_name(step)
    commit_dir(tmp, final)
    return final


def test_hashing_writer_matches_hash_of_written_file(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as f:
        hw = HashingWriter(f)
        hw.write(b"a" * 1000)
        hw.write(memoryview(b"b" * 10))
    assert hash_file(tmp_path / "f") == (hw.size, hw.hexdigest())


def test_committed_checkpoint_verifies_and_is_latest(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 20)
    found = find_latest_good(tmp_path)
    assert found is not None
    assert found[0] == 20
    assert found[2].files["rank_00000.pt"]["size"] > 0


def test_temporary_directories_are_never_latest(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 10)
    new_tmp_dir(tmp_path, 20).mkdir()
    assert [s for s, _ in list_committed(tmp_path)] == [10]


def _flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    os.truncate(p, p.stat().st_size // 2)


def _remove_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _point_manifest_at_missing_file(d: Path) -> None:
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["rank_00001.pt"] = {"size": 3, "sha256": "0" * 64}
    (d / "manifest.json").write_text(json.dumps(m))


def _garble_manifest(d: Path) -> None:
    (d / "manifest.json").write_text("{not json")


@pytest.mark.parametrize(
    ("corrupt", "bad_file"),
    [
        (lambda d: _flip_byte(d / "rank_00000.pt"), "rank_00000.pt"),
        (lambda d: _flip_byte(d / "dcp" / "__0_0.distcp"), "__0_0.distcp"),
        (lambda d: _truncate(d / "rank_00000.pt"), "rank_00000.pt"),
        (_remove_manifest, "manifest.json"),
        (_point_manifest_at_missing_file, "rank_00001.pt"),
        (_garble_manifest, "manifest.json"),
    ],
    ids=[
        "flipped-byte",
        "flipped-byte-in-shard",
        "truncated",
        "missing-manifest",
        "manifest-points-at-missing-file",
        "garbled-manifest",
    ],
)
def test_corrupt_checkpoint_is_skipped_with_a_log_line_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt, bad_file: str
) -> None:
    make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    corrupt(newest)
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        found = find_latest_good(tmp_path)
    assert found is not None and found[0] == 10, "the previous good checkpoint must be chosen"
    lines = [r.getMessage() for r in caplog.records if "checkpoint_skipped" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "step=20" in lines[0]
    assert bad_file in lines[0]


def test_manifest_for_another_step_is_rejected(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path, 10)
    os.rename(d, tmp_path / step_dir_name(30))
    with pytest.raises(CheckpointInvalid, match="does not match directory step 30"):
        verify_dir(tmp_path / step_dir_name(30), expected_step=30)


def test_manifest_with_path_escaping_the_directory_is_rejected(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path, 10)
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointInvalid, match="malformed entry"):
        verify_dir(d)


def test_no_good_checkpoint_gives_none(tmp_path: Path) -> None:
    assert find_latest_good(tmp_path / "absent") is None
    d = make_checkpoint(tmp_path, 10)
    _remove_manifest(d)
    assert find_latest_good(tmp_path) is None


def test_commit_over_an_existing_step_replaces_it(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 10, payload=b"old" * 10)
    make_checkpoint(tmp_path, 10, payload=b"new" * 10)
    assert (tmp_path / "step_000010" / "rank_00000.pt").read_bytes() == b"new" * 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010"]


def test_retention_keeps_the_newest_k(tmp_path: Path) -> None:
    for s in (10, 20, 30, 40):
        make_checkpoint(tmp_path, s)
    removed = apply_retention(
        tmp_path, policy=RetentionPolicy(recent_last=2), now=0.0, newest_good_step=40
    )
    assert sorted(p.name for p in removed) == ["step_000010", "step_000020"]
    assert [s for s, _ in list_committed(tmp_path)] == [40, 30]


def test_retention_never_deletes_the_newest_good_checkpoint(tmp_path: Path) -> None:
    # Newer directories exist but are not good (e.g. from before a rollback): the newest good
    # one must survive even when it falls outside keep-last.
    for s in (10, 20, 30):
        make_checkpoint(tmp_path, s)
    apply_retention(tmp_path, policy=RetentionPolicy(recent_last=1), now=0.0, newest_good_step=10)
    assert 10 in [s for s, _ in list_committed(tmp_path)]


def test_clean_stale_removes_only_leftover_temporaries(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 10)
    leftover = new_tmp_dir(tmp_path, 20)
    leftover.mkdir()
    (tmp_path / "notes").mkdir()
    removed = clean_stale(tmp_path)
    assert removed == [leftover]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_000010"]
