"""Command dispatch: control relays, fault injection, unsupported kinds, handler failures."""

from __future__ import annotations

from trainguard.agent.commands import CommandExecutor, CommandResult, default_executor
from trainguard.protocol import Command, Control, FaultSpec


class RecordingSender:
    def __init__(self, result: tuple[int, int] = (2, 0)) -> None:
        self.sent: list[tuple[str, Control]] = []
        self.result = result

    def send_control(self, job: str, control: Control) -> tuple[int, int]:
        self.sent.append((job, control))
        return self.result


class RecordingFaults:
    def __init__(self) -> None:
        self.specs: list[FaultSpec] = []

    def inject(self, spec: FaultSpec) -> None:
        if spec.gpu > 7:
            raise ValueError("gpu: no GPU 9 on this node (0..7)")
        self.specs.append(spec)


def test_checkpoint_relays_a_control_to_the_jobs_ranks() -> None:
    sender = RecordingSender()
    ex = default_executor(sender=sender, fault_target=None)
    res = ex.execute(Command(id="c1", kind="checkpoint", args={"job": "j1", "request_id": "r9"}))
    assert res.ok and res.data["ranks_sent"] == 2
    assert sender.sent == [("j1", Control(action="checkpoint", request_id="r9", job="j1"))]


def test_stop_ranks_with_checkpoint_sends_checkpoint_stop() -> None:
    sender = RecordingSender()
    ex = default_executor(sender=sender, fault_target=None)
    ex.execute(Command(id="c2", kind="stop_ranks", args={"job": "j1", "checkpoint": True}))
    ex.execute(Command(id="c3", kind="stop_ranks", args={"job": "j1"}))
    assert [c.action for _, c in sender.sent] == ["checkpoint_stop", "stop"]
    assert sender.sent[0][1].request_id == "c2"  # defaults to the command id


def test_set_checkpoint_interval_relays_the_new_interval_under_the_decisions_id() -> None:
    sender = RecordingSender()
    ex = default_executor(sender=sender, fault_target=None)
    args = {"job": "j1", "every_steps": 250, "request_id": "ckpt-interval:j1:3"}
    res = ex.execute(
        Command(id="ckpt-interval:j1:3:a2:n1", kind="set_checkpoint_interval", args=args)
    )
    assert res.ok
    want = Control(
        action="set_interval", request_id="ckpt-interval:j1:3", job="j1", every_steps=250
    )
    assert sender.sent == [("j1", want)]
    bad = ex.execute(
        Command(id="c9", kind="set_checkpoint_interval", args={"job": "j1", "every_steps": 0})
    )
    assert not bad.ok and "args.every_steps" in bad.message


def test_relay_with_no_reachable_rank_is_not_ok() -> None:
    ex = default_executor(sender=RecordingSender((0, 0)), fault_target=None)
    res = ex.execute(Command(id="c1", kind="checkpoint", args={"job": "j1"}))
    assert not res.ok and "no reachable rank" in res.message


def test_missing_job_argument_is_a_clear_failure() -> None:
    ex = default_executor(sender=RecordingSender(), fault_target=None)
    res = ex.execute(Command(id="c1", kind="checkpoint", args={}))
    assert not res.ok and res.message == "args.job: required non-empty string"


def test_inject_fault_applies_the_spec_or_names_the_bad_field() -> None:
    faults = RecordingFaults()
    ex = default_executor(sender=RecordingSender(), fault_target=faults)
    ok = ex.execute(Command(id="f1", kind="inject_fault", args={"kind": "dbe", "gpu": 2}))
    bad_kind = ex.execute(Command(id="f2", kind="inject_fault", args={"kind": "meltdown"}))
    bad_gpu = ex.execute(Command(id="f3", kind="inject_fault", args={"kind": "dbe", "gpu": 9}))
    assert ok.ok and faults.specs == [FaultSpec(kind="dbe", gpu=2)]
    assert not bad_kind.ok and bad_kind.message.startswith("args.kind:")
    assert not bad_gpu.ok and bad_gpu.message.startswith("gpu:")


def test_inject_fault_without_sim_backend_is_refused() -> None:
    ex = default_executor(sender=RecordingSender(), fault_target=None)
    res = ex.execute(Command(id="f1", kind="inject_fault", args={"kind": "dbe"}))
    assert not res.ok and "sim" in res.message


def test_job_commands_are_not_supported_until_a_backend_registers() -> None:
    ex = default_executor(sender=RecordingSender(), fault_target=None)
    res = ex.execute(Command(id="s1", kind="start_job", args={"job": "j"}))
    assert not res.ok and "not supported yet" in res.message
    ex.register("start_job", lambda cmd: CommandResult(ok=True, message="started"))
    assert ex.execute(Command(id="s2", kind="start_job")).ok


def test_a_crashing_handler_becomes_a_failed_result() -> None:
    def boom(cmd: Command) -> CommandResult:
        raise RuntimeError("bug")

    ex = CommandExecutor({"checkpoint": boom})
    res = ex.execute(Command(id="x", kind="checkpoint"))
    assert not res.ok and res.message == "internal error: RuntimeError"
    assert not ex.execute(Command(id="y", kind="stop_job")).ok  # unknown kind
