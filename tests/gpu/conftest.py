"""The GPU checks: they run only where CUDA and NVML see a GPU (tests/gpu/run_on_gpu.sh), and
skip everywhere else (CI has no GPU; `make test` does not collect this folder)."""

from __future__ import annotations

import pytest


def _cuda() -> bool:
    try:
        import torch  # noqa: PLC0415 - heavy: only when the folder is collected
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if _cuda():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU here (tests/gpu runs on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
