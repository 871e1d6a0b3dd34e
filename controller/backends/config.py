"""The controller's `backend:` section: which scheduler runs the jobs, and the Slurm and AWS
backends' settings. Strict like every config: unknown keys and broken invariants fail at
load with file, key and reason."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from trainguard.strict import Invalid

_RESERVATION = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_USERS = re.compile(r"[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*")
# An EC2 instance id (the short 8-hex ids of old accounts and today's 17) and a region name
# (us-east-1, eu-central-2, us-gov-west-1, cn-north-1, ap-southeast-4, ...).
INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,17}")
REGION = re.compile(r"[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-[0-9]{1,2}")
_LABEL_KEY = re.compile(r"[!-~]{1,128}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise Invalid(key, f"must be > 0, got {value}")


@dataclass(frozen=True)
class SlurmBackendConfig:
    # Directory of the Slurm client commands (scontrol, squeue, sinfo, scancel); empty =
    # found on PATH. The controller host needs the slurm-client package and munge's key.
    bin_dir: str = ""
    # slurm.conf for the client commands (exported as SLURM_CONF); empty = Slurm's own
    # default (/etc/slurm/slurm.conf, or configless from DNS).
    slurm_conf: str = ""
    # Seconds one Slurm command may take before the step fails (transient: retried with
    # backoff, then paged). slurmctld answers in milliseconds unless it is overloaded.
    command_timeout_s: float = 20.0
    # How often the node drain states, the spare reservation and the jobs are read from
    # Slurm (sinfo --json, squeue --json, scontrol show reservation), seconds. 5 s keeps
    # `agentctl get nodes` close to `sinfo` at ~3 cheap RPCs per interval.
    sync_interval_s: float = 5.0
    # The reservation that holds the hot spares: general work cannot run on its nodes.
    # trainguard takes a spare out of it when the spare replaces a node (docs/slurm.md).
    spare_reservation: str = "trainguard_spares"
    # Who may use the spare reservation (scontrol's `users=`) when trainguard creates it
    # again: it deletes the reservation when a replace takes its last node (a reservation
    # cannot be empty), and a repaired node that comes back as a spare needs one. The
    # set-up's own reservation is left as it was made.
    spare_reservation_users: str = "root"
    # Agent node name -> Slurm NodeName where they differ (default: the same name).
    node_names: dict[str, str] = field(default_factory=dict)
    # Steps a job's processes take to leave the drained node after the requeue (KillWait +
    # epilog), seconds; past it the restart fails and pages.
    requeue_timeout_s: float = 120.0
    # A node whose agent is silent is set DOWN, not DRAIN: a dead node cannot finish its
    # job steps, and DOWN is what makes slurmctld stop waiting for them.
    down_silent_nodes: bool = True

    def __post_init__(self) -> None:
        _positive("command_timeout_s", self.command_timeout_s)
        _positive("sync_interval_s", self.sync_interval_s)
        _positive("requeue_timeout_s", self.requeue_timeout_s)
        if not _RESERVATION.fullmatch(self.spare_reservation):
            raise Invalid(
                "spare_reservation",
                f"must match {_RESERVATION.pattern}, got {self.spare_reservation!r}",
            )
        if not _USERS.fullmatch(self.spare_reservation_users):
            raise Invalid(
                "spare_reservation_users",
                "must be Slurm user names separated by commas,"
                f" got {self.spare_reservation_users!r}",
            )
        slurm_names = list(self.node_names.values())
        if len(set(slurm_names)) != len(slurm_names):
            raise Invalid("node_names", "two agent nodes map to the same Slurm node")
        for agent, slurm in self.node_names.items():
            if not agent or not slurm or any(c in slurm for c in " ,[]="):
                raise Invalid(f"node_names.{agent}", f"not a Slurm node name: {slurm!r}")


def _within(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise Invalid(key, f"must be within {low:g}..{high:g}, got {value}")


@dataclass(frozen=True)
class AwsBackendConfig:
    """Cloud replacement (docs/controller.md "Cloud replacement"): a retired node's EC2
    instance is terminated through its Auto Scaling Group, which launches a replacement; the
    replacement's agent registers as a new node and joins as a spare after a passing
    preflight. Credentials come from boto3's own chain (the instance profile, the
    environment), never from this file."""

    # The region of the nodes whose agents do not report one (label `region_label`).
    region: str = ""
    # The Auto Scaling endpoint; empty: AWS's own for the region. A VPC endpoint or a test
    # server (moto).
    endpoint_url: str = ""
    # The agent label that carries the node's instance id (the agent's node.labels, e.g. from
    # the instance metadata at boot) and the one that carries its region.
    instance_id_label: str = "aws_instance_id"
    region_label: str = "aws_region"
    # Replace retired nodes (an operator's `node retire`, a lemon, a repair that failed on a
    # lemon). Off: nothing is terminated; the capability stays declared.
    replace_retired: bool = True
    # At most this many instances out at once (terminated, their replacement not yet launched
    # into the group): the replacement's safety budget. 1: one at a time, as a rolling update.
    max_in_flight: int = 1
    # And at most replace_max terminations in any replace_window_s (the rate limit): a bad rule
    # or a bad driver push retires many nodes at once, and that should reach a person, not
    # recycle the fleet. 4 an hour replaces a rack's worth of RMAs in a shift.
    replace_max: int = 4
    replace_window_s: float = 3600.0
    # How long the group may take to launch the replacement into service, s; past it the step
    # fails and pages (the old instance is terminated either way). EC2 GPU instances take
    # minutes to boot; 30 min covers a capacity wait.
    replace_timeout_s: float = 1800.0
    # How often the step polls the group while it waits, s.
    poll_interval_s: float = 10.0
    # Seconds one Auto Scaling API call may take (connect and read); the step retries a
    # timeout with backoff.
    call_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.region and not REGION.fullmatch(self.region):
            raise Invalid("region", f"not an AWS region name: {self.region!r} (e.g. us-east-1)")
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise Invalid(
                "endpoint_url", f"must start with http:// or https://, got {self.endpoint_url!r}"
            )
        labels = {"instance_id_label": self.instance_id_label, "region_label": self.region_label}
        for key, label in labels.items():
            if not _LABEL_KEY.fullmatch(label):
                raise Invalid(key, f"not a label name: {label!r}")
        if self.instance_id_label == self.region_label:
            raise Invalid("region_label", "must differ from instance_id_label")
        _within("max_in_flight", self.max_in_flight, 1, 100)
        _within("replace_max", self.replace_max, 1, 1000)
        _within("replace_window_s", self.replace_window_s, 60.0, 7 * 86400.0)
        _within("replace_timeout_s", self.replace_timeout_s, 10.0, 86400.0)
        _within("poll_interval_s", self.poll_interval_s, 0.1, 600.0)
        _within("call_timeout_s", self.call_timeout_s, 0.1, 300.0)
        if self.max_in_flight > self.replace_max:
            raise Invalid("max_in_flight", f"must not exceed replace_max ({self.replace_max})")


@dataclass(frozen=True)
class BackendConfig:
    # torchrun: jobs submitted to trainguard run as torchrun launched by the agents, and a
    # drain lives in trainguard's store. slurm: Slurm runs the jobs; drain, spares and
    # restart are Slurm's (scontrol drain, a spare reservation, requeue). aws: torchrun on
    # EC2 instances in Auto Scaling Groups, and a retired node's instance is replaced
    # through its group (cloud replacement; the `aws` extra).
    kind: Literal["torchrun", "slurm", "aws"] = "torchrun"
    # Only read with kind: slurm.
    slurm: SlurmBackendConfig = field(default_factory=SlurmBackendConfig)
    # Only read with kind: aws.
    aws: AwsBackendConfig = field(default_factory=AwsBackendConfig)

    def __post_init__(self) -> None:
        if self.kind == "aws" and not self.aws.region:
            raise Invalid("aws.region", "required with kind: aws (the nodes' default region)")


__all__ = ["INSTANCE_ID", "REGION", "AwsBackendConfig", "BackendConfig", "SlurmBackendConfig"]
