"""Fixtures for the integration tests (real processes)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest

from tests.integration.controller_proc import ControllerProcess


@pytest.fixture
def controllers() -> Iterator[list[ControllerProcess]]:
    """Controllers a test starts and appends here are killed when it ends."""
    started: list[ControllerProcess] = []
    yield started
    for proc in started:
        proc.kill()


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """A local moto server (AWS APIs: the aws backend's Auto Scaling), emptied before and
    after, as tests/unit/trainer/conftest.py's S3 one."""
    # deferred: only these tests start a server (moto imports in ~1 s)
    from moto.server import ThreadedMotoServer  # noqa: PLC0415

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto keeps its state in this process, across servers: start and leave it empty
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
    yield url
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
    server.stop()
