"""A heartbeat speaks only for its sender's job: SenderResolver on fake /proc trees, JobClaims'
rules, and the heartbeat server refusing (and counting) what another process claims."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.agent.heartbeat import HeartbeatServer
from trainguard.agent.senders import (
    MAX_ANCESTRY,
    RECHECK_S,
    JobClaims,
    Origin,
    SenderResolver,
    read_proc_entry,
)
from trainguard.clock import FakeClock
from trainguard.protocol import Heartbeat, encode_json

ROOT, ALICE, MALLORY = 0, 1000, 1001


def _proc(
    root: Path,
    pid: int,
    *,
    ppid: int,
    comm: str = "python",
    uid: int = ALICE,
    start: int = 1000,
    cmdline: bytes = b"python\0train.py\0",
    state: str = "S",
) -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    # /proc/<pid>/stat: pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt
    # majflt cmajflt utime stime cutime cstime priority nice threads itrealvalue starttime ...
    rest = " ".join(["0"] * 17)
    (d / "stat").write_text(f"{pid} ({comm}) {state} {ppid} {rest} {start} 0 0\n")
    (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (d / "cmdline").write_bytes(cmdline)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """init(1) -> jobwrap(100, root start 500) -> torchrun(101) -> ranks 102, 103;
    init -> slurmstepd(200, root) -> rank 201 (uid 1001); init -> a user's shell(300) -> 301."""
    _proc(tmp_path, 1, ppid=0, comm="systemd", uid=ROOT, start=1)
    _proc(tmp_path, 100, ppid=1, comm="jobwrap", start=500)
    _proc(tmp_path, 101, ppid=100, comm="torchrun")
    _proc(tmp_path, 102, ppid=101)
    _proc(tmp_path, 103, ppid=101)
    _proc(tmp_path, 200, ppid=1, comm="slurmstepd", uid=ROOT, cmdline=b"slurmstepd: [4242.0]\0")
    _proc(tmp_path, 201, ppid=200, uid=MALLORY)
    _proc(tmp_path, 300, ppid=1, comm="bash", uid=MALLORY)
    _proc(tmp_path, 301, ppid=300, uid=MALLORY)
    return tmp_path


def _resolver(proc: Path, clock: FakeClock | None = None) -> SenderResolver:
    leaders = {(100, 500): "victim"}
    return SenderResolver(
        proc_root=str(proc),
        launches=lambda: leaders,
        monotonic=(clock or FakeClock()).monotonic,
    )


def test_proc_entry_reads_parent_start_comm_and_uid(proc: Path) -> None:
    entry = read_proc_entry(str(proc), 200)

    assert entry is not None
    assert (entry.ppid, entry.start_ticks, entry.comm, entry.uid) == (1, 1000, "slurmstepd", 0)
    assert read_proc_entry(str(proc), 999) is None


@pytest.mark.parametrize(
    ("pid", "uid", "expected"),
    [
        pytest.param(102, ALICE, Origin("launch", ALICE, "victim"), id="rank-of-a-launch"),
        pytest.param(100, ALICE, Origin("launch", ALICE, "victim"), id="the-leader-itself"),
        pytest.param(201, MALLORY, Origin("slurm", MALLORY, "slurm-4242"), id="slurm-task"),
        pytest.param(301, MALLORY, Origin("user", MALLORY), id="plain-user-process"),
        pytest.param(999, MALLORY, Origin("user", MALLORY), id="gone"),
        pytest.param(-1, MALLORY, Origin("user", MALLORY), id="no-credentials"),
    ],
)
def test_origin_of_a_sender(proc: Path, pid: int, uid: int, expected: Origin) -> None:
    assert _resolver(proc).origin(pid, uid) == expected


def test_a_reused_leader_pid_is_not_the_launch(proc: Path) -> None:
    _proc(proc, 100, ppid=1, comm="jobwrap", start=777)  # pid 100 is another process now

    assert _resolver(proc).origin(102, ALICE) == Origin("user", ALICE)


def test_a_user_process_calling_itself_slurmstepd_is_not_slurm(proc: Path) -> None:
    _proc(proc, 300, ppid=1, comm="slurmstepd", uid=MALLORY, cmdline=b"slurmstepd: [7.0]\0")

    assert _resolver(proc).origin(301, MALLORY) == Origin("user", MALLORY)


def test_a_pid_reused_by_another_users_process_is_not_that_process(proc: Path) -> None:
    # Mallory sent, exited, and the kernel gave her pid to a rank of Alice's launch before the
    # agent looked: the kernel's uid (Mallory's) is not that process's, so it is no launch
    assert _resolver(proc).origin(102, MALLORY) == Origin("user", MALLORY)
    assert _resolver(proc).origin(201, ALICE) == Origin("user", ALICE)


def test_a_sender_of_another_uid_than_the_jobs_owner_is_not_the_job(proc: Path) -> None:
    # a setuid program (or a recycled pid seen as the process's own) inside Mallory's Slurm
    # job and Alice's launch: the job's first process runs as another user
    _proc(proc, 202, ppid=201, uid=ALICE)
    _proc(proc, 104, ppid=102, uid=MALLORY)

    assert _resolver(proc).origin(202, ALICE) == Origin("user", ALICE)
    assert _resolver(proc).origin(104, MALLORY) == Origin("user", MALLORY)


def test_a_tree_deeper_than_the_bound_is_a_user_process(proc: Path) -> None:
    parent = 100
    for pid in range(1000, 1000 + MAX_ANCESTRY + 2):
        _proc(proc, pid, ppid=parent)
        parent = pid

    assert _resolver(proc).origin(parent, ALICE) == Origin("user", ALICE)


def test_origins_are_resolved_again_after_the_recheck_interval(proc: Path) -> None:
    clock = FakeClock()
    leaders: dict[tuple[int, int], str] = {}
    resolver = SenderResolver(
        proc_root=str(proc), launches=lambda: leaders, monotonic=clock.monotonic
    )

    assert resolver.origin(102, ALICE).kind == "user"
    leaders[(100, 500)] = "victim"  # the agent adopted the launch
    assert resolver.origin(102, ALICE).kind == "user"  # cached
    clock.advance(RECHECK_S)
    assert resolver.origin(102, ALICE) == Origin("launch", ALICE, "victim")


@pytest.mark.parametrize(
    ("origin", "job", "refusal"),
    [
        pytest.param(Origin("launch", ALICE, "victim"), "victim", None, id="launch-own-job"),
        pytest.param(Origin("launch", ALICE, "other"), "victim", "other_job", id="launch-other"),
        pytest.param(Origin("user", ALICE), "victim", "not_the_jobs_process", id="user-launched"),
        pytest.param(
            Origin("slurm", ALICE, "slurm-7"),
            "victim",
            "not_the_jobs_process",
            id="slurm-claims-launched",
        ),
        pytest.param(Origin("slurm", ALICE, "slurm-7"), "slurm-7", None, id="slurm-own"),
        pytest.param(Origin("slurm", ALICE, "slurm-7"), "slurm-8", "other_job", id="slurm-other"),
        pytest.param(Origin("user", ALICE), "slurm-7", "not_the_jobs_process", id="user-slurm"),
        pytest.param(Origin("user", ALICE), "adhoc", None, id="user-free-name"),
    ],
)
def test_claims(origin: Origin, job: str, refusal: str | None) -> None:
    claims = JobClaims(launched=lambda: {"victim"})

    assert claims.check(origin, job) == refusal


def test_a_free_name_belongs_to_its_first_speaker_until_forgotten() -> None:
    claims = JobClaims()
    alice, mallory = Origin("user", ALICE), Origin("user", MALLORY)
    slurm = Origin("slurm", MALLORY, "slurm-7")

    assert claims.check(alice, "adhoc") is None
    claims.bind(alice, "adhoc")
    assert claims.check(alice, "adhoc") is None
    assert claims.check(mallory, "adhoc") == "owned_by_another_sender"
    assert claims.check(slurm, "adhoc") == "owned_by_another_sender"
    claims.forget("adhoc")
    assert claims.check(mallory, "adhoc") is None


# --- the heartbeat server ---------------------------------------------------------------------


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tgsnd", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _hb(job: str, rank: int = 0, step: int = 1, **kw: object) -> bytes:
    return encode_json(Heartbeat(job=job, rank=rank, step=step, t=1.0, **kw))  # type: ignore[arg-type]


@pytest.fixture
def server(sockdir: Path, proc: Path) -> Iterator[HeartbeatServer]:
    clock = FakeClock()
    resolver = _resolver(proc, clock)
    srv = HeartbeatServer(
        path=sockdir / "hb.sock",
        clock=clock,
        proc_root=str(proc),
        rank_timeout_s=60,
        origin_of=resolver.origin,
        claims=JobClaims(launched=lambda: {"victim"}),
    )
    yield srv
    srv.close()


def test_another_users_process_cannot_speak_for_a_launched_job(server: HeartbeatServer) -> None:
    server.handle_datagram(_hb("victim", rank=0, step=10), pid=102, uid=ALICE)
    # a phantom rank, a far-ahead NaN and a fake rollback event, from a process of another user
    server.handle_datagram(_hb("victim", rank=7, step=5), pid=301, uid=MALLORY)
    server.handle_datagram(
        _hb("victim", rank=0, step=12_800, loss=float("nan"), event="nan_loss"),
        pid=301,
        uid=MALLORY,
    )
    server.handle_datagram(_hb("victim", rank=0, event="nan_rollback"), pid=201, uid=MALLORY)

    assert [(r.rank, r.step) for r in server.ranks()] == [(0, 10)]
    assert server.drain_events() == []
    stats = server.stats()
    assert stats["dropped_total"]["sender_not_allowed"] == 3
    assert stats["refused_total"]["not_the_jobs_process"] == 3


def test_a_rank_of_one_launch_cannot_speak_for_another_job(server: HeartbeatServer) -> None:
    server.handle_datagram(_hb("other-job", rank=0), pid=102, uid=ALICE)

    assert server.ranks() == ()
    assert server.stats()["refused_total"]["other_job"] == 1


def test_a_hand_started_job_is_owned_by_its_user(server: HeartbeatServer) -> None:
    server.handle_datagram(_hb("adhoc", rank=0, step=3), pid=301, uid=MALLORY)
    server.handle_datagram(_hb("adhoc", rank=1, step=3), pid=999, uid=ALICE)

    assert [(r.job, r.rank) for r in server.ranks()] == [("adhoc", 0)]
    assert server.stats()["refused_total"]["owned_by_another_sender"] == 1


def test_a_live_ranks_process_is_not_replaced_by_another(
    server: HeartbeatServer, proc: Path
) -> None:
    server.handle_datagram(_hb("victim", rank=0, step=10), pid=102, uid=ALICE)
    server.handle_datagram(_hb("victim", rank=0, step=99), pid=103, uid=ALICE)

    assert [(r.rank, r.step) for r in server.ranks()] == [(0, 10)]
    assert server.stats()["refused_total"]["rank_taken"] == 1
    # once the first process is gone, the rank's new process takes over (a restarted rank)
    shutil.rmtree(proc / "102")
    server.handle_datagram(_hb("victim", rank=0, step=11), pid=103, uid=ALICE)
    assert [(r.rank, r.step) for r in server.ranks()] == [(0, 11)]


def test_slurm_tasks_speak_for_their_own_slurm_job_only(server: HeartbeatServer) -> None:
    server.handle_datagram(_hb("slurm-4242", rank=0), pid=201, uid=MALLORY)
    server.handle_datagram(_hb("slurm-1", rank=0), pid=201, uid=MALLORY)
    server.handle_datagram(_hb("slurm-4242", rank=1), pid=301, uid=MALLORY)

    assert [(r.job, r.rank) for r in server.ranks()] == [("slurm-4242", 0)]
    refused = server.stats()["refused_total"]
    assert (refused["other_job"], refused["not_the_jobs_process"]) == (1, 1)
