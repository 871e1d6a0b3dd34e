"""Command args: one class per command kind, built by the controller and decoded by the agent
with the same schema; a bad field names it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainguard.command_args import (
    COMMAND_ARGS,
    AssignStandbyArgs,
    CheckpointArgs,
    CollectStacksArgs,
    CommandArgs,
    PreflightArgs,
    RejoinArgs,
    RejoinRank,
    RepairArgs,
    SetCheckpointIntervalArgs,
    StartJobArgs,
    StopJobArgs,
    StopRanksArgs,
    command,
    command_kind,
    decode_args,
)
from trainguard.membership import Membership
from trainguard.protocol import (
    CommandKind,
    FaultSpec,
    ProtocolError,
    ReportResponse,
    decode_json,
    encode_json,
)


def _member(rank: int, *, epoch: int = 3) -> str:
    return Membership(
        rank=rank,
        world_size=2,
        store_host="10.0.0.2",
        store_port=29650,
        epoch=epoch,
        host_store=rank == 0,
    ).to_json()


EXAMPLES: dict[CommandKind, CommandArgs] = {
    CommandKind.CHECKPOINT: CheckpointArgs(job="llm", request_id="ckpt-1"),
    CommandKind.STOP_RANKS: StopRanksArgs(job="llm", checkpoint=True),
    CommandKind.START_JOB: StartJobArgs(
        job="llm",
        attempt=2,
        command=["train.py", "--steps", "10"],
        nproc_per_node=8,
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="10.0.0.1:29500",
        rdzv_id="llm-2",
        env={"NCCL_DEBUG": "WARN"},
        ckpt_dir="/ckpt/llm",
        rdzv_conf={"join_timeout": "120"},
    ),
    CommandKind.STOP_JOB: StopJobArgs(job="llm", grace_s=12.5),
    CommandKind.INJECT_FAULT: FaultSpec(kind="xid", gpu=3, code=48),
    CommandKind.COLLECT_STACKS: CollectStacksArgs(job="llm"),
    CommandKind.PREFLIGHT: PreflightArgs(
        checks=["ecc", "compute_burn"], reference={"compute_burn_tflops": 400.0}, tolerance=0.15
    ),
    CommandKind.REPAIR: RepairArgs(method="gpu_reset", gpus=[0, 3]),
    CommandKind.SET_CHECKPOINT_INTERVAL: SetCheckpointIntervalArgs(
        job="llm", every_steps=250, request_id="ckpt-interval-llm-3"
    ),
    CommandKind.REJOIN: RejoinArgs(
        job="llm", epoch=3, ranks=(RejoinRank(rank=1, membership=_member(0)),)
    ),
    CommandKind.ASSIGN_STANDBY: AssignStandbyArgs(
        job="llm", epoch=3, membership=_member(1), module="examples.train", env={"A": "1"}
    ),
}


def test_every_command_kind_has_an_args_class() -> None:
    assert set(COMMAND_ARGS) == set(CommandKind)
    assert set(EXAMPLES) == set(CommandKind)


@pytest.mark.parametrize("kind", list(CommandKind), ids=str)
def test_args_round_trip_through_a_command_on_the_wire(kind: CommandKind) -> None:
    args = EXAMPLES[kind]
    assert command_kind(args) is kind
    cmd = command(f"c-{kind}", args)
    assert cmd.kind is kind
    wire = decode_json(ReportResponse, encode_json(ReportResponse(ack_event_id=0, commands=(cmd,))))
    assert wire.commands == (cmd,)
    assert decode_args(COMMAND_ARGS[kind], json.loads(json.dumps(wire.commands[0].args))) == args


@pytest.mark.parametrize(
    ("cls", "args", "message"),
    [
        pytest.param(
            StartJobArgs,
            {**EXAMPLES[CommandKind.START_JOB].__dict__, "nproc_per_node": 0},
            "args.nproc_per_node: must be >= 1, got 0",
            id="start-job-nproc",
        ),
        pytest.param(
            StartJobArgs,
            {**EXAMPLES[CommandKind.START_JOB].__dict__, "nnodes": "2"},
            "args.nnodes: expected an integer, got string",
            id="start-job-type",
        ),
        pytest.param(
            StopJobArgs, {"job": "j", "grace": 1}, "args.grace: unknown key", id="stop-job-typo"
        ),
        pytest.param(
            CheckpointArgs, {}, "args.job: required non-empty string", id="checkpoint-no-job"
        ),
        pytest.param(
            StopRanksArgs,
            {"job": "j", "checkpoint": "yes"},
            "args.checkpoint: expected true or false, got string",
            id="stop-ranks-bool",
        ),
        pytest.param(FaultSpec, {"kind": "meltdown"}, "args.kind: must be one of", id="fault"),
        pytest.param(
            CollectStacksArgs, {"job": 7}, "args.job: expected a string, got integer", id="stacks"
        ),
    ],
)
def test_a_bad_field_is_named(cls: type, args: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode_args(cls, args)
    assert str(err.value).startswith(message)
    assert err.value.field.startswith("args.")


def test_the_controller_cannot_build_args_the_agent_would_refuse() -> None:
    with pytest.raises(ValueError, match="grace_s: must be in"):
        StopJobArgs(job="j", grace_s=-1.0)
    with pytest.raises(TypeError, match="not a command's args"):
        command_kind({"job": "j"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"job": "llm", "epoch": 3, "ranks": []}, "args.ranks"),
        (
            {"job": "llm", "epoch": 4, "ranks": [{"rank": 1, "membership": _member(0)}]},
            "args.ranks[0].membership",
        ),
        (
            {
                "job": "llm",
                "epoch": 3,
                "ranks": [{"rank": 1, "membership": _member(0)}] * 2,
            },
            "args.ranks[1].rank",
        ),
        (
            {"job": "llm", "epoch": -1, "ranks": [{"rank": 1, "membership": _member(0)}]},
            "args.epoch",
        ),
        (
            {"job": "llm", "epoch": 3, "ranks": [{"rank": 0, "membership": "{}"}]},
            "args.ranks[0].membership",
        ),
    ],
    ids=[
        "no-ranks",
        "membership-of-another-epoch",
        "rank-twice",
        "negative-epoch",
        "bad-membership",
    ],
)
def test_a_bad_rejoin_names_its_field(args: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_args(RejoinArgs, args)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"module": "not a module"}, "args.module"),
        ({"env": {"TRAINGUARD_JOB": "other"}}, "args.env.TRAINGUARD_JOB"),
        ({"membership": _member(1, epoch=2)}, "args.membership"),
        ({"job": "bad name!"}, "args.job"),
    ],
    ids=["module", "reserved-env", "membership-epoch", "job-name"],
)
def test_a_bad_standby_assignment_names_its_field(change: dict[str, Any], field: str) -> None:
    good = {"job": "llm", "epoch": 3, "membership": _member(1), "module": "examples.train"}
    with pytest.raises(ProtocolError) as e:
        decode_args(AssignStandbyArgs, {**good, **change})
    assert e.value.field == field
