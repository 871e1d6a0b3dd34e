"""Fixtures for the red-team tests: real controller processes, killed when a test ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.controller_proc import ControllerProcess


@pytest.fixture
def controllers() -> Iterator[list[ControllerProcess]]:
    """Controllers a test starts and appends here are killed (workers die with them)."""
    started: list[ControllerProcess] = []
    yield started
    for proc in started:
        proc.kill()
