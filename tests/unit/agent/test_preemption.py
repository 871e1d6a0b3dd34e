"""Preemption notices against a local HTTP server playing AWS IMDSv2 and the GCP metadata
service: the token flow, no-notice answers, the notice itself, failures, once-only."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.fakes.metadata_server import AWS_ACTION_PATH, AWS_TOKEN_PATH, MetadataServer
from trainguard.agent.config import PreemptionConfig
from trainguard.agent.preemption import (
    AWS_TOKEN_TTL_S,
    AwsImdsProbe,
    GcpMetadataProbe,
    MetadataError,
    PreemptionNotice,
    PreemptionWatcher,
    build_probe,
)
from trainguard.clock import FakeClock


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    s = MetadataServer()
    yield s
    s.close()


def aws(server: MetadataServer, clock: FakeClock) -> AwsImdsProbe:
    return AwsImdsProbe(base_url=server.url, clock=clock, timeout_s=2.0)


def test_aws_no_notice_is_a_404_after_the_token_handshake(server: MetadataServer) -> None:
    probe = aws(server, FakeClock())
    try:
        assert probe.check() is None
    finally:
        probe.close()
    (put, get) = server.requests
    assert put[0] == "PUT" and put[1] == AWS_TOKEN_PATH
    assert put[2]["X-aws-ec2-metadata-token-ttl-seconds"] == str(AWS_TOKEN_TTL_S)
    assert get[0] == "GET" and get[1] == AWS_ACTION_PATH
    assert get[2]["X-aws-ec2-metadata-token"] in server.tokens


def test_aws_spot_interruption_is_a_notice_with_action_and_time(server: MetadataServer) -> None:
    server.aws_action = {"action": "terminate", "time": "2026-11-22T04:02:00Z"}
    probe = aws(server, FakeClock())
    try:
        assert probe.check() == PreemptionNotice(
            provider="aws", action="terminate", time="2026-11-22T04:02:00Z"
        )
    finally:
        probe.close()


def test_aws_token_is_reused_until_it_nears_expiry(server: MetadataServer) -> None:
    clock = FakeClock()
    probe = aws(server, clock)
    try:
        probe.check()
        probe.check()
        assert [m for m, _, _ in server.requests].count("PUT") == 1
        clock.advance(AWS_TOKEN_TTL_S - 30)  # inside the renewal margin
        probe.check()
        assert [m for m, _, _ in server.requests].count("PUT") == 2
    finally:
        probe.close()


def test_aws_revoked_token_is_renewed_once_and_the_read_retried(server: MetadataServer) -> None:
    probe = aws(server, FakeClock())
    try:
        probe.check()
        server.revoke_tokens()
        server.aws_action = {"action": "stop", "time": "2026-11-22T04:02:00Z"}
        notice = probe.check()
        assert notice is not None and notice.action == "stop"
        assert [m for m, _, _ in server.requests] == ["PUT", "GET", "GET", "PUT", "GET"]
    finally:
        probe.close()


@pytest.mark.parametrize(
    ("status", "expect"),
    [(500, "token request answered 500"), (403, "token request answered 403")],
    ids=["server-error", "forbidden"],
)
def test_aws_failures_raise_metadata_error_naming_the_step(
    server: MetadataServer, status: int, expect: str
) -> None:
    server.fail_status = status
    probe = aws(server, FakeClock())
    try:
        with pytest.raises(MetadataError, match=expect):
            probe.check()
    finally:
        probe.close()


def test_aws_garbled_instance_action_body_is_an_error(server: MetadataServer) -> None:
    server.aws_action = {"what": "terminate"}
    probe = aws(server, FakeClock())
    try:
        with pytest.raises(MetadataError, match="unexpected body"):
            probe.check()
    finally:
        probe.close()


def test_gcp_preempted_false_true_and_the_flavor_header(server: MetadataServer) -> None:
    probe = GcpMetadataProbe(base_url=server.url, clock=FakeClock(), timeout_s=2.0)
    try:
        assert probe.check() is None
        server.gcp_preempted = "TRUE"
        assert probe.check() == PreemptionNotice(provider="gcp", action="preempt")
    finally:
        probe.close()
    assert all(h.get("Metadata-Flavor") == "Google" for _, _, h in server.requests)
    assert server.requests[0][1] == "/computeMetadata/v1/instance/preempted"


def test_gcp_terminate_on_host_maintenance_is_a_notice(server: MetadataServer) -> None:
    server.gcp_maintenance = "TERMINATE_ON_HOST_MAINTENANCE"
    probe = GcpMetadataProbe(base_url=server.url, clock=FakeClock(), timeout_s=2.0)
    try:
        assert probe.check() == PreemptionNotice(provider="gcp", action="host_maintenance")
    finally:
        probe.close()


def test_unreachable_service_is_a_metadata_error() -> None:
    probe = GcpMetadataProbe(base_url="http://127.0.0.1:1", clock=FakeClock(), timeout_s=1.0)
    try:
        with pytest.raises(MetadataError, match="preempted failed"):
            probe.check()
    finally:
        probe.close()


def test_build_probe_follows_the_provider_and_defaults_to_link_local() -> None:
    assert build_probe(PreemptionConfig(), clock=FakeClock()) is None
    probe = build_probe(PreemptionConfig(provider="aws"), clock=FakeClock())
    assert isinstance(probe, AwsImdsProbe)
    assert probe._base == "http://169.254.169.254"
    probe.close()


def test_watcher_hands_on_the_first_notice_once_and_logs_failures_once(
    server: MetadataServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainguard.agent.preemption")
    got: list[PreemptionNotice] = []
    probe = GcpMetadataProbe(base_url=server.url, clock=FakeClock(), timeout_s=2.0)
    watcher = PreemptionWatcher(probe, interval_s=60.0, on_notice=got.append)
    try:
        server.fail_status = 503
        assert watcher.check_once() is None
        assert watcher.check_once() is None
        assert watcher.errors_total == 2
        assert caplog.text.count("event=preemption_probe_failed") == 1
        server.fail_status = None
        server.gcp_preempted = "TRUE"
        assert watcher.check_once() is not None
        assert watcher.check_once() is None  # once: the VM is going away
        assert got == [PreemptionNotice(provider="gcp", action="preempt")]
        assert "event=preemption_probe_recovered" in caplog.text
    finally:
        watcher.close()
