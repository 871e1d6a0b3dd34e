"""The shipped default rules and XID catalog: package data, found through importlib.resources
so that an installed wheel finds them wherever it was installed."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped_dir() -> Path:
    """The directory holding `default.yaml` and `xid_catalog.yaml` in this installation."""
    return Path(str(resources.files(__name__)))
