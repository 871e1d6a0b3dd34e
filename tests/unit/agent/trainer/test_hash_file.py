"""`hash_file`: size and sha256 of a file, equal to hashlib's over the whole content for every
size around the block size (the large-file path reads and hashes in two threads)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from agent.trainer.manifest import hash_file

CHUNK = 1000


@pytest.mark.parametrize(
    "size",
    [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 7 * CHUNK + 13],
    ids=["empty", "one-byte", "under-a-block", "one-block", "block-plus-one", "two-blocks",
         "many-blocks-and-a-tail"],
)  # fmt: skip
def test_size_and_sha256_match_the_whole_content(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert hash_file(tmp_path / "f", chunk_bytes=CHUNK) == (size, hashlib.sha256(data).hexdigest())


def test_default_block_size_gives_the_same_answer(tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK + 5)
    (tmp_path / "f").write_bytes(data)
    assert hash_file(tmp_path / "f") == hash_file(tmp_path / "f", chunk_bytes=CHUNK)


def test_a_changed_byte_changes_the_digest(tmp_path: Path) -> None:
    data = bytearray(os.urandom(5 * CHUNK))
    (tmp_path / "f").write_bytes(data)
    before = hash_file(tmp_path / "f", chunk_bytes=CHUNK)
    data[4 * CHUNK + 1] ^= 0x01
    (tmp_path / "f").write_bytes(data)
    after = hash_file(tmp_path / "f", chunk_bytes=CHUNK)
    assert before[0] == after[0]
    assert before[1] != after[1]


def test_missing_file_raises_file_not_found_and_leaves_no_thread(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        hash_file(tmp_path / "absent", chunk_bytes=CHUNK)
    assert [t for t in threading.enumerate() if t.name.startswith("trainguard-verify")] == []
