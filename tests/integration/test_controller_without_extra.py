"""A controller host installed without the `controller` extra says what to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.controller_proc import dbe_rules, write_config

BLOCKED = """
import sys
sys.modules["uvicorn"] = None  # as if trainguard[controller] was not installed
from trainguard.controller.main import main
sys.exit(main(["--config", sys.argv[1]]))
"""


def test_missing_web_server_is_exit_2_naming_the_extra(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, rules=dbe_rules())
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "pip install 'trainguard[controller]'" in out.stderr
    assert "Traceback" not in out.stderr
