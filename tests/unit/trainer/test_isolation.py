"""`import agent` must work where torch (and boto3) cannot be imported."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = """
import sys
for name in ("torch", "numpy", "boto3"):
    sys.modules[name] = None
import trainguard.agent, trainguard.protocol, trainguard.clock
assert "trainguard.trainer" not in sys.modules
try:
    import trainguard.trainer
except ImportError:
    print("trainer needs torch")
"""


def test_import_agent_works_with_torch_blocked() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "trainer needs torch"
