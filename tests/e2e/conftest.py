"""Fixtures the end-to-end modules share.

`reference`: the uninterrupted run (tests/e2e/reference.py), run once for the session. A
module starts it (`start()`) before its cluster, so it trains while the cluster comes up,
and reads it (`lines()`, waiting for its end) when it needs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.reference import Reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    ref = Reference(Path(tmp_path_factory.mktemp("reference")))
    yield ref
    ref.close()
