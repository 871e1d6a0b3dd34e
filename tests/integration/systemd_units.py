"""Helpers for the unit-file tests: `systemd-analyze` (required in CI), rendering a unit with
the real `install-unit` subcommand, and `systemd-analyze verify`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def systemd_analyze() -> str:
    """The systemd-analyze binary; a failure in CI when it is missing, else a skip."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is required in CI (Debian package 'systemd')")
        pytest.skip("systemd-analyze not installed")
    return analyze


def install_unit(script: Path, *, dest: Path, unit_file: Path | None = None) -> Path:
    """Run `SCRIPT install-unit --dest DEST` (the checkout's unit unless `unit_file`), return
    the written unit."""
    unit_file = unit_file or REPO / "systemd" / f"{script.name}.service"
    out = subprocess.run(
        [str(script), "install-unit", "--dest", str(dest), "--unit-file", str(unit_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    unit = dest / f"{script.name}.service"
    assert out.stdout.startswith(f"wrote {unit}"), out.stdout
    return unit


def exec_start_program(unit: Path) -> Path:
    """The program of the unit's one ExecStart= line."""
    (line,) = [ln for ln in unit.read_text().splitlines() if ln.startswith("ExecStart=")]
    return Path(line.split("=", 1)[1].split()[0])


def assert_verifies_clean(analyze: str, unit: Path) -> None:
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    # unknown keys are only warnings (exit 0): any output at all is a failure
    assert proc.returncode == 0 and not proc.stderr.strip() and not proc.stdout.strip(), (
        proc.stdout + proc.stderr
    )
