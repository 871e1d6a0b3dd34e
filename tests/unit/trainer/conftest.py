"""Fixtures for trainer-library tests: a fake agent socket, a clean environment and a local S3
server (moto)."""

from __future__ import annotations

import urllib.request
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


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # Credentials for the local server only; boto3 reads them from the environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # Deferred: only the S3 tests start a server (moto imports in ~1 s).
    import boto3  # noqa: PLC0415
    from moto.server import ThreadedMotoServer  # noqa: PLC0415

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto keeps its buckets in this process, across servers: start and leave it empty
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="ckpts")
    yield url
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
    server.stop()
