"""Cloud replacement (the aws backend) on a FakeClock over a recording Auto Scaling fake: a
retired node's instance is terminated through its group once and only once (a controller
killed at any point included), within the replacement budget and its rate limit, and the old
node's record is closed with the reason; the config is strict."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.controller.backends.fake_asg import OLD, FakeAsg
from tests.unit.controller.job_sim import Sim
from trainguard.command_args import PreflightArgs
from trainguard.controller.actions.base import PermanentError, TransientError
from trainguard.controller.backends.aws.asg import Boto3AsgClient
from trainguard.controller.backends.aws.plan import CloudNode, plan_terminations
from trainguard.controller.backends.aws.terminate import TerminateInstanceHandler
from trainguard.controller.backends.config import AwsBackendConfig, BackendConfig
from trainguard.controller.records import CommandRecord
from trainguard.strict import ConfigError, build

# --- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key", "reason"),
    [
        ({"kind": "aws"}, "backend.aws.region", "required with kind: aws"),
        ({"kind": "aws", "aws": {"region": "us-east"}}, "backend.aws.region", "not an AWS region"),
        ({"aws": {"region": "US-EAST-1"}}, "backend.aws.region", "not an AWS region"),
        ({"aws": {"max_in_flight": 0}}, "backend.aws.max_in_flight", "within 1..100"),
        ({"aws": {"replace_max": 5000}}, "backend.aws.replace_max", "within 1..1000"),
        ({"aws": {"replace_max": 1, "max_in_flight": 2}}, "backend.aws.max_in_flight", "exceed"),
        ({"aws": {"replace_window_s": 1}}, "backend.aws.replace_window_s", "within 60"),
        ({"aws": {"endpoint_url": "localhost:5000"}}, "backend.aws.endpoint_url", "http://"),
        ({"aws": {"region_label": "aws_instance_id"}}, "backend.aws.region_label", "differ"),
        ({"aws": {"regoin": "us-east-1"}}, "backend.aws.regoin", ""),
    ],
    ids=[
        "region-required",
        "region-short",
        "region-case",
        "in-flight-zero",
        "replace-max-unbounded",
        "in-flight-over-max",
        "window-too-short",
        "endpoint-scheme",
        "labels-clash",
        "typo",
    ],
)
def test_bad_aws_config_names_the_key_and_the_reason(
    data: dict[str, Any], key: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build(BackendConfig, data, source="c.yaml", prefix="backend")
    assert info.value.key == key
    assert reason in info.value.reason


def test_aws_config_takes_real_region_names() -> None:
    for region in ("us-east-1", "eu-central-2", "ap-southeast-4", "us-gov-west-1", "cn-north-1"):
        assert build(AwsBackendConfig, {"region": region}).region == region


# --- the plan: the budget and the rate limit -----------------------------------------------------


def _retired(name: str, **labels: str) -> CloudNode:
    return CloudNode(name=name, state="retired", job=None, labels=labels)


def _plan(nodes: list[CloudNode], *, in_flight: int = 0, started: int = 0, **cfg: Any) -> Any:
    config = AwsBackendConfig(region="us-east-1", **cfg)
    return plan_terminations(
        nodes,
        config=config,
        planned_before=lambda key: False,
        in_flight=in_flight,
        started_in_window=started,
    )


def test_only_retired_nodes_with_an_instance_id_are_planned() -> None:
    nodes = [
        _retired("n1", aws_instance_id=OLD["n1"], aws_region="eu-west-1"),
        CloudNode("n2", "drained", None, {"aws_instance_id": OLD["n2"]}),
        CloudNode("n3", "retired", "job", {"aws_instance_id": "i-0123456789abcdef0"}),
        _retired("n5"),  # not a cloud node
    ]
    plan = _plan(nodes, max_in_flight=2)
    assert [(t.node, t.instance_id, t.region) for t in plan.planned] == [
        ("n1", OLD["n1"], "eu-west-1")
    ]
    assert plan.held == {}


def test_a_node_closed_as_replaced_is_never_planned_again() -> None:
    # its row may be gone with the store's retention; its record still says it was replaced
    node = CloudNode(
        "n1", "retired", None, {"aws_instance_id": OLD["n1"]}, reason="replaced: instance ..."
    )
    assert _plan([node]).planned == []


def test_a_bad_instance_id_or_region_label_is_held_with_the_reason() -> None:
    plan = _plan(
        [
            _retired("n1", aws_instance_id="i-XYZ"),
            _retired("n2", aws_instance_id=OLD["n2"], aws_region="moon-1"),
        ]
    )
    assert plan.planned == []
    assert plan.held == {
        "n1": "label aws_instance_id='i-XYZ': not an instance id",
        "n2": "label aws_region='moon-1': not a region name",
    }


def test_the_budget_holds_what_exceeds_max_in_flight_and_the_rate_limit() -> None:
    nodes = [_retired(n, aws_instance_id=i) for n, i in OLD.items()]
    plan = _plan(nodes, max_in_flight=2, replace_max=4)
    assert [t.node for t in plan.planned] == ["n1", "n2"]
    assert "max_in_flight 2" in plan.held["n4"]
    assert [t.node for t in _plan(nodes, in_flight=1, max_in_flight=2).planned] == ["n1"]
    assert _plan(nodes, in_flight=2, max_in_flight=2).planned == []
    plan = _plan(nodes, started=3, max_in_flight=2, replace_max=4)
    assert [t.node for t in plan.planned] == ["n1"]
    assert "replace_max 4" in plan.held["n2"]
    assert _plan(nodes, replace_retired=False).planned == []


# --- the step: phases, crashes, refusals ---------------------------------------------------------


class _Ops:
    """The node operations the step uses; a new node's preflight answers `preflight_ok`."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states = states
        self.reasons: dict[str, str | None] = {}
        self.commands: dict[str, CommandRecord] = {}
        self.preflight_ok: bool | None = True  # None: not answered
        self.roles: dict[str, str] = {}

    def queue_command(self, node: str, args: Any, *, command_id: str) -> None:
        done = None if self.preflight_ok is None else 1.0
        result = "passed (ecc)" if self.preflight_ok else "failed: ecc: 2 uncorrectable errors"
        self.commands.setdefault(
            command_id,
            CommandRecord(
                command_id, node, "preflight", {}, 0.0, 0.0, done, self.preflight_ok, result
            ),
        )

    def command_status(self, command_id: str) -> CommandRecord | None:
        return self.commands.get(command_id)

    def node_state(self, node: str) -> str | None:
        return self.states.get(node)

    def set_node_state(self, node: str, state: str, *, reason: str | None) -> None:
        self.states[node] = state
        self.reasons[node] = reason


def _ctx(progress: dict[str, Any], *, now: float = 100.0) -> Any:
    from tests.conformance.backend_suite import step_ctx  # noqa: PLC0415 - the shared builder

    return step_ctx(
        "terminate_instance",
        now=now,
        params={"node": "n1", "instance_id": OLD["n1"], "region": "us-east-1"},
        key="terminate:n1:" + OLD["n1"],
        progress=progress,
    )


def _handler(asg: FakeAsg, ops: _Ops, *, timeout_s: float = 600.0) -> TerminateInstanceHandler:
    """The step over `asg` and `ops`; a replacement's agent registers as node "n9"."""
    return TerminateInstanceHandler(
        client_for=lambda region: asg,  # type: ignore[arg-type,return-value]
        ops=ops,  # type: ignore[arg-type]
        node_of_instance=lambda instance_id: "n9" if instance_id.startswith("i-0feed") else None,
        set_role=ops.roles.__setitem__,
        preflight=PreflightArgs(),
        timeout_s=timeout_s,
    )


def _run_to_end(handler: TerminateInstanceHandler, asg: FakeAsg, progress: dict[str, Any]) -> Any:
    now = 100.0
    for _ in range(10):
        outcome = handler.run(_ctx(progress, now=now))
        if outcome.done:
            return outcome
        progress = outcome.output
        if progress["phase"] == "terminated":
            asg.settle()
        now += 10.0
    raise AssertionError("the step did not finish")


def test_the_step_records_its_intent_then_terminates_once_and_closes_the_record() -> None:
    asg, ops = FakeAsg(), _Ops({"n1": "retired"})
    handler = _handler(asg, ops)
    first = handler.run(_ctx({}))
    assert first.output["phase"] == "intent" and asg.terminated() == []  # nothing called yet
    assert first.output["group"] == "gpu-workers" and OLD["n1"] in first.output["before"]
    outcome = _run_to_end(handler, asg, first.output)
    assert asg.terminated() == [OLD["n1"]]
    replacement = outcome.output["replacement"]
    assert replacement.startswith("i-0feed") and replacement not in OLD.values()
    assert ops.states["n1"] == "retired"
    assert ops.reasons["n1"] == (
        f"replaced: instance {OLD['n1']} terminated in gpu-workers; n9 ({replacement}) joined"
        " as a spare after a passing preflight"
    )
    assert ops.roles == {"n9": "spare"}  # only after its preflight passed
    assert [c.node for c in ops.commands.values()] == ["n9"]


def test_a_replacement_that_fails_its_preflight_is_drained_and_never_a_spare() -> None:
    asg, ops = FakeAsg(), _Ops({"n1": "retired", "n9": "active"})
    ops.preflight_ok = False
    with pytest.raises(PermanentError, match="n9 \\(replacing n1\\): preflight failed: ecc"):
        _run_to_end(_handler(asg, ops), asg, {})
    assert ops.states["n9"] == "drained"
    assert ops.reasons["n9"] == "preflight failed: ecc: 2 uncorrectable errors"
    assert ops.roles == {}


def test_a_rerun_after_the_terminate_call_never_calls_again() -> None:
    # killed after the call, before its progress was saved: the row still says `intent`
    asg, ops = FakeAsg(), _Ops({"n1": "retired"})
    handler = _handler(asg, ops)
    intent = handler.run(_ctx({})).output
    handler.run(_ctx(intent))  # the call happens; its outcome is "lost"
    assert asg.terminated() == [OLD["n1"]]
    again = handler.run(_ctx(intent))  # the resumed row, as it was saved
    assert again.output["phase"] == "terminated"
    asg.settle()  # and when the instance has already left its group
    assert handler.run(_ctx(intent)).output["phase"] == "terminated"
    assert asg.terminated() == [OLD["n1"]]


def test_a_timeout_on_the_call_is_retried_without_a_second_terminate() -> None:
    asg, ops = FakeAsg(), _Ops({"n1": "retired"})
    handler = _handler(asg, ops)
    intent = handler.run(_ctx({})).output

    class _Reached(TransientError):
        pass

    asg.fail_next = _Reached("TerminateInstanceInAutoScalingGroup: ReadTimeoutError")
    asg.states[OLD["n1"]] = "InService"
    with pytest.raises(TransientError):
        handler.run(_ctx(intent))
    asg.states[OLD["n1"]] = "Terminating"  # the request reached AWS before the read timed out
    assert handler.run(_ctx(intent)).output["phase"] == "terminated"
    assert asg.terminated() == [OLD["n1"]]  # the one attempt that raised


def test_a_node_brought_back_before_the_call_keeps_its_instance() -> None:
    asg, ops = FakeAsg(), _Ops({"n1": "retired"})
    handler = _handler(asg, ops)
    intent = handler.run(_ctx({})).output
    ops.states["n1"] = "validating"  # `agentctl node return` won the race
    with pytest.raises(PermanentError, match="n1 is validating now, not retired"):
        handler.run(_ctx(intent))
    assert asg.terminated() == []


def test_an_instance_in_no_group_fails_the_step_without_a_call() -> None:
    asg, ops = FakeAsg(), _Ops({"n1": "retired"})
    del asg.states[OLD["n1"]]
    with pytest.raises(PermanentError, match="in no Auto Scaling Group"):
        _handler(asg, ops).run(_ctx({}))
    assert asg.terminated() == []


def test_no_replacement_in_time_fails_the_step_and_says_so_on_the_node() -> None:
    asg, ops = FakeAsg(), _Ops({"n1": "retired"})
    handler = _handler(asg, ops, timeout_s=60.0)
    progress = handler.run(_ctx({})).output
    progress = handler.run(_ctx(progress, now=100.0)).output
    assert handler.run(_ctx(progress, now=150.0)).done is False
    with pytest.raises(PermanentError, match="no replacement reached service within 60 s"):
        handler.run(_ctx(progress, now=161.0))
    assert "no replacement reached service" in str(ops.reasons["n1"])
    assert asg.terminated() == [OLD["n1"]]


# --- a controller on the fake clock ----------------------------------------------------------


Cloud = tuple[Sim, FakeAsg, dict[str, Any]]


def _rows(sim: Sim) -> list[tuple[str, str]]:
    rows = sim.c.store.db.query(
        "SELECT target, state FROM actions WHERE kind = 'terminate_instance' ORDER BY id"
    )
    return [(str(r[0]), str(r[1])) for r in rows]


def _settle(sim: Sim, asg: FakeAsg) -> None:
    """The group launches the replacements; each one's agent registers (as n9, n10, ...)."""
    for instance_id in asg.settle():
        sim.second(2)  # the instance boots
        sim.add(f"n{len(sim.agents) + 6}", aws_instance_id=instance_id)


def test_a_retired_node_is_replaced_through_its_group(cloud: Cloud) -> None:
    sim, asg, _ = cloud
    sim.c.retire("n1", reason="RMA 4411", actor="ops")
    sim.until(lambda: asg.terminated() == [OLD["n1"]], max_s=5, what="the terminate call")
    _settle(sim, asg)
    assert sim.c.get_node("n9").role == "active"  # registered, not a spare yet
    sim.until(lambda: _rows(sim) == [("n1", "succeeded")], max_s=5, what="the step done")
    assert sim.cmds("n9", "preflight") and sim.c.get_node("n9").role == "spare"
    node = sim.c.get_node("n1")
    assert node.state == "retired" and str(node.drain_reason).startswith(
        f"replaced: instance {OLD['n1']} terminated in gpu-workers; n9 (i-0feed"
    )
    sim.second(5)
    assert asg.terminated() == [OLD["n1"]]  # planned once per node and instance


def test_retirements_beyond_the_budget_wait_their_turn(cloud: Cloud) -> None:
    sim, asg, _ = cloud
    for node in OLD:
        sim.c.retire(node, reason="bad driver push", actor="ops")
    sim.second(3)
    assert asg.terminated() == [OLD["n1"]]  # max_in_flight 1: one out at once
    asg.settle()
    sim.second(5)
    assert len(asg.terminated()) == 1  # out until its replacement joined
    sim.add("n9", aws_instance_id=sorted(i for i in asg.states if i.startswith("i-0feed"))[0])
    sim.until(lambda: len(asg.terminated()) == 2, max_s=5, what="the next one")
    _settle(sim, asg)
    sim.until(lambda: len(asg.terminated()) == 3, max_s=5, what="the third one")


def test_the_rate_limit_holds_the_rest_until_the_window_passes(cloud: Cloud) -> None:
    sim, asg, settings = cloud
    settings["aws"] = {"replace_max": 1, "replace_window_s": 600}
    sim.c = sim.new_controller()
    sim.c.retire("n1", reason="RMA", actor="ops")
    sim.c.retire("n2", reason="RMA", actor="ops")
    sim.until(lambda: asg.terminated() == [OLD["n1"]], max_s=5, what="the first")
    _settle(sim, asg)
    sim.second(60)
    assert _rows(sim) == [("n1", "succeeded")]
    assert asg.terminated() == [OLD["n1"]]  # done, but the window allows one
    sim.clock.advance(600)
    sim.until(lambda: len(asg.terminated()) == 2, max_s=5, what="after the window")


@pytest.mark.parametrize("killed", ["before-the-call", "after-the-call"])
def test_a_controller_killed_mid_step_terminates_once(cloud: Cloud, killed: str) -> None:
    sim, asg, _ = cloud
    sim.c.retire("n1", reason="RMA", actor="ops")
    sim.c.cloud.planner.plan(now=sim.clock.now())  # type: ignore[union-attr]
    ((action, _),) = sim.c.store.actions.open()
    sim.c.runner.run_one(action.id, now=sim.clock.now())  # the intent is saved
    assert sim.c.store.actions.output(action.id)["phase"] == "intent"
    if killed == "after-the-call":
        asg.terminate(OLD["n1"])  # the call went out; the controller died before saving
    sim.c = sim.new_controller()  # kill -9: the old one never stops; the store is all that is left
    sim.until(lambda: len(asg.terminated()) == 1, max_s=5, what="the one call")
    _settle(sim, asg)
    sim.until(lambda: _rows(sim) == [("n1", "succeeded")], max_s=10, what="the step done")
    assert asg.terminated() == [OLD["n1"]]


def test_dry_run_plans_nothing(cloud: Cloud) -> None:
    sim, asg, settings = cloud
    settings["safety"] = {"dry_run": True}
    sim.c = sim.new_controller()
    sim.c.retire("n1", reason="RMA", actor="ops")
    assert sim.c.get_node("n1").state == "retired"
    sim.second(5)
    assert asg.terminated() == [] and _rows(sim) == []


def test_a_replacement_under_the_old_name_is_left_to_node_return() -> None:
    asg, ops = FakeAsg(), _Ops({"n1": "retired"})
    handler = TerminateInstanceHandler(
        client_for=lambda region: asg,  # type: ignore[arg-type,return-value]
        ops=ops,  # type: ignore[arg-type]
        node_of_instance=lambda instance_id: "n1",  # the new instance took the old name
        set_role=ops.roles.__setitem__,
        preflight=PreflightArgs(),
        timeout_s=600.0,
    )
    outcome = _run_to_end(handler, asg, {})
    assert "agentctl node return" in outcome.message
    assert ops.states["n1"] == "retired" and ops.roles == {} and ops.commands == {}


# --- the boto3 client's errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("Throttling", 400, TransientError),
        ("InternalFailure", 500, TransientError),
        ("ScalingActivityInProgress", 400, TransientError),
        ("AccessDenied", 403, PermanentError),
        ("ValidationError", 400, PermanentError),
    ],
    ids=["throttled", "5xx", "activity-in-progress", "access-denied", "bad-id"],
)
def test_aws_errors_are_transient_or_permanent_and_name_the_call_and_code(
    code: str, status: int, kind: type[Exception]
) -> None:
    from botocore.exceptions import ClientError  # noqa: PLC0415 - the aws extra, as the product

    client = Boto3AsgClient(region="us-east-1", endpoint_url="http://127.0.0.1:9")
    error = ClientError(
        {"Error": {"Code": code, "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "TerminateInstanceInAutoScalingGroup",
    )

    def fail() -> dict[str, Any]:
        raise error

    with pytest.raises(kind) as info:
        client._call("TerminateInstanceInAutoScalingGroup", fail)
    assert str(info.value) == f"TerminateInstanceInAutoScalingGroup in us-east-1: {code}: no"


def test_missing_credentials_are_permanent_and_never_printed() -> None:
    from botocore.exceptions import NoCredentialsError  # noqa: PLC0415

    client = Boto3AsgClient(region="eu-west-1")

    def fail() -> dict[str, Any]:
        raise NoCredentialsError()

    with pytest.raises(PermanentError, match="no AWS credentials"):
        client._call("DescribeAutoScalingInstances", fail)
