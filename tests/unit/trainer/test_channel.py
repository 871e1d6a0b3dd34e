"""The agent link: heartbeats reach a real unix datagram socket; no agent means no-op."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
from pathlib import Path

import pytest

from trainguard.protocol import Control, Heartbeat, decode_json, encode_json
from trainguard.trainer.channel import (
    AgentChannel,
    control_socket_path,
    encode_plain_heartbeat,
    job_name,
)


def test_heartbeat_reaches_a_listening_agent_socket(short_tmp: Path) -> None:
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(short_tmp / "hb.sock"))
    agent.settimeout(5)
    ch = AgentChannel(agent_socket=str(short_tmp / "hb.sock"), control_socket=None)
    try:
        hb = Heartbeat(
            job="j",
            rank=1,
            step=7,
            t=1.0,
            loss=float("nan"),
            event="nan_loss",
            event_data={"step": 7, "loss": float("nan")},
        )
        assert ch.send(hb)
        got = decode_json(Heartbeat, agent.recv(8192))
        assert got.step == 7 and got.rank == 1 and got.event == "nan_loss"
        assert got.loss != got.loss  # NaN survives the wire as "NaN"
    finally:
        ch.close()
        agent.close()


def test_missing_agent_socket_is_a_silent_no_op(short_tmp: Path) -> None:
    ch = AgentChannel(agent_socket=str(short_tmp / "absent.sock"), control_socket=None)
    try:
        for step in range(100):
            assert ch.send(Heartbeat(job="j", rank=0, step=step, t=0.0)) is False
        assert ch.dropped == 100 and ch.sent == 0
    finally:
        ch.close()


def test_full_agent_buffer_drops_instead_of_blocking(short_tmp: Path) -> None:
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(short_tmp / "hb.sock"))  # bound but never read: its queue fills up
    ch = AgentChannel(agent_socket=str(short_tmp / "hb.sock"), control_socket=None)
    try:
        for step in range(5000):
            ch.send(Heartbeat(job="j", rank=0, step=step, t=0.0))
        assert ch.dropped > 0 and ch.sent > 0
    finally:
        ch.close()
        agent.close()


def test_controls_are_received_and_malformed_ones_dropped(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(short_tmp / "ctl.sock")
    ch = AgentChannel(agent_socket=str(short_tmp / "hb.sock"), control_socket=path)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        assert ch.control_socket == path
        assert ch.poll() == []
        sender.sendto(encode_json(Control(action="checkpoint", request_id="r1")), path)
        sender.sendto(b"{not json", path)
        sender.sendto(json.dumps({"action": "explode", "request_id": "r2"}).encode(), path)
        sender.sendto(encode_json(Control(action="stop", request_id="r3")), path)
        got = ch.poll()
        assert [(c.action, c.request_id) for c in got] == [("checkpoint", "r1"), ("stop", "r3")]
        assert sum("control_rejected" in r.getMessage() for r in caplog.records) == 2
    finally:
        sender.close()
        ch.close()
    assert not Path(path).exists(), "the control socket is removed on close"


def test_unbindable_control_socket_leaves_heartbeats_working(short_tmp: Path) -> None:
    ch = AgentChannel(
        agent_socket=str(short_tmp / "hb.sock"), control_socket=str(short_tmp / "no/such/c.sock")
    )
    try:
        assert ch.control_socket is None
        assert ch.poll() == []
    finally:
        ch.close()


def test_control_socket_path_uses_control_dir_and_names_job_rank_pid(tmp_path: Path) -> None:
    p = control_socket_path(
        job="llama/7b",
        rank=3,
        pid=42,
        agent_socket="/run/x/hb.sock",
        env={"TRAINGUARD_CONTROL_DIR": "/tmp/ctl"},
    )
    assert p == "/tmp/ctl/tg-ctl-llama_7b-r3-42.sock"
    p = control_socket_path(job="j", rank=0, pid=1, agent_socket="/run/x/hb.sock", env={})
    assert p == "/run/x/tg-ctl-j-r0-1.sock"
    deep = "/tmp/" + "d" * 120 + "/hb.sock"
    assert len(control_socket_path(job="j", rank=0, pid=1, agent_socket=deep, env={})) < 108


def test_a_shared_control_dir_gets_a_private_directory_per_user(short_tmp: Path) -> None:
    # the agent's ctl/ beside its socket, 1777 like /tmp: each user's ranks bind in their own
    # u<uid>/ (0700), so no other user can take the socket's name first
    ctl = short_tmp / "ctl"
    ctl.mkdir()
    ctl.chmod(0o1777)
    p = control_socket_path(job="j", rank=0, pid=1, agent_socket=str(short_tmp / "hb.sock"), env={})
    own = ctl / f"u{os.geteuid()}"
    assert p == str(own / "tg-ctl-j-r0-1.sock")
    assert own.is_dir() and own.stat().st_mode & 0o777 == 0o700


def test_a_private_directory_someone_else_made_first_is_not_used(short_tmp: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    ctl = short_tmp / "ctl"
    ctl.mkdir()
    ctl.chmod(0o1777)
    squat = ctl / f"u{os.geteuid()}"
    squat.mkdir(mode=0o777)
    os.chown(squat, 65534, 65534)
    p = control_socket_path(job="j", rank=0, pid=1, agent_socket=str(short_tmp / "hb.sock"), env={})
    assert p == str(ctl / "tg-ctl-j-r0-1.sock")


class _DeniedSocket:
    """A socket whose sends are refused as the kernel refuses a user the socket's mode
    leaves out (as root the real check cannot be provoked)."""

    def __init__(self, err: int) -> None:
        self.err = err

    def sendto(self, data: bytes, path: str) -> int:
        raise OSError(self.err, os.strerror(self.err))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("err", [errno.EACCES, errno.EPERM], ids=["EACCES", "EPERM"])
def test_an_agent_this_user_may_not_reach_is_one_warning_naming_the_fix(
    short_tmp: Path, caplog: pytest.LogCaptureFixture, err: int
) -> None:
    ch = AgentChannel(agent_socket=str(short_tmp / "hb.sock"), control_socket=None)
    ch._out.close()
    ch._out = _DeniedSocket(err)  # type: ignore[assignment]
    with caplog.at_level(logging.DEBUG, logger="trainguard.trainer"):
        for step in range(50):
            assert ch.send(Heartbeat(job="j", rank=0, step=step, t=0.0)) is False
    ch.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and ch.dropped == 50
    assert "event=agent_socket_denied" in warnings[0]
    assert "heartbeat.socket_mode" in warnings[0] and "heartbeat.socket_group" in warnings[0]


def test_no_agent_at_all_is_no_warning(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    ch = AgentChannel(
        agent_socket=str(short_tmp / "absent.sock"),
        control_socket=str(short_tmp / "no" / "such" / "c.sock"),
    )
    with caplog.at_level(logging.INFO, logger="trainguard.trainer"):
        for step in range(5):
            ch.send(Heartbeat(job="j", rank=0, step=step, t=0.0))
    ch.close()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TRAINGUARD_JOB": "a", "TORCHELASTIC_RUN_ID": "b"}, "a"),
        ({"TORCHELASTIC_RUN_ID": "b"}, "b"),
        ({}, "default"),
    ],
    ids=["explicit", "torchelastic", "default"],
)
def test_job_name_comes_from_env(env: dict[str, str], expected: str) -> None:
    assert job_name(env) == expected


@pytest.mark.parametrize(
    "fields",
    [
        {"job": "j", "rank": 0, "step": 1, "t": 1.5},
        {
            "job": "j",
            "rank": 2,
            "step": 9,
            "t": 2.0,
            "loss": float("nan"),
            "grad_norm": float("inf"),
            "samples_per_s": None,
            "phase": "stopping",
            "ckpt_step": 5,
            "ckpt_request_id": "r",
            "control_socket": "/tmp/c.sock",
            "local_rank": 1,
            "world_size": 3,
            "pid": 7,
        },
        {"job": "j", "rank": 0, "step": 1, "t": 1.0, "loss": float("-inf"), "step_time_s": 0.05},
    ],
    ids=["minimal", "full-with-nonfinite", "negative-infinity"],
)
def test_fast_heartbeat_encoding_equals_the_protocol_encoder(fields: dict) -> None:
    fast = json.loads(encode_plain_heartbeat(fields))
    assert fast == json.loads(encode_json(Heartbeat(**fields)))
    decode_json(Heartbeat, encode_plain_heartbeat(fields))
