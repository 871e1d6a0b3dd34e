"""HeartbeatServer: decoding, ages on the agent clock, events, bounds, and Control sending."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import wait_for
from trainguard.agent.heartbeat import (
    HEARTBEAT_ONLY_FIELDS,
    MAX_PENDING_EVENTS,
    RANK_STATE_OWN_FIELDS,
    HeartbeatServer,
)
from trainguard.clock import FakeClock
from trainguard.protocol import (
    HEARTBEAT_MAX_BYTES,
    Control,
    Heartbeat,
    ProtocolError,
    RankState,
    decode_json,
    encode_json,
)


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # unix socket paths are limited to 108 bytes; pytest's tmp_path can be longer
    d = Path(tempfile.mkdtemp(prefix="tghb", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(sockdir: Path, clock: FakeClock) -> Iterator[HeartbeatServer]:
    srv = HeartbeatServer(path=sockdir / "hb.sock", clock=clock, max_ranks=4, rank_timeout_s=60)
    yield srv
    srv.close()


def hb(rank: int = 0, step: int = 1, **kw: object) -> bytes:
    return encode_json(Heartbeat(job="job-a", rank=rank, step=step, t=1.0, **kw))  # type: ignore[arg-type]


def test_keeps_last_heartbeat_per_rank_and_derives_ages(
    server: HeartbeatServer, clock: FakeClock
) -> None:
    server.handle_datagram(hb(rank=0, step=10, loss=2.5), pid=100)
    server.handle_datagram(hb(rank=1, step=10), pid=101)
    clock.advance(3.0)
    server.handle_datagram(hb(rank=0, step=10, loss=2.4), pid=100)  # same step: stalled
    clock.advance(2.0)
    r0, r1 = server.ranks()
    assert (r0.rank, r0.step, r0.loss) == (0, 10, 2.4)
    assert r0.heartbeat_age_s == pytest.approx(2.0)
    assert r0.step_age_s == pytest.approx(5.0)  # step unchanged since first seen
    assert r1.heartbeat_age_s == pytest.approx(5.0)
    server.handle_datagram(hb(rank=0, step=11), pid=100)
    assert server.ranks()[0].step_age_s == 0.0


def test_every_heartbeat_field_reaches_rank_state_or_is_named_heartbeat_only() -> None:
    # a new Heartbeat field shows in the report's RankState (same name) unless it is listed
    # as heartbeat-only; RankState has nothing else but the ages the agent computes
    heartbeat = {f.name for f in dataclasses.fields(Heartbeat)}
    rank_state = {f.name for f in dataclasses.fields(RankState)}
    assert HEARTBEAT_ONLY_FIELDS <= heartbeat
    assert heartbeat - HEARTBEAT_ONLY_FIELDS == rank_state - RANK_STATE_OWN_FIELDS


def test_rank_state_carries_every_shared_heartbeat_value(server: HeartbeatServer) -> None:
    sent = Heartbeat(
        job="job-a", rank=3, step=7, t=1.0, local_rank=1, world_size=8, pid=42, loss=1.5,
        grad_norm=0.5, samples_per_s=10.0, tokens_per_s=100.0, step_time_s=0.2,
        compute_time_s=0.1, phase="eval", ckpt_step=6, ckpt_request_id="r1",
    )  # fmt: skip
    server.handle_datagram(encode_json(sent), pid=42)
    (got,) = server.ranks()
    for name in {f.name for f in dataclasses.fields(RankState)} - RANK_STATE_OWN_FIELDS:
        assert getattr(got, name) == getattr(sent, name), name


def test_nan_loss_survives_the_wire(server: HeartbeatServer) -> None:
    server.handle_datagram(hb(loss=float("nan")), pid=1)
    loss = server.ranks()[0].loss
    assert loss is not None and loss != loss


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        ("nan_loss", "nan_loss"),
        ("checkpoint_committed", "checkpoint_committed"),
        ("checkpoint_failed", "checkpoint_failed"),
        ("exit", "trainer_exit"),
        ("something_new", "trainer_event"),
    ],
    ids=str,
)
def test_heartbeat_events_become_trainer_events(
    server: HeartbeatServer, event: str, kind: str
) -> None:
    server.handle_datagram(hb(rank=2, step=7, event=event, event_data={"code": 3}), pid=1)
    (ev,) = server.drain_events()
    assert (ev.kind, ev.job, ev.rank, ev.message) == (kind, "job-a", 2, event)
    assert ev.data["step"] == 7 and ev.data["code"] == 3
    assert server.drain_events() == []


def test_an_accepted_event_wakes_the_agent_a_plain_or_refused_heartbeat_does_not(
    sockdir: Path, clock: FakeClock
) -> None:
    woken: list[int] = []
    srv = HeartbeatServer(
        path=sockdir / "hb.sock", clock=clock, on_event=lambda: woken.append(1), max_ranks=1
    )
    try:
        srv.handle_datagram(hb(rank=0, step=3), pid=1)
        assert woken == []
        srv.handle_datagram(hb(rank=0, step=4, event="checkpoint_committed"), pid=1)
        assert woken == [1]
        srv.handle_datagram(hb(rank=1, step=4, event="checkpoint_committed"), pid=2)
        assert woken == [1]  # a second rank is over max_ranks: refused, nothing to spool
        assert len(srv.drain_events()) == 1
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"not json", "malformed"),
        (json.dumps({"job": "j", "rank": "zero", "step": 1, "t": 1}).encode(), "malformed"),
        (json.dumps({"job": "j", "rank": 0, "step": 1, "t": 1, "extra": 1}).encode(), "malformed"),
        (
            json.dumps({"job": "j", "rank": 0, "step": 1, "t": 1, "v": 99}).encode(),
            "unsupported_version",
        ),
        (b"{" + b" " * HEARTBEAT_MAX_BYTES + b"}", "oversized"),
    ],
    ids=["not-json", "wrong-type", "unknown-field", "future-version", "oversized"],
)
def test_bad_datagrams_are_counted_by_reason_and_dropped(
    server: HeartbeatServer, raw: bytes, reason: str
) -> None:
    server.handle_datagram(raw, pid=1)
    assert server.ranks() == ()
    assert server.dropped_total[reason] == 1
    assert server.received_total == 0


def test_flooding_sender_is_rate_limited_without_hurting_others(
    sockdir: Path, clock: FakeClock
) -> None:
    srv = HeartbeatServer(path=sockdir / "hb.sock", clock=clock, per_sender_rate_hz=10)
    try:
        for i in range(100):
            srv.handle_datagram(hb(rank=0, step=i), pid=666)
        srv.handle_datagram(hb(rank=1, step=1), pid=777)
        assert srv.dropped_total["rate_limited"] == 90
        assert {r.rank for r in srv.ranks()} == {0, 1}
        clock.advance(1.0)  # the bucket refills
        srv.handle_datagram(hb(rank=0, step=500), pid=666)
        assert srv.ranks()[0].step == 500
    finally:
        srv.close()


def test_tracked_ranks_are_capped_and_silent_ranks_are_forgotten(
    server: HeartbeatServer, clock: FakeClock
) -> None:
    for rank in range(4):
        server.handle_datagram(hb(rank=rank), pid=rank)
    server.handle_datagram(hb(rank=99), pid=99)
    assert server.dropped_total["too_many_ranks"] == 1
    assert len(server.ranks()) == 4
    clock.advance(61.0)  # past rank_timeout_s
    server.handle_datagram(hb(rank=99), pid=99)
    assert [r.rank for r in server.ranks()] == [99]


def test_pending_events_are_bounded(server: HeartbeatServer, sockdir: Path) -> None:
    for i in range(MAX_PENDING_EVENTS + 5):
        server.handle_datagram(hb(step=i, event="nan_loss"), pid=i)  # distinct pids: no limit
    assert len(server.drain_events()) == MAX_PENDING_EVENTS
    assert server.events_dropped_total == 5


def test_socket_is_created_with_mode_and_replaces_a_stale_one(sockdir: Path) -> None:
    path = sockdir / "sub" / "hb.sock"
    path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()
    srv = HeartbeatServer(path=path, clock=FakeClock(), mode=0o660)
    try:
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_IMODE(path.lstat().st_mode) == 0o660
    finally:
        srv.close()
    assert not path.exists()


def test_refuses_to_remove_a_regular_file_at_the_socket_path(sockdir: Path) -> None:
    path = sockdir / "hb.sock"
    path.write_text("important")
    with pytest.raises(OSError, match="not a socket"):
        HeartbeatServer(path=path, clock=FakeClock())
    assert path.read_text() == "important"


def test_reader_thread_receives_real_datagrams_and_identifies_sender(
    server: HeartbeatServer,
) -> None:
    server.start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(hb(rank=3, step=42, pid=os.getpid()), str(server.path))
        s.sendto(b"x" * (HEARTBEAT_MAX_BYTES + 10), str(server.path))
    wait_for(lambda: len(server.ranks()) == 1, timeout_s=5, what="the heartbeat to be tracked")
    wait_for(lambda: server.dropped_total["oversized"] == 1, timeout_s=5, what="the oversized drop")
    assert server.ranks()[0].step == 42


def test_send_control_reaches_live_ranks_and_counts_dead_sockets(
    server: HeartbeatServer, sockdir: Path
) -> None:
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    live.bind(str(sockdir / "rank0.sock"))
    live.settimeout(5)
    try:
        server.handle_datagram(hb(rank=0, control_socket=str(sockdir / "rank0.sock")), pid=1)
        server.handle_datagram(hb(rank=1, control_socket=str(sockdir / "gone.sock")), pid=2)
        server.handle_datagram(
            encode_json(Heartbeat(job="other", rank=0, step=1, t=1.0, control_socket="/x")), pid=3
        )
        sent, failed = server.send_control("job-a", Control(action="checkpoint", request_id="r1"))
        assert (sent, failed) == (1, 1)
        got = json.loads(live.recv(4096))
        assert got["action"] == "checkpoint" and got["request_id"] == "r1"
        assert server.stats()["control_errors_total"] == 1
    finally:
        live.close()


def test_send_control_to_reaches_the_one_rank_it_names(
    server: HeartbeatServer, sockdir: Path
) -> None:
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    live.bind(str(sockdir / "rank1.sock"))
    live.settimeout(5)
    try:
        server.handle_datagram(hb(rank=0, control_socket=str(sockdir / "gone.sock")), pid=1)
        server.handle_datagram(hb(rank=1, control_socket=str(sockdir / "rank1.sock")), pid=2)
        control = Control(action="checkpoint", request_id="r2")
        assert server.send_control_to("job-a", 1, control)
        assert json.loads(live.recv(4096))["request_id"] == "r2"
        assert not server.send_control_to("job-a", 0, control)  # its socket is gone
        assert not server.send_control_to("job-a", 7, control)  # not a rank here
    finally:
        live.close()


def test_send_control_goes_only_to_a_socket_of_the_user_who_named_it(
    server: HeartbeatServer, sockdir: Path
) -> None:
    # A heartbeat names its control socket, so a sender could point the (root) agent at
    # another user's rank socket, or at a symlink to one: only a socket owned by the sender's
    # uid, reached as the very inode that was checked, gets the request.
    me = os.getuid()
    mine = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    mine.bind(str(sockdir / "mine.sock"))
    mine.setblocking(False)
    (sockdir / "link.sock").symlink_to(sockdir / "mine.sock")
    try:
        server.handle_datagram(
            encode_json(
                Heartbeat(
                    job="mallory", rank=0, step=1, t=1.0, control_socket=str(sockdir / "mine.sock")
                )
            ),
            pid=1,
            uid=me + 1,
        )
        server.handle_datagram(
            encode_json(
                Heartbeat(
                    job="mine", rank=0, step=1, t=1.0, control_socket=str(sockdir / "link.sock")
                )
            ),
            pid=2,
            uid=me,
        )
        assert server.send_control("mallory", Control(action="stop", request_id="r1")) == (0, 1)
        assert server.send_control("mine", Control(action="stop", request_id="r2")) == (0, 1)
        with pytest.raises(BlockingIOError):
            mine.recv(4096)
        server.handle_datagram(
            encode_json(
                Heartbeat(
                    job="mine", rank=1, step=1, t=1.0, control_socket=str(sockdir / "mine.sock")
                )
            ),
            pid=3,
            uid=me,
        )
        assert server.send_control("mine", Control(action="stop", request_id="r3")) == (1, 1)
        assert json.loads(mine.recv(4096))["request_id"] == "r3"
    finally:
        mine.close()


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["NaN", "Infinity", "train", "eval", "job-a", "x"]),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=2),
)
_keys = st.sampled_from(
    [
        "job", "rank", "step", "t", "local_rank", "world_size", "pid", "loss", "grad_norm",
        "samples_per_s", "tokens_per_s", "step_time_s", "phase", "ckpt_step",
        "ckpt_request_id", "control_socket", "event", "event_data", "v", "bogus",
    ]
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=12), st.integers(0, 3), st.integers(0, 9))
def test_a_heartbeat_is_kept_exactly_when_the_wire_decoder_accepts_it(
    data: dict[str, object], rank: int, step: int
) -> None:
    base = {"job": "j", "rank": rank, "step": step, "t": 1.5}
    d = Path(tempfile.mkdtemp(prefix="tghb", dir="/tmp"))
    srv = HeartbeatServer(path=d / "hb.sock", clock=FakeClock())
    try:
        for candidate in (data, {**base, **data}):
            raw = json.dumps(candidate).encode()
            try:
                want: Heartbeat | None = decode_json(Heartbeat, raw)
            except ProtocolError:
                want = None
            dropped = sum(srv.dropped_total.values())
            srv.handle_datagram(raw, pid=1)
            if want is None:
                assert sum(srv.dropped_total.values()) == dropped + 1
                continue
            kept = {(r.job, r.rank): r for r in srv.ranks()}[(want.job, want.rank)]
            assert (kept.step, kept.phase, kept.pid) == (want.step, want.phase, want.pid)
            # an int for a float field arrives as a float, as the decoder makes it
            assert all(v is None or type(v) is float for v in (kept.loss, kept.step_time_s))
    finally:
        srv.close()
        shutil.rmtree(d, ignore_errors=True)


def test_rank_whose_process_exited_is_forgotten_but_a_live_one_stays(
    sockdir: Path, clock: FakeClock, tmp_path: Path
) -> None:
    # a fake /proc: pid 200 runs, pid 201 is a zombie, pid 202 is gone
    for pid, state in ((200, "S"), (201, "Z")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python (x)) {state} 1 2 3\n")
    srv = HeartbeatServer(path=sockdir / "hb.sock", clock=clock, proc_root=str(tmp_path))
    try:
        for rank, pid in ((0, 200), (1, 201), (2, 202), (3, -1)):
            srv.handle_datagram(hb(rank=rank, step=5), pid=pid)
        # the live rank stays, and so does one whose sender the kernel did not name
        assert [r.rank for r in srv.ranks()] == [0, 3]
    finally:
        srv.close()


def test_with_a_controller_an_exited_rank_is_reported_once_with_its_last_step_then_forgotten(
    sockdir: Path, clock: FakeClock, tmp_path: Path
) -> None:
    """A rank that sends its last steps and exits between two reports: the next report
    still carries them (the job's last step, its `exit`), then the rank is forgotten."""
    (tmp_path / "300").mkdir()
    (tmp_path / "300" / "stat").write_text("300 (python) S 1 2 3\n")
    srv = HeartbeatServer(
        path=sockdir / "hb.sock",
        clock=clock,
        proc_root=str(tmp_path),
        keep_exited_until_reported=True,
    )
    try:
        srv.handle_datagram(hb(rank=0, step=29), pid=300)
        assert [r.step for r in srv.ranks(report=True)] == [29]
        srv.handle_datagram(hb(rank=0, step=30, phase="exit"), pid=300)
        (tmp_path / "300" / "stat").unlink()  # the process is gone
        assert [r.step for r in srv.ranks()] == [30]  # a loop tick: kept, not reported yet
        assert [(r.step, r.phase) for r in srv.ranks(report=True)] == [(30, "exit")]
        assert srv.ranks() == () and srv.ranks(report=True) == ()
    finally:
        srv.close()
