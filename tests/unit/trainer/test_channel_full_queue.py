"""A busy agent's full datagram queue: a heartbeat is dropped at once (never blocks the
step), but a rank's last words wait up to `wait_s` for the agent to read."""

from __future__ import annotations

import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.trainer.channel import AgentChannel


@pytest.fixture
def full_agent() -> Iterator[tuple[socket.socket, AgentChannel]]:
    d = Path(tempfile.mkdtemp(prefix="tgq-"))  # short: unix socket paths are <= 107 bytes
    path = str(d / "agent.sock")
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(path)
    ch = AgentChannel(agent_socket=path, control_socket=None)
    while ch.send_raw(b"{}"):  # until the kernel's queue for the agent is full
        assert ch.sent < 100_000
    yield agent, ch
    ch.close()
    agent.close()


def test_a_full_queue_drops_a_heartbeat_at_once(full_agent) -> None:
    _, ch = full_agent
    dropped = ch.dropped
    assert ch.send_raw(b'{"step": 1}') is False
    assert ch.dropped == dropped + 1


def test_the_last_words_wait_for_the_agent_to_read(full_agent) -> None:
    agent, ch = full_agent
    queued = ch.sent
    got: list[bytes] = []

    def read_all() -> None:
        agent.settimeout(10)
        while len(got) < queued + 1:
            got.append(agent.recv(65536))

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    assert ch.send_raw(b'{"event": "exit"}', wait_s=30) is True
    reader.join(30)
    assert got[-1] == b'{"event": "exit"}'
