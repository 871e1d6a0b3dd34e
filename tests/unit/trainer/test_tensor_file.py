"""The raw tensor file: what `write_tensor_file` writes, `read_tensor_file` reads back, and
its sha256 is the file's, whatever the block and writeback sizes and however writing fails."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainguard.trainer import checkpoint
from trainguard.trainer.checkpoint import read_tensor_file, write_tensor_file
from trainguard.trainer.manifest import hash_file


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "weight": torch.randn(33, 17, generator=g),
        "half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "steps": torch.arange(11, dtype=torch.int64),
        "mask": torch.rand(13, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "transposed": torch.randn(6, 9, generator=g).t(),  # not contiguous
        "bytes": torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=g),
    }


def hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("trainguard-hash")]


@pytest.mark.parametrize(
    ("block_bytes", "writeback_bytes"),
    [
        (4 << 20, 32 << 20),
        (1000, 4096),
        (1, 0),
        (4096, 1),
    ],
    ids=[
        "default-sizes",
        "small-blocks-small-windows",
        "byte-blocks-no-writeback",
        "window-each-block",
    ],
)
def test_written_file_reads_back_equal_with_its_sha256_and_aligned_offsets(
    tmp_path: Path, block_bytes: int, writeback_bytes: int
) -> None:
    tensors = sample_tensors()
    path = tmp_path / "tensors.bin"
    index, size, digest = write_tensor_file(
        path, tensors, block_bytes=block_bytes, writeback_bytes=writeback_bytes
    )
    assert hash_file(path) == (size, digest)
    assert [index[n]["offset"] % 64 for n in tensors] == [0] * len(tensors)
    back = read_tensor_file(path, index)
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype, name
        assert torch.equal(back[name], t), name


def test_same_tensors_give_the_same_file_whatever_the_block_size(tmp_path: Path) -> None:
    tensors = sample_tensors()
    a = write_tensor_file(tmp_path / "a.bin", tensors, block_bytes=7)
    b = write_tensor_file(tmp_path / "b.bin", tensors, block_bytes=1 << 20)
    assert a == b
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_a_file_without_tensors_is_empty_with_the_empty_sha256(tmp_path: Path) -> None:
    index, size, digest = write_tensor_file(tmp_path / "t.bin", {})
    assert (index, size) == ({}, 0)
    assert hash_file(tmp_path / "t.bin") == (0, digest)


def test_non_positive_block_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="block_bytes"):
        write_tensor_file(tmp_path / "t.bin", sample_tensors(), block_bytes=0)


def test_write_error_propagates_and_leaves_no_hash_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checkpoint._write_all
    calls = [0]

    def failing(fd: int, data: Any) -> None:
        calls[0] += 1
        if calls[0] == 5:
            raise OSError(28, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(checkpoint, "_write_all", failing)
    with pytest.raises(OSError, match="No space left"):
        write_tensor_file(tmp_path / "t.bin", sample_tensors(), block_bytes=512)
    assert hash_threads() == []


def test_hash_error_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class BrokenHash:
        def update(self, data: Any) -> None:
            raise RuntimeError("hash unit on fire")

        def hexdigest(self) -> str:
            raise AssertionError("must not be reached")

    monkeypatch.setattr(checkpoint, "hashlib", SimpleNamespace(sha256=BrokenHash))
    with pytest.raises(RuntimeError, match="hash unit on fire"):
        write_tensor_file(tmp_path / "t.bin", sample_tensors(), block_bytes=512)
    assert hash_threads() == []


@pytest.mark.parametrize("mode", ["missing", "refused"], ids=["no-fadvise", "fadvise-fails"])
def test_writeback_advice_is_optional(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    if mode == "missing":
        monkeypatch.delattr(os, "posix_fadvise", raising=False)
    else:

        def refuse(fd: int, offset: int, length: int, advice: int) -> None:
            raise OSError(22, "Invalid argument")

        monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    tensors = sample_tensors()
    path = tmp_path / "t.bin"
    index, size, digest = write_tensor_file(path, tensors, block_bytes=256, writeback_bytes=512)
    assert hash_file(path) == (size, digest)
    assert torch.equal(read_tensor_file(path, index)["weight"], tensors["weight"])


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="platform has no posix_fadvise")
def test_writeback_is_advised_window_by_window_and_for_the_whole_file_after_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, int, int]] = []
    real_fadvise, real_fsync = os.posix_fadvise, os.fsync

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        events.append(("advise", offset, length))
        real_fadvise(fd, offset, length, advice)

    def fsync(fd: int) -> None:
        events.append(("fsync", 0, 0))
        real_fsync(fd)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(os, "fsync", fsync)
    tensors = {"x": torch.zeros(1024, dtype=torch.uint8)}
    write_tensor_file(tmp_path / "t.bin", tensors, block_bytes=100, writeback_bytes=300)
    # Windows [0,300) [300,600) [600,900): each one advised when written; the first dropped
    # again once two more windows followed; after fsync, the whole file.
    assert events == [
        ("advise", 0, 300),
        ("advise", 300, 300),
        ("advise", 600, 300),
        ("advise", 0, 300),
        ("fsync", 0, 0),
        ("advise", 0, 0),
    ]
