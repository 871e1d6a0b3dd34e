"""Cloud replacement through the real controller, boto3 and a local moto server: a node on an
instance of an Auto Scaling Group (launch template, desired capacity 2) is retired; the
controller terminates its instance through the group once, moto launches a replacement, a
real agent standing in for the new instance registers with its id and joins as a spare only
after its passing preflight; the old node's record says what replaced it, and no credential
reaches the log."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess
from tests.integration.controller_proc import (
    AGENT_TOKEN,
    OP,
    start_controller,
    write_config,
)

REGION = "us-east-1"
GROUP = "gpu-workers"
SECRET = "tgSecretKeyNeverLogged0123456789"

pytestmark = pytest.mark.slow


def _aws(url: str, service: str) -> Any:
    import boto3  # noqa: PLC0415 - the aws extra, deferred like the product's own import

    return boto3.client(
        service,
        endpoint_url=url,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key=SECRET,
    )


def _group_instances(url: str) -> dict[str, str]:
    (group,) = _aws(url, "autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[GROUP])[
        "AutoScalingGroups"
    ]
    return {i["InstanceId"]: i["LifecycleState"] for i in group["Instances"]}


def _agent(workdir: Path, url: str, *, node: str, instance_id: str) -> AgentProcess:
    workdir.mkdir()
    token = workdir / "token"
    token.write_text(AGENT_TOKEN + "\n")
    token.chmod(0o600)
    cfg = workdir / "agent.yaml"
    cfg.write_text(f"node: {{labels: {{aws_instance_id: {instance_id}, aws_region: {REGION}}}}}\n")
    return AgentProcess(
        workdir, "--config", str(cfg), "--node-name", node, "--gpus", "1", "--ib-ports", "1",
        "--controller", url, "--token-file", str(token),
        "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
    )  # fmt: skip


def _node(url: str, name: str) -> dict[str, Any] | None:
    r = httpx.get(f"{url}/v1/nodes/{name}", headers=OP, timeout=10)
    return r.json() if r.status_code == 200 else None


def test_a_retired_node_is_replaced_and_its_replacement_joins_as_a_spare(
    short_tmp: Path, moto_url: str
) -> None:
    ec2, asg = _aws(moto_url, "ec2"), _aws(moto_url, "autoscaling")
    ec2.create_launch_template(
        LaunchTemplateName="gpu-node",
        LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge"},
    )
    asg.create_auto_scaling_group(
        AutoScalingGroupName=GROUP,
        LaunchTemplate={"LaunchTemplateName": "gpu-node", "Version": "$Latest"},
        MinSize=2,
        MaxSize=3,
        DesiredCapacity=2,
        AvailabilityZones=[f"{REGION}a"],
    )
    old, other = sorted(_group_instances(moto_url))
    cfg = write_config(
        short_tmp,
        rules="rules: []\n",
        tick_interval_s=0.2,
        extra_yaml=(
            f"backend: {{kind: aws, aws: {{region: {REGION}, endpoint_url: '{moto_url}',"
            " poll_interval_s: 0.2, call_timeout_s: 10}}\n"
            "lifecycle: {preflight_burn_s: 0.2, spare_preflight_ahead: false}\n"
        ),
    )
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    controller = start_controller(cfg, log_path=short_tmp / "controller.log", env=env)
    agents: list[AgentProcess] = []
    try:
        url = controller.url
        agents.append(_agent(short_tmp / "a", url, node="node-a", instance_id=old))
        wait_for(lambda: _node(url, "node-a"), timeout_s=30, what="node-a registered")
        r = httpx.post(
            f"{url}/v1/nodes/node-a/retire", json={"reason": "RMA 4411"}, headers=OP, timeout=10
        )
        assert r.status_code == 200, r.text

        # the group terminates the old instance and launches a replacement
        wait_for(
            lambda: old not in _group_instances(moto_url) and len(_group_instances(moto_url)) == 2,
            timeout_s=30,
            what="the old instance terminated and a replacement launched",
        )
        (new,) = set(_group_instances(moto_url)) - {old, other}
        agents[0].terminate()  # its instance is gone
        agents.append(_agent(short_tmp / "b", url, node="node-b", instance_id=new))
        wait_for(
            lambda: (_node(url, "node-b") or {}).get("role") == "spare",
            timeout_s=60,
            what="the replacement to join as a spare",
        )
        joined = _node(url, "node-b")
        assert joined is not None and joined["state"] == "active"
        assert joined["last_preflight"]["passed"] is True  # a spare only after a pass
        retired = _node(url, "node-a")
        assert retired is not None and retired["state"] == "retired"
        assert retired["drain_reason"] == (
            f"replaced: instance {old} terminated in {GROUP}; node-b ({new}) joined as a spare"
            " after a passing preflight"
        )
        log = controller.log()
        assert log.count("event=instance_terminated ") == 1, log
        assert SECRET not in log
        assert set(_group_instances(moto_url)) == {other, new}  # nothing else was touched
    finally:
        for agent in agents:
            agent.kill()
        controller.kill()
