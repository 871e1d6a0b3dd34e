"""Control sockets stay where the agent can reach them (beside its socket, not /tmp)."""

from __future__ import annotations

import hashlib
import os
import tempfile

import pytest

from trainguard.trainer.channel import control_socket_path


def test_a_long_job_name_is_shortened_in_the_same_directory() -> None:
    directory = "/run/trainguard/" + "d" * 40  # 56 bytes: the full name would not fit
    job = "pretrain-" + "x" * 60
    path = control_socket_path(
        job=job, rank=7, pid=4194303, agent_socket=f"{directory}/heartbeat.sock", env={}
    )
    digest = hashlib.sha256(job.encode()).hexdigest()[:8]
    assert path == f"{directory}/tg-ctl-{digest}-r7-4194303.sock"
    assert len(path.encode()) <= 107


def test_only_a_directory_too_long_itself_falls_back_to_tmp_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory = "/run/" + "d" * 100
    path = control_socket_path(job="j", rank=0, pid=1, agent_socket=f"{directory}/hb.sock", env={})
    assert os.path.dirname(path) == tempfile.gettempdir()
    assert "event=control_socket_fallback" in caplog.text


def test_the_default_directory_is_the_agent_sockets() -> None:
    path = control_socket_path(
        job="j", rank=0, pid=1, agent_socket="/run/trainguard/heartbeat.sock", env={}
    )
    assert path == "/run/trainguard/tg-ctl-j-r0-1.sock"
