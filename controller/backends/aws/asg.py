"""The Auto Scaling calls cloud replacement makes, behind a small Protocol: where an instance
is (its group and lifecycle state), the instances of a group, and the one terminate call. The
real client is boto3's (imported here only, when the first client is built); tests use a
local moto server or a recording fake.

Errors come out as the action framework's two kinds: throttling, 5xx and connection trouble
are transient (the step retries with backoff), anything else (a bad id, access denied) is
permanent (the step fails and pages). Their text names the call and AWS's error code and
message, never a credential.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from trainguard.controller.actions.base import PermanentError, TransientError

log = logging.getLogger("trainguard.controller.aws")

# AWS's error codes that say "try again later" (the rest of 4xx is permanent).
_TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "ServiceUnavailable",
        "InternalFailure",
        "InternalError",
        "ResourceContention",
        "ScalingActivityInProgress",
    }
)


@dataclass(frozen=True)
class GroupInstance:
    """One instance as its Auto Scaling Group sees it."""

    instance_id: str
    group: str
    lifecycle_state: str  # Pending, InService, Terminating, Terminating:Wait, Terminated, ...

    @property
    def terminating(self) -> bool:
        """On its way out (the group will not run it again)."""
        return self.lifecycle_state.startswith("Terminat")

    @property
    def in_service(self) -> bool:
        return self.lifecycle_state == "InService"


class AsgClient(Protocol):
    """The Auto Scaling calls of one region."""

    def describe_instance(self, instance_id: str) -> GroupInstance | None:
        """The instance's group and state; None when it is in no group (never was, or it has
        left its group after its termination)."""

    def group_instances(self, group: str) -> list[GroupInstance]:
        """The instances the group holds now."""

    def terminate(self, instance_id: str) -> None:
        """Terminate the instance through its group without lowering the group's desired
        capacity, so the group launches a replacement."""


class Boto3AsgClient:
    """AsgClient over boto3's `autoscaling` client (the `aws` extra)."""

    def __init__(self, *, region: str, endpoint_url: str = "", timeout_s: float = 20.0) -> None:
        try:  # lazy: only a controller with backend.kind aws needs boto3 (the `aws` extra)
            import boto3  # noqa: PLC0415
            from botocore.config import Config  # noqa: PLC0415
        except ImportError:
            raise PermanentError(
                "backend.kind aws needs boto3 on the controller host: pip install"
                " 'trainguard[controller,aws]'"
            ) from None

        self.region = region
        self._client: Any = boto3.client(
            "autoscaling",
            region_name=region,
            endpoint_url=endpoint_url or None,
            config=Config(
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                retries={"max_attempts": 2, "mode": "standard"},
            ),
        )

    def describe_instance(self, instance_id: str) -> GroupInstance | None:
        answer = self._call(
            "DescribeAutoScalingInstances",
            lambda: self._client.describe_auto_scaling_instances(InstanceIds=[instance_id]),
        )
        for row in answer.get("AutoScalingInstances", []):
            if row.get("InstanceId") == instance_id:
                return GroupInstance(
                    instance_id=instance_id,
                    group=str(row["AutoScalingGroupName"]),
                    lifecycle_state=str(row.get("LifecycleState", "")),
                )
        return None

    def group_instances(self, group: str) -> list[GroupInstance]:
        answer = self._call(
            "DescribeAutoScalingGroups",
            lambda: self._client.describe_auto_scaling_groups(AutoScalingGroupNames=[group]),
        )
        groups = answer.get("AutoScalingGroups", [])
        if not groups:
            raise PermanentError(f"Auto Scaling Group {group!r} not found in {self.region}")
        return [
            GroupInstance(
                instance_id=str(row["InstanceId"]),
                group=group,
                lifecycle_state=str(row.get("LifecycleState", "")),
            )
            for row in groups[0].get("Instances", [])
        ]

    def terminate(self, instance_id: str) -> None:
        self._call(
            "TerminateInstanceInAutoScalingGroup",
            lambda: self._client.terminate_instance_in_auto_scaling_group(
                InstanceId=instance_id, ShouldDecrementDesiredCapacity=False
            ),
        )

    def _call(self, name: str, call: Any) -> dict[str, Any]:
        """Run one API call; botocore's errors as TransientError / PermanentError."""
        # lazy: the same deferred boto3 dependency as the client itself
        from botocore.exceptions import (  # noqa: PLC0415
            BotoCoreError,
            ClientError,
            ConnectionError,
            NoCredentialsError,
        )

        try:
            result: dict[str, Any] = call()
            return result
        except ClientError as e:
            error = e.response.get("Error", {})
            code = str(error.get("Code", "Unknown"))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            text = f"{name} in {self.region}: {code}: {error.get('Message', '')}".rstrip(": ")
            if code in _TRANSIENT_CODES or status >= 500:
                raise TransientError(text) from None
            raise PermanentError(text) from None
        except NoCredentialsError:
            raise PermanentError(
                f"{name} in {self.region}: no AWS credentials (instance profile or environment)"
            ) from None
        except (ConnectionError, BotoCoreError) as e:
            raise TransientError(f"{name} in {self.region}: {type(e).__name__}") from None


__all__ = ["AsgClient", "Boto3AsgClient", "GroupInstance"]
