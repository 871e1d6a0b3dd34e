"""Fixtures for the hardware collector tests: a fresh fake pynvml per test, fixture paths."""

from __future__ import annotations

import importlib.util
import itertools
import types
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
FAKE_PYNVML = FIXTURES / "fake_pynvml" / "pynvml.py"
SYSFS = FIXTURES / "sysfs"
KMSG = FIXTURES / "kmsg"
_counter = itertools.count()


def load_fake_pynvml() -> types.ModuleType:
    """A private, fresh copy of the fake module: its scripted state never leaks between tests,
    and nothing is put in sys.modules under "pynvml"."""
    spec = importlib.util.spec_from_file_location(f"_fake_pynvml_{next(_counter)}", FAKE_PYNVML)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_nvml() -> types.ModuleType:
    return load_fake_pynvml()
