"""A job whose start fails never waits in `starting`: the attempt's launch dying before its
first step (the trainer's launch lock on a full disk), or a job left starting past
jobs.start_timeout_s, crashes it with the evidence (node, exit code, output tail), and
job_process_failed opens an incident that notifies with it; a restart that fails the same
way again pages. A failed checkpoint never moves the job's checkpoint step. FakeClock sim."""

from __future__ import annotations

from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.actions.notify import RecordingNotifier

DISK_FULL = (
    "trainguard.trainer.fence.LaunchLocked: cannot take the launch lock:"
    " OSError: [Errno 28] No space left on device"
)


def _state(sim: Sim) -> str:
    return sim.c.get_job("job").state


def test_a_restart_whose_launch_dies_crashes_the_job_opens_an_incident_and_pages(
    sim: Sim, core_notifier: RecordingNotifier
) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(13)
    for agent in sim.agents.values():
        agent.fail_start = DISK_FULL  # the shared checkpoint file system is full
    sim.c.job_action("job", "restart", actor="ops")
    sim.until(lambda: _state(sim) == "crashed", max_s=15, what="crashed, not left starting")
    reason = sim.c.get_job("job").state_reason
    assert reason.startswith("start failed:") and "code 1" in reason
    assert "No space left on device" in reason and ("on n1" in reason or "on n2" in reason)
    sim.until(
        lambda: any(i.rule == "job_process_failed" for i in sim.c.list_incidents()),
        max_s=5,
        what="incident",
    )
    detail = sim.incident("job_process_failed")
    assert "No space left on device" in detail.incident.summary
    sim.until(
        lambda: any(n.page and n.job == "job" for n in core_notifier.sent),
        max_s=60,
        what="a page once the incident's own restart fails the same way",
    )
    triggers = [n for n in core_notifier.sent if n.rule == "job_process_failed"]
    assert triggers and "No space left on device" in triggers[0].summary
    page = next(n for n in core_notifier.sent if n.page and n.job == "job")
    assert "No space left on device" in page.reason or "No space" in page.summary
    assert _state(sim) != "starting"


def test_a_job_left_starting_past_start_timeout_crashes_and_opens_an_incident(
    sim: Sim, core_notifier: RecordingNotifier
) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    for name in ("n1", "n2"):
        sim.agents[name].launches["job"].state = "exited"  # nothing runs, no exit reported
    # as a step that stopped watching leaves it (e.g. one failed across a controller restart)
    sim.c.store.jobs.update("job", state="starting", attempt_started_at=sim.clock.now())
    sim.c.jobs._remember(sim.c.store.jobs.get("job"))
    timeout_s = sim.c.jobs.config.start_timeout_s
    sim.second(int(timeout_s) - 5)
    assert _state(sim) == "starting"
    assert not sim.c.list_incidents()
    sim.until(
        lambda: any(i.rule == "job_process_failed" for i in sim.c.list_incidents()),
        max_s=10,
        what="an incident past start_timeout_s",
    )
    detail = sim.incident("job_process_failed")
    assert "start failed" in detail.incident.summary
    assert "jobs.start_timeout_s" in detail.incident.summary
    assert any(
        n.rule == "job_process_failed" and "jobs.start_timeout_s" in n.summary
        for n in core_notifier.sent
    )
    # the incident's restart brought the job back
    sim.until(running(sim, attempt=2), max_s=15, what="restarted")


def test_a_failed_checkpoint_never_moves_the_jobs_checkpoint_step(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(12)  # committed at step 10
    assert sim.c.get_job("job").ckpt_step == 10
    sim.ckpts.every_steps = 10_000  # from now on no save commits: each one fails
    for step in (20, 30):
        sim.agents["n1"].event(
            "checkpoint_failed",
            job="job",
            rank=0,
            data={"step": step, "request_id": None, "reason": "No space left on device"},
        )
    sim.second(30)
    job = sim.c.get_job("job")
    assert job.last_step is not None and job.last_step > 30
    assert job.ckpt_step == 10
    assert sim.c.jobs.latest_steps("job")[1] == 10
    assert sim.c.store.jobs.get("job").ckpt_step == 10
