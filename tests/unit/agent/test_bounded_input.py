"""The agent's edges against values outside trainguard.bounds: a heartbeat outside them is
dropped and counted as out_of_bounds (the rank is not tracked), and /metrics renders whatever
the snapshot holds (a value with no sample value is skipped and counted)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.agent.heartbeat import HeartbeatServer
from trainguard.agent.metrics import AgentSnapshot, SnapshotCollector, render
from trainguard.clock import FakeClock
from trainguard.protocol import RankState


@pytest.fixture
def server() -> Iterator[HeartbeatServer]:
    d = Path(tempfile.mkdtemp(prefix="tgbi", dir="/tmp"))  # unix socket paths are short
    srv = HeartbeatServer(path=d / "hb.sock", clock=FakeClock(), max_ranks=4)
    yield srv
    srv.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"job":"j","rank":0,"step":1' + b"0" * 400 + b',"t":1.0}', id="step-10e400"),
        pytest.param(
            b'{"job":"j","rank":0,"step":1,"t":1.0,"ckpt_step":9223372036854775808}', id="ckpt-step"
        ),
        pytest.param(b'{"job":"j\\n","rank":0,"step":1,"t":1.0}', id="job-newline"),
        pytest.param(b'{"job":"","rank":0,"step":1,"t":1.0}', id="job-empty"),
        pytest.param(b'{"job":"j","rank":0,"step":1,"t":"Infinity"}', id="t-infinity"),
        pytest.param(b'{"job":"j","rank":0,"step":1,"t":NaN}', id="t-nan"),
        pytest.param(b'{"job":"j","rank":0,"step":1,"t":1e308}', id="t-1e308"),
        pytest.param(b'{"job":"j","rank":-1,"step":1,"t":1.0}', id="rank-negative"),
        pytest.param(
            b'{"job":"j","rank":0,"step":1,"t":1.0,"event_data":{"a":[1' + b"0" * 30 + b"]}}",
            id="event-data-int",
        ),
    ],
)
def test_a_heartbeat_outside_the_bounds_is_dropped_as_out_of_bounds(
    server: HeartbeatServer, raw: bytes
) -> None:
    server.handle_datagram(raw, pid=1)
    assert server.dropped_total["out_of_bounds"] == 1
    assert server.dropped_total["malformed"] == 0
    assert server.ranks() == ()


def test_a_malformed_heartbeat_is_still_malformed(server: HeartbeatServer) -> None:
    server.handle_datagram(b'{"job":"j","rank":"0","step":1,"t":1.0}', pid=1)
    assert (server.dropped_total["malformed"], server.dropped_total["out_of_bounds"]) == (1, 0)


def test_metrics_render_a_value_with_no_sample_value_by_skipping_it() -> None:
    # built in Python, past the decoder: the exposition is the last line of defence
    ranks = (
        RankState(job="j", rank=0, step=10**400, loss=1.5),
        RankState(job="j", rank=1, step=7),
    )
    body = render(SnapshotCollector(lambda: AgentSnapshot(node="n", version="v", ranks=ranks)))
    text = body.decode()
    assert 'trainguard_trainer_step{job="j",node="n",rank="1"} 7.0' in text
    assert 'trainguard_trainer_step{job="j",node="n",rank="0"}' not in text
    assert 'trainguard_trainer_loss{job="j",node="n",rank="0"} 1.5' in text
    skipped = [
        line
        for line in text.splitlines()
        if line.startswith('trainguard_agent_metric_values_skipped_total{node="n"}')
    ]
    assert len(skipped) == 1 and float(skipped[0].split()[-1]) >= 1
