"""Fixtures every test directory may use. Shared helpers are plain modules (tests/helpers.py,
tests/builders.py, tests/fakes/); a fixture is never imported from another test module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import short_tmpdir


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path (for unix sockets), removed afterwards."""
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fake_controller() -> Iterator[FakeController]:
    """The fake controller serving on loopback; its agent token is `.agent_token`."""
    ctl = FakeController()
    yield ctl
    ctl.stop()
