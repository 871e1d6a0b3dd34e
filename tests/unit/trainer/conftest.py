"""Fixtures for trainer-library tests: a fake agent socket and a clean environment."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.trainer.trainer_helpers import FakeAgent


@pytest.fixture
def agent(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAgent]:
    a = FakeAgent(short_tmp)
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET", a.path)
    monkeypatch.setenv("TRAINGUARD_CONTROL_DIR", str(short_tmp))
    monkeypatch.setenv("TRAINGUARD_JOB", "unit")
    monkeypatch.delenv("TRAINGUARD_CHAOS", raising=False)
    yield a
    a.close()


@pytest.fixture(autouse=True)
def no_ambient_agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Never talk to a real agent on the test machine; tests that want one use `agent`.
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET", str(tmp_path / "no-agent.sock"))
    monkeypatch.delenv("TRAINGUARD_CHAOS", raising=False)
    monkeypatch.delenv("TRAINGUARD_CONTROL_DIR", raising=False)
