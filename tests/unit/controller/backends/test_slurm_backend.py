"""The Slurm backend against a fake Slurm (tests/fakes/slurm.py): what it prints is parsed,
drains are Slurm's and only trainguard's own are undone, others' drains show with their
reason, a failing Slurm command fails the step with Slurm's message, and a replace + restart
takes a spare out of the reservation, requeues (held), pins the new node set and releases.
The closed loop on real Slurm is tests/e2e/test_slurm_loop.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from tests.builders import Reporter
from tests.fakes.slurm import FakeSlurm
from trainguard.clock import FakeClock
from trainguard.controller.actions.base import (
    ActionContext,
    PermanentError,
    TransientError,
)
from trainguard.controller.actions.restartloop import LOOP_KEY
from trainguard.controller.backends.config import BackendConfig
from trainguard.controller.backends.slurm.backend import SlurmBackend, node_state_of
from trainguard.controller.backends.slurm.cli import (
    SlurmNode,
    parse_reservation,
    parse_sinfo,
    parse_squeue,
)
from trainguard.controller.composition import ActionBackends, Controller
from trainguard.controller.errors import BadRequest
from trainguard.controller.hostlist import expand_hostlist
from trainguard.controller.records import NewAction
from trainguard.controller.views import ActionView
from trainguard.protocol import RankState
from trainguard.strict import ConfigError, build
from trainguard.trainer.channel import job_name

NODES = ("n1", "n2", "n3", "n4")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("n1", ["n1"]),
        ("n[1,3-4]", ["n1", "n3", "n4"]),
        ("gpu[08-10],login1", ["gpu08", "gpu09", "gpu10", "login1"]),
        ("", []),
    ],
    ids=["single", "ranges", "zero-padded-and-plain", "empty"],
)
def test_host_lists_expand_like_scontrol_show_hostnames(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


def test_sinfo_and_squeue_json_parse_into_nodes_and_jobs() -> None:
    nodes = parse_sinfo(
        '{"errors": [], "nodes": [{"name": "n2", "state": "allocated", "state_flags": ["DRAIN"],'
        ' "reason": "trainguard: gpu_dbe incident 3", "reason_set_by_user": "root"}]}'
    )
    assert nodes["n2"].drain and nodes["n2"].busy and not nodes["n2"].usable
    assert node_state_of(nodes["n2"]) == ("draining", "trainguard: gpu_dbe incident 3")
    jobs = parse_squeue(
        '{"errors": [], "jobs": [{"job_id": 42, "name": "tg", "job_state": "RUNNING",'
        ' "nodes": "n[1-3]", "restart_cnt": 1, "node_count": 3}]}'
    )
    assert jobs["42"].nodes == ("n1", "n2", "n3") and jobs["42"].restart_cnt == 1
    assert parse_reservation("ReservationName=r Nodes=n[4-5] NodeCnt=2") == ("n4", "n5")


def test_a_drain_made_by_someone_else_shows_who_set_it() -> None:
    node = SlurmNode(name="n3", state="idle", flags=frozenset({"DRAIN"}), reason="bad fan",
                     reason_user="alice")  # fmt: skip
    assert node_state_of(node) == ("drained", "bad fan (Slurm drain, set by alice)")


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"kind": "slurm", "slurm": {"spare_reservaton": "x"}}, "spare_reservaton"),
        ({"kind": "lsf"}, "kind"),
        ({"kind": "slurm", "slurm": {"sync_interval_s": 0}}, "sync_interval_s"),
        ({"kind": "slurm", "slurm": {"node_names": {"a": "x", "b": "x"}}}, "node_names"),
        (
            {"kind": "slurm", "slurm": {"spare_reservation_users": "root bob"}},
            "spare_reservation_users",
        ),
    ],
    ids=["unknown-key", "unknown-kind", "zero-interval", "two-agents-one-node", "users-not-a-list"],
)
def test_the_backend_section_is_strict(section: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build(BackendConfig, section, source="controller.yaml")


def test_the_trainer_names_a_slurm_job_by_its_id() -> None:
    assert job_name({"SLURM_JOB_ID": "42"}) == "slurm-42"
    assert job_name({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "r"}) == "slurm-42"
    assert job_name({"SLURM_JOB_ID": "42", "TRAINGUARD_JOB": "mine"}) == "mine"


# --- the backend in a controller ------------------------------------------------------------


@pytest.fixture
def slurm() -> FakeSlurm:
    return FakeSlurm(NODES, spares=["n4"])


@pytest.fixture
def core(
    make_core: Callable[..., Controller], core_config: Callable[..., Any], core_clock: FakeClock,
    slurm: FakeSlurm,
) -> Controller:  # fmt: skip
    c = Controller(
        core_config(backend={"kind": "slurm"}),
        clock=core_clock,
        backends=ActionBackends(notifiers=[], slurm_runner=slurm),
    )
    for n in NODES:
        c.ingest_report(Reporter(n).report(now=core_clock.now()), actor="a")
    backend(c).refresh()
    yield c
    c.stop()


def backend(c: Controller) -> SlurmBackend:
    assert isinstance(c.backend, SlurmBackend)
    return c.backend


def ctx(kind: str, *, now: float, params: dict[str, Any], **extra: Any) -> ActionContext:
    view = ActionView(
        id=1, incident_id=None, kind=kind, target=str(params.get("node", "")), state="running",
        attempts=1, idempotency_key=f"k:{kind}", created_at=now, updated_at=now, params=params,
    )  # fmt: skip
    return ActionContext(action=view, incident=None, now=now, attempt=1, **extra)


def test_drain_is_scontrol_drain_with_the_rule_and_incident_in_the_reason(core, slurm):
    state, _ = backend(core).drain("n2", reason="x", key="k", rule="gpu_dbe", incident_id=7)
    assert state == "drained"
    assert ("scontrol", "update", "nodename=n2", "state=drain",
            "reason=trainguard: gpu_dbe incident 7") in slurm.calls  # fmt: skip
    assert core.get_node("n2").drain_reason == "trainguard: gpu_dbe incident 7"
    assert core.get_node("n2").state == "drained"  # nothing runs there


def test_a_node_still_running_a_job_shows_draining_until_slurm_frees_it(core, slurm):
    slurm.submit("7", ["n1", "n2", "n3"])
    backend(core).drain("n2", reason="x", key="k", rule="gpu_dbe", incident_id=7)
    assert core.get_node("n2").state == "draining"
    slurm.jobs["7"].state = "COMPLETED"
    slurm.nodes["n2"].state = "idle"
    backend(core).refresh()
    assert core.get_node("n2").state == "drained"


def test_undrain_resumes_only_trainguards_own_drains_unless_forced(core, slurm):
    slurm.admin("n3", state="drain", reason="NHC: disk full", user="nhc")
    backend(core).refresh()
    view = core.get_node("n3")
    assert (
        view.state == "drained" and view.drain_reason == "NHC: disk full (Slurm drain, set by nhc)"
    )
    with pytest.raises(BadRequest, match="someone else"):
        core.undrain("n3", actor="ops")
    assert slurm.nodes["n3"].reason == "NHC: disk full"
    # a drain of that node by trainguard leaves the admin's reason alone
    assert backend(core).drain("n3", reason="x", key="k", rule="r", incident_id=1)[0] == "drained"
    assert slurm.nodes["n3"].reason == "NHC: disk full"
    backend(core).undrain("n3", key="u", force=True)
    assert "DRAIN" not in slurm.nodes["n3"].flags and core.get_node("n3").state == "active"


def test_agentctl_drain_on_a_slurm_site_drains_in_slurm(core, slurm):
    view = core.drain("n1", reason="drained by ops (operator) via agentctl", actor="ops")
    assert view.state == "drained"
    assert slurm.nodes["n1"].reason == "trainguard: drained by ops (operator) via agentctl"
    core.undrain("n1", actor="ops")
    assert "DRAIN" not in slurm.nodes["n1"].flags


def test_a_failing_slurm_command_fails_the_step_with_slurms_message(core, slurm):
    slurm.fail_next("scontrol update nodename=n2",
                    "scontrol update: Access/permission denied")  # fmt: skip
    with pytest.raises(BadRequest, match="Access/permission denied"):
        core.drain("n2", reason="r", actor="ops")
    slurm.fail_next("sinfo", "sinfo: error: Unable to contact slurm controller (connect failure)",
                    transient=True)  # fmt: skip
    with pytest.raises(TransientError, match="Unable to contact slurm controller"):
        backend(core).drain("n2", reason="r", key="k")
    # a node Slurm does not know: Slurm's own message, no retry
    with pytest.raises(PermanentError, match="Invalid node name specified"):
        backend(core).drain("n9", reason="r", key="k")


def _ranks(c: Controller, clock: FakeClock, nodes: list[str], *, step: int, pid0: int) -> None:
    for i, n in enumerate(nodes):
        report = Reporter(n, instance=f"i-{n}").report(now=clock.now())
        rank = RankState(job="slurm-7", rank=i, step=step, pid=pid0 + i, world_size=3,
                         ckpt_step=15)  # fmt: skip
        c.ingest_report(dataclasses.replace(report, seq=step, ranks=(rank,)), actor="a")


def test_replace_and_restart_move_the_job_to_the_spare_through_a_held_requeue(
    core, slurm, core_clock
):
    slurm.submit("7", ["n1", "n2", "n3"])
    _ranks(core, core_clock, ["n1", "n2", "n3"], step=20, pid0=100)
    b = backend(core)
    b.refresh()
    assert [v.scheduler_job_id for v in core.list_jobs()] == ["7"]
    now = core_clock.now()
    checking = b.replace(ctx("replace", now=now, params={"node": "n2"}))
    assert not checking.done and "preflight of spare(s) n4" in checking.message
    _answer_preflights(core, fails={})
    replaced = b.replace(ctx("replace", now=now, params={"node": "n2"}, progress=checking.output))
    assert replaced.output["nodes"] == ["n1", "n4", "n3"]
    assert slurm.reservation is None  # its last spare went to the job
    assert core.get_node("n4").role == "active"
    previous = {"replace": replaced.output}
    step = b.restart(ctx("restart", now=now, params={"node": "n2"}, previous=previous))
    assert not step.done and slurm.calls[-1] == ("scontrol", "requeuehold", "7")
    step = b.restart(ctx("restart", now=now + 1, params={"node": "n2"}, previous=previous,
                         progress=step.output))  # fmt: skip
    assert slurm.calls[-3:] == [
        ("scontrol", "update", "jobid=7", "nodelist=n1,n4,n3"),
        ("scontrol", "release", "7"),
        ("scontrol", "update", "jobid=7", "starttime=now"),
    ]
    assert slurm.jobs["7"].nodes == ["n1", "n4", "n3"]
    step = b.restart(ctx("restart", now=now + 2, params={}, previous=previous,
                         progress=step.output))  # fmt: skip
    assert not step.done  # no step past the checkpoint yet
    _ranks(core, core_clock, ["n1", "n4", "n3"], step=16, pid0=200)
    step = b.restart(ctx("restart", now=now + 3, params={}, previous=previous,
                         progress=step.output))  # fmt: skip
    assert step.done and step.output["first_step"] == 16
    assert {"requeue", "allocation", "launch", "restart"} <= set(step.output["phases_s"])


def test_no_spare_in_the_reservation_waits_then_pages(core, slurm, core_clock):
    slurm.reservation = None
    slurm.submit("7", ["n1", "n2", "n3"])
    _ranks(core, core_clock, ["n1", "n2", "n3"], step=20, pid0=100)
    b = backend(core)
    now = core_clock.now()
    first = b.replace(ctx("replace", now=now, params={"node": "n2"}))
    assert not first.done and "no usable spare" in first.message
    with pytest.raises(PermanentError, match="no spare in reservation trainguard_spares"):
        b.replace(ctx("replace", now=now + 1e4, params={"node": "n2"}, progress=first.output))


def _past_restart(c: Controller, *, at: float, ckpt: int, n: int) -> tuple[ActionView, Any]:
    """A rule's restart of Slurm job 7 (its incident and its row) that started at `at` from
    checkpoint `ckpt`, failed."""
    incident_id = c.store.incidents.create(
        rule="job_process_failed", target_key=f"job:slurm-7:{n}", target={},
        target_text="job slurm-7", severity="critical", summary="crashed", node=None,
        job="slurm-7", ts=at, timeline=(),
    )  # fmt: skip
    [action_id] = c.store.actions.add(
        incident_id,
        [NewAction(kind="restart", target="slurm-7", idempotency_key=f"{n}:restart",
                   params={"job": "slurm-7"})],
        ts=at,
    )  # fmt: skip
    output = {"job": "slurm-7", "slurm_job_id": "7", "started_at": at, "ckpt_step": ckpt}
    c.store.actions.update(
        action_id, state="failed", ts=at, result=f"Slurm job 7 FAILED try {n}", output=output
    )
    view = c.store.actions.get(action_id)
    incident = c.store.incidents.get(incident_id)
    assert view is not None and incident is not None
    return view, incident


def test_a_crash_looping_slurm_job_is_left_held_with_the_reason_instead_of_requeued(
    core, slurm, core_clock
):
    slurm.submit("7", ["n1", "n2", "n3"])
    _ranks(core, core_clock, ["n1", "n2", "n3"], step=20, pid0=100)  # checkpoint 15
    b = backend(core)
    b.refresh()
    now = core_clock.now()
    for n in range(3):
        _past_restart(core, at=now - 300 + 60 * n, ckpt=15, n=n)
    # the fourth: a rule's restart, as the worker runs it (its row, its incident)
    row, incident = _past_restart(core, at=now, ckpt=15, n=3)
    row = dataclasses.replace(row, state="running")
    step = b.restart(ActionContext(action=row, incident=incident, now=now, attempt=1))
    assert not step.done and step.output[LOOP_KEY]["restarts"][0]["ckpt_step"] == 15
    calls = len(slurm.calls)
    again = ActionContext(action=row, incident=incident, now=now, attempt=1, progress=step.output)
    with pytest.raises(PermanentError) as held:
        b.restart(again)
    text = str(held.value)
    assert "restart loop: 3 restarts in 30 min without checkpoint progress" in text
    assert text.count("- restart #") == 3 and "Slurm job 7 FAILED try 2" in text
    assert "left held" in text
    made = slurm.calls[calls:]
    assert ("scontrol", "requeuehold", "7") in made
    assert not any(c[:2] == ("scontrol", "release") for c in made)
    comment = [c for c in made if c[:3] == ("scontrol", "update", "jobid=7")]
    assert comment and comment[-1][3].startswith("comment=trainguard: restart loop: 3 restarts")
    job = slurm.jobs["7"]
    assert job.state == "PENDING" and job.held and job.comment.startswith("trainguard: restart")
    [view] = [v for v in core.list_jobs() if v.scheduler_job_id == "7"]
    assert view.state_reason.startswith("JobHeldAdmin: trainguard: restart loop:")
    # a controller killed before the step failed runs it again: held once, same comment
    calls = len(slurm.calls)
    with pytest.raises(PermanentError, match="restart loop"):
        b.restart(again)
    assert not any(c[1] in ("requeuehold", "hold", "release") for c in slurm.calls[calls:])


def test_an_operator_restart_of_a_slurm_job_is_never_held(core, slurm, core_clock):
    slurm.submit("7", ["n1", "n2", "n3"])
    _ranks(core, core_clock, ["n1", "n2", "n3"], step=20, pid0=100)
    b = backend(core)
    b.refresh()
    now = core_clock.now()
    for n in range(3):
        _past_restart(core, at=now - 300 + 60 * n, ckpt=15, n=n)
    step = b.restart(ctx("restart", now=now, params={"job": "slurm-7"}))
    assert LOOP_KEY not in step.output and slurm.calls[-1] == ("scontrol", "requeuehold", "7")


def _answer_preflights(c: Controller, *, fails: dict[str, str]) -> None:
    """Every node's queued preflight comes back: failed with the node's `fails` detail, else
    passed (as the agent answers it)."""
    for cmd in c.store.commands.pending():
        if cmd.kind == "preflight":
            why = fails.get(cmd.node)
            result = f"preflight failed: {why}" if why else "preflight passed (5 checks)"
            c.store.commands.finish(cmd.id, ok=why is None, result=result)


def test_a_spare_whose_preflight_fails_is_drained_in_slurm_and_the_next_one_taken(
    make_core, core_config, core_clock
):
    slurm = FakeSlurm((*NODES, "n5"), spares=["n4", "n5"])
    c = Controller(
        core_config(backend={"kind": "slurm"}, lifecycle={"spare_preflight_ahead": False}),
        clock=core_clock,
        backends=ActionBackends(notifiers=[], slurm_runner=slurm),
    )
    try:
        for n in (*NODES, "n5"):
            c.ingest_report(Reporter(n).report(now=core_clock.now()), actor="a")
        b = backend(c)
        b.refresh()
        slurm.submit("7", ["n1", "n2", "n3"])
        _ranks(c, core_clock, ["n1", "n2", "n3"], step=20, pid0=100)
        b.refresh()
        now = core_clock.now()
        first = b.replace(ctx("replace", now=now, params={"node": "n2"}))
        assert not first.done and "waiting for the preflight of spare(s) n4" in first.message
        assert slurm.reservation == ["n4", "n5"]  # nothing taken before a pass
        _answer_preflights(c, fails={"n4": "row_remaps: 1 pending row remap on gpu 2"})
        second = b.replace(ctx("replace", now=now + 1, params={"node": "n2"},
                               progress=first.output))  # fmt: skip
        assert not second.done and "n5" in second.message and "skipped n4" in second.message
        assert slurm.nodes["n4"].reason == (
            "trainguard: preflight failed: row_remaps: 1 pending row remap on gpu 2"
        )
        assert "DRAIN" in slurm.nodes["n4"].flags
        _answer_preflights(c, fails={})
        third = b.replace(ctx("replace", now=now + 2, params={"node": "n2"},
                              progress=second.output))  # fmt: skip
        assert third.done and third.output["replaced"] == {"n2": "n5"}
        assert third.output["nodes"] == ["n1", "n5", "n3"]
        b.refresh()
        assert c.get_node("n4").state == "drained"
        assert "n4" not in [n.name for n in c.list_spares()]
    finally:
        c.stop()


def test_a_spare_whose_preflight_ahead_of_need_fails_is_drained_in_slurm_until_it_returns(
    make_core, core_config, core_clock
):
    slurm = FakeSlurm(NODES, spares=["n4"])
    c = Controller(
        core_config(backend={"kind": "slurm"}),  # spare_preflight_ahead on, as shipped
        clock=core_clock,
        backends=ActionBackends(notifiers=[], slurm_runner=slurm),
    )
    try:
        for n in NODES:
            c.ingest_report(Reporter(n).report(now=core_clock.now()), actor="a")
        b = backend(c)
        b.refresh()
        c.tick()  # the free spare gets its preflight ahead of need
        assert [cmd.node for cmd in c.store.commands.pending() if cmd.kind == "preflight"] == ["n4"]
        _answer_preflights(c, fails={"n4": "ecc: 2 uncorrectable errors on gpu 1"})
        core_clock.advance(20.0)
        c.tick()
        assert (
            slurm.nodes["n4"].reason
            == "trainguard: preflight failed: ecc: 2 uncorrectable errors on gpu 1"
        )
        assert "DRAIN" in slurm.nodes["n4"].flags
        b.refresh()  # Slurm's state mirrored back keeps it out of the pool
        assert c.get_node("n4").state == "drained"
        assert "n4" not in [n.name for n in c.list_spares()]
        # `node return` validates it; a pass resumes it in Slurm
        c.return_node("n4", actor="ops")
        c.run_actions()
        _answer_preflights(c, fails={})
        core_clock.advance(2.0)
        c.run_actions()
        assert "DRAIN" not in slurm.nodes["n4"].flags
        b.refresh()
        assert c.get_node("n4").state == "active"
    finally:
        c.stop()


def _validate(c: Controller, clock: FakeClock, node: str) -> None:
    """The lifecycle's validation of a repaired node (params as repairplan gives them), its
    preflight passed."""
    c.repairs.start_validation(node, root="lifecycle:diagnose:k")
    c.run_actions()
    _answer_preflights(c, fails={})
    clock.advance(2.0)
    c.run_actions()


@pytest.mark.parametrize(
    ("left", "after"),
    [(["n4"], ["n4", "n2"]), (None, ["n2"])],
    ids=["reservation-kept", "reservation-gone-with-its-last-spare"],
)
def test_a_node_repaired_under_slurm_comes_back_as_a_spare_in_the_reservation(
    core, slurm, core_clock, left, after
):
    # n2 was drained by an incident, diagnosed and repaired; its validation passes. With
    # lifecycle.repair_return_role spare it joins the spare reservation (created again, as
    # the set-up makes it, when a replace took its last node) and is resumed in Slurm, so the
    # mirror keeps it a spare and slurmctld gives general work none of it.
    b = backend(core)
    b.drain("n2", reason="x", key="k", rule="gpu_dbe", incident_id=7)
    slurm.reservation = left
    b.refresh()
    assert core.get_node("n2").state == "drained"
    _validate(core, core_clock, "n2")
    assert slurm.reservation == after
    if left is None:
        assert slurm.reservation_fields == {
            "reservationname": "trainguard_spares", "nodes": "n2", "starttime": "now",
            "duration": "infinite", "users": "root", "flags": "ignore_jobs",
        }  # fmt: skip
    assert "DRAIN" not in slurm.nodes["n2"].flags
    b.refresh()  # the next sync keeps it a spare
    view = core.get_node("n2")
    assert (view.state, view.role) == ("active", "spare"), view
    assert "n2" in [n.name for n in core.list_spares()]
    # a re-run (a validation step again after a crash) changes nothing in Slurm
    calls = len(slurm.calls)
    b.return_to_pool("n2", role="spare")
    assert [c for c in slurm.calls[calls:] if "reservation" in " ".join(c)] == [
        ("scontrol", "show", "reservation", "trainguard_spares", "-o")
    ]


def test_a_node_repaired_under_slurm_as_active_leaves_the_reservation(
    make_core, core_config, core_clock
):
    slurm = FakeSlurm((*NODES, "n5"), spares=["n4", "n5"])
    c = Controller(
        core_config(backend={"kind": "slurm"}, lifecycle={"repair_return_role": "active"}),
        clock=core_clock,
        backends=ActionBackends(notifiers=[], slurm_runner=slurm),
    )
    try:
        for n in (*NODES, "n5"):
            c.ingest_report(Reporter(n).report(now=core_clock.now()), actor="a")
        b = backend(c)
        b.refresh()
        b.drain("n4", reason="x", key="k", rule="gpu_dbe", incident_id=7)  # a free spare's DBE
        _validate(c, core_clock, "n4")
        assert slurm.reservation == ["n5"]
        b.refresh()
        view = c.get_node("n4")
        assert (view.state, view.role) == ("active", "active"), view
    finally:
        c.stop()
