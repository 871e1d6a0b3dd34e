"""Helpers for integration tests that run a real Prometheus or Alertmanager (Debian packages
`prometheus` and `prometheus-alertmanager`): find the binary, start it on a free loopback
port and wait until it is ready, stop it."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, wait_for

__all__ = ["require_binary", "start_alertmanager", "start_prometheus", "stop", "wait_ready"]


def require_binary(name: str, *, package: str = "prometheus") -> str:
    """The path of `name`; missing, the test skips, or fails under CI=true."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is required in CI (Debian package {package!r}; `make deps`)")
        pytest.skip(f"{name} not installed (Debian package {package!r}; `make deps` as root)")
    return path


def wait_ready(proc: subprocess.Popen[bytes], url: str, *, timeout_s: float, what: str) -> bool:
    """True once /-/ready answers 200, False if the process exits first; AssertionError
    naming `what` if neither happens within timeout_s."""

    def state() -> str | None:
        if proc.poll() is not None:
            return "exited"
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return "ready"
        except httpx.HTTPError:
            pass
        return None

    return wait_for(state, timeout_s=timeout_s, what=what, interval_s=0.1) == "ready"


def _start(
    argv: Callable[[int], list[str]], *, log: Path, cwd: Path, what: str
) -> tuple[subprocess.Popen[bytes], str]:
    for _ in range(3):  # a free port can be taken between choosing and binding it
        port = free_port()
        with log.open("wb") as out:
            proc = subprocess.Popen(argv(port), stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
        url = f"http://127.0.0.1:{port}"
        try:
            ready = wait_ready(proc, url, timeout_s=20, what=f"{what} to answer /-/ready")
        except AssertionError as e:
            stop(proc)
            pytest.fail(f"{e}:\n{log.read_text()}")
        if ready:
            return proc, url
        stop(proc)
        if "address already in use" not in log.read_text():
            break
    pytest.fail(f"{what} did not become ready:\n{log.read_text()}")


def start_prometheus(
    binary: str, workdir: Path, config: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """Prometheus with this config and its TSDB under workdir; (process, base URL)."""
    return _start(
        lambda port: [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        log=workdir / "prometheus.log",
        cwd=workdir,
        what="prometheus",
    )


def start_alertmanager(
    binary: str, workdir: Path, config: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """A single Alertmanager (no cluster: an empty --cluster.listen-address) with this config
    and its storage under workdir; (process, base URL)."""
    return _start(
        lambda port: [
            binary,
            f"--config.file={config}",
            f"--storage.path={workdir / 'alertmanager'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
        log=workdir / "alertmanager.log",
        cwd=workdir,
        what="alertmanager",
    )


def stop(proc: subprocess.Popen[bytes], *, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
