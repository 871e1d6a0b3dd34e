"""Preemption notices from the cloud's instance metadata service (AWS IMDSv2, GCP).

A `MetadataProbe` asks the service once whether this VM is about to go away; the
`PreemptionWatcher` thread polls it and hands the first notice to the agent, which then
asks every local rank for an emergency checkpoint-and-stop. Polling lives in its own thread
with short timeouts, so a slow or absent metadata service never delays the collect loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx

from trainguard.agent.config import PreemptionConfig
from trainguard.clock import Clock

__all__ = [
    "AWS_TOKEN_TTL_S",
    "AwsImdsProbe",
    "GcpMetadataProbe",
    "MetadataError",
    "MetadataProbe",
    "PreemptionNotice",
    "PreemptionWatcher",
    "build_probe",
]

log = logging.getLogger("trainguard.agent.preemption")

# IMDSv2 session tokens live up to 6 hours; renew a minute before they lapse.
AWS_TOKEN_TTL_S = 21600
_AWS_TOKEN_MARGIN_S = 60.0
_BODY_MAX_CHARS = 200


class MetadataError(RuntimeError):
    """The metadata service answered something unexpected or not at all (message says what)."""


@dataclass(frozen=True)
class PreemptionNotice:
    provider: str  # "aws" | "gcp"
    action: str  # aws: "terminate" | "stop" | "hibernate"; gcp: "preempt" | "host_maintenance"
    time: str = ""  # when it happens, as the provider states it (ISO 8601); "" if not stated


class MetadataProbe(Protocol):
    provider: str

    def check(self) -> PreemptionNotice | None:
        """One look: a notice, None (no notice), or MetadataError."""
        ...

    def close(self) -> None: ...


class AwsImdsProbe:
    """IMDSv2: PUT /latest/api/token, then GET /latest/meta-data/spot/instance-action.

    404 means no interruption is scheduled; 200 carries {"action": ..., "time": ...}. A 401
    means the token lapsed: it is renewed once and the read retried.
    """

    provider = "aws"

    def __init__(
        self,
        *,
        base_url: str,
        clock: Clock,
        timeout_s: float,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._clock = clock
        self._client = httpx.Client(timeout=timeout_s, transport=transport)
        self._token: str | None = None
        self._token_expires_mono = 0.0

    def close(self) -> None:
        self._client.close()

    def _get_token(self) -> str:
        if self._token is not None and self._clock.monotonic() < self._token_expires_mono:
            return self._token
        try:
            resp = self._client.put(
                f"{self._base}/latest/api/token",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
            )
        except httpx.HTTPError as e:
            raise MetadataError(f"IMDS token request failed: {type(e).__name__}: {e}") from None
        if resp.status_code != 200 or not resp.text.strip():
            raise MetadataError(f"IMDS token request answered {resp.status_code}")
        self._token = resp.text.strip()
        self._token_expires_mono = self._clock.monotonic() + AWS_TOKEN_TTL_S - _AWS_TOKEN_MARGIN_S
        return self._token

    def check(self) -> PreemptionNotice | None:
        for attempt in (1, 2):
            token = self._get_token()
            try:
                resp = self._client.get(
                    f"{self._base}/latest/meta-data/spot/instance-action",
                    headers={"X-aws-ec2-metadata-token": token},
                )
            except httpx.HTTPError as e:
                raise MetadataError(f"IMDS read failed: {type(e).__name__}: {e}") from None
            if resp.status_code == 401 and attempt == 1:
                self._token = None  # lapsed or revoked: renew once
                continue
            break
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise MetadataError(f"spot/instance-action answered {resp.status_code}")
        try:
            body = json.loads(resp.text)
            action = body["action"]
        except (ValueError, KeyError, TypeError):
            raise MetadataError(
                f"spot/instance-action: unexpected body {resp.text[:_BODY_MAX_CHARS]!r}"
            ) from None
        when = body.get("time", "")
        return PreemptionNotice(
            provider="aws", action=str(action), time=when if isinstance(when, str) else ""
        )


class GcpMetadataProbe:
    """GCP: GET /computeMetadata/v1/instance/preempted ("TRUE"/"FALSE") and
    /computeMetadata/v1/instance/maintenance-event (GPU VMs cannot live-migrate: a
    "TERMINATE_ON_HOST_MAINTENANCE" event stops them), with `Metadata-Flavor: Google`."""

    provider = "gcp"

    def __init__(
        self,
        *,
        base_url: str,
        clock: Clock,
        timeout_s: float,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._base = base_url.rstrip("/") + "/computeMetadata/v1/instance"
        self._client = httpx.Client(
            timeout=timeout_s, headers={"Metadata-Flavor": "Google"}, transport=transport
        )

    def close(self) -> None:
        self._client.close()

    def _read(self, name: str) -> str:
        try:
            resp = self._client.get(f"{self._base}/{name}")
        except httpx.HTTPError as e:
            raise MetadataError(f"metadata read {name} failed: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise MetadataError(f"metadata {name} answered {resp.status_code}")
        return resp.text.strip()

    def check(self) -> PreemptionNotice | None:
        preempted = self._read("preempted")
        if preempted == "TRUE":
            return PreemptionNotice(provider="gcp", action="preempt")
        if preempted != "FALSE":
            raise MetadataError(f"metadata preempted: unexpected value {preempted[:40]!r}")
        if self._read("maintenance-event") == "TERMINATE_ON_HOST_MAINTENANCE":
            return PreemptionNotice(provider="gcp", action="host_maintenance")
        return None


def build_probe(
    config: PreemptionConfig, *, clock: Clock, transport: httpx.BaseTransport | None = None
) -> MetadataProbe | None:
    """The probe for the configured provider; None when preemption notices are off."""
    if config.provider == "aws":
        return AwsImdsProbe(
            base_url=config.resolved_base_url(),
            clock=clock,
            timeout_s=config.timeout_s,
            transport=transport,
        )
    if config.provider == "gcp":
        return GcpMetadataProbe(
            base_url=config.resolved_base_url(),
            clock=clock,
            timeout_s=config.timeout_s,
            transport=transport,
        )
    return None


class PreemptionWatcher:
    """Polls a probe every `interval_s` in a thread until the first notice, which goes to
    `on_notice` exactly once (the VM is going away: there is nothing more to learn)."""

    def __init__(
        self,
        probe: MetadataProbe,
        *,
        interval_s: float,
        on_notice: Callable[[PreemptionNotice], None],
    ) -> None:
        self._probe = probe
        self._interval_s = interval_s
        self._on_notice = on_notice
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one poll at a time: the notice is handed on once
        self._failing = False
        self.errors_total = 0
        self.notice: PreemptionNotice | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="preemption", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._probe.close()

    def check_once(self) -> PreemptionNotice | None:
        """One poll; returns the notice the first time one is seen (then always None)."""
        with self._lock:
            return self._check_locked()

    def _check_locked(self) -> PreemptionNotice | None:
        if self.notice is not None:
            return None
        try:
            notice = self._probe.check()
        except MetadataError as e:
            self.errors_total += 1
            if not self._failing:  # log the edge; a missing service would flood otherwise
                log.warning(
                    "event=preemption_probe_failed provider=%s reason=%r",
                    self._probe.provider,
                    str(e),
                )
                self._failing = True
            return None
        if self._failing:
            log.info("event=preemption_probe_recovered provider=%s", self._probe.provider)
            self._failing = False
        if notice is None:
            return None
        self.notice = notice
        log.warning(
            "event=preemption_notice provider=%s action=%s time=%s",
            notice.provider,
            notice.action,
            notice.time or "-",
        )
        self._on_notice(notice)
        return notice

    def _run(self) -> None:
        while self.notice is None and not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # a bug here must not end the watch silently
                log.exception("event=preemption_watcher_error")
            if self._stop.wait(self._interval_s):
                return
