"""Delta reports on the agent side: DeltaEncoder against the last acknowledged report, and
the Reporter's handling of want_full and of a controller that predates delta reports."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from trainguard.agent.reporter import DeltaEncoder, EventSpool, Reporter
from trainguard.clock import FakeClock
from trainguard.model import GpuSample, IbPortSample, NvLinkSample
from trainguard.protocol import Event, Report, decode_json

TOKEN = "delta-token"


def gpu(index: int, *, temp: float = 50.0, crc: tuple[int, ...] = (0, 0, 0)) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        pci_bus_id=f"0000:{index:02x}:00.0",
        name="H100",
        temperature_celsius=temp,
        nvlinks=tuple(
            NvLinkSample(link=i, up=True, crc_flit_errors_total=c) for i, c in enumerate(crc)
        ),
    )


def port(device: str, *, rcv: int = 0, state: str = "ACTIVE") -> IbPortSample:
    return IbPortSample(device=device, port=1, state=state, counters={"port_rcv_data": rcv})


def full_report(
    seq: int,
    gpus: tuple[GpuSample, ...] | None = None,
    ports: tuple[IbPortSample, ...] | None = None,
) -> Report:
    return Report(
        node="node-1",
        instance="inst-1",
        seq=seq,
        sent_at=float(seq),
        gpus=(gpu(0), gpu(1)) if gpus is None else gpus,
        ib_ports=(port("mlx5_0"), port("mlx5_1")) if ports is None else ports,
    )


def test_first_report_is_full_and_marked_so() -> None:
    enc = DeltaEncoder()
    sent = enc.prepare(full_report(1))
    assert sent.full is True and sent.base_seq is None
    assert len(sent.gpus) == 2 and len(sent.ib_ports) == 2


def test_after_an_ack_only_changed_gpus_links_and_ports_are_sent() -> None:
    enc = DeltaEncoder()
    enc.prepare(full_report(1))
    enc.acknowledged(True)
    changed = full_report(
        2,
        gpus=(gpu(0), gpu(1, temp=61.0, crc=(0, 5, 0))),
        ports=(port("mlx5_0"), port("mlx5_1", rcv=9)),
    )
    sent = enc.prepare(changed)
    assert sent.full is False and sent.base_seq == 1
    assert [g.index for g in sent.gpus] == [1]
    assert sent.gpus[0].temperature_celsius == 61.0
    assert [ln.link for ln in sent.gpus[0].nvlinks] == [1]  # only the link that moved
    assert [p.device for p in sent.ib_ports] == ["mlx5_1"]


def test_gpu_values_moving_alone_send_the_gpu_without_links() -> None:
    enc = DeltaEncoder()
    enc.prepare(full_report(1))
    enc.acknowledged(True)
    sent = enc.prepare(full_report(2, gpus=(gpu(0, temp=70.0), gpu(1))))
    assert [(g.index, g.nvlinks) for g in sent.gpus] == [(0, ())]
    assert sent.ib_ports == ()


def test_unacknowledged_report_is_not_the_base_so_its_change_is_sent_again() -> None:
    enc = DeltaEncoder()
    enc.prepare(full_report(1))
    enc.acknowledged(True)
    enc.prepare(full_report(2, gpus=(gpu(0, temp=70.0), gpu(1))))
    enc.acknowledged(False)  # request or response lost
    sent = enc.prepare(full_report(3, gpus=(gpu(0, temp=70.0), gpu(1))))
    assert sent.full is False and sent.base_seq == 1
    assert [g.temperature_celsius for g in sent.gpus] == [70.0]


def test_full_report_every_n_reports() -> None:
    enc = DeltaEncoder(full_every=3)
    kinds = []
    for seq in range(1, 8):
        sent = enc.prepare(full_report(seq))
        kinds.append("full" if sent.full else "delta")
        enc.acknowledged(True)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]


def test_want_full_makes_the_next_report_full() -> None:
    enc = DeltaEncoder()
    enc.prepare(full_report(1))
    enc.acknowledged(True)
    assert enc.prepare(full_report(2)).full is False
    enc.acknowledged(True, want_full=True)
    sent = enc.prepare(full_report(3))
    assert sent.full is True and len(sent.gpus) == 2


@pytest.mark.parametrize(
    "after",
    [
        pytest.param(full_report(2, gpus=(gpu(1),)), id="gpu-gone"),
        pytest.param(full_report(2, gpus=(gpu(0), gpu(1), gpu(2))), id="gpu-new"),
        pytest.param(full_report(2, gpus=(gpu(0), gpu(1, crc=(0, 0)))), id="link-gone"),
        pytest.param(full_report(2, ports=(port("mlx5_0"),)), id="port-gone"),
        pytest.param(full_report(2, ports=(port("mlx5_0"), port("mlx5_9"))), id="port-replaced"),
    ],
)
def test_anything_appearing_or_disappearing_forces_a_full_report(after: Report) -> None:
    enc = DeltaEncoder()
    enc.prepare(full_report(1))
    enc.acknowledged(True)
    sent = enc.prepare(after)
    assert sent.full is True and sent.gpus == after.gpus and sent.ib_ports == after.ib_ports


def test_events_ranks_and_health_always_travel_whole() -> None:
    enc = DeltaEncoder()
    enc.prepare(full_report(1))
    enc.acknowledged(True)
    ev = Event(id=1, kind="xid", ts=1.0, gpu=0, code=79)
    report = dataclasses.replace(full_report(2), events=(ev,), health={"spool_events": 1.0})
    sent = enc.prepare(report)
    assert sent.full is False and sent.events == (ev,) and sent.health == {"spool_events": 1.0}


def test_disabled_encoder_sends_the_report_unchanged() -> None:
    enc = DeltaEncoder(enabled=False)
    report = full_report(1)
    assert enc.prepare(report) is report
    enc.acknowledged(True)
    assert enc.prepare(full_report(2)).full is None


class _Controller:
    """Loopback HTTP server answering reports with a scripted `want_full`, or refusing the
    delta fields as unknown keys the way a controller that predates them does."""

    def __init__(self) -> None:
        self.reports: list[Report] = []
        self.want_full_for: set[int] = set()
        self.old = False
        ctl = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                data = json.loads(raw)
                status, out = 200, {"ack_event_id": 0}
                if ctl.old and ("full" in data or "base_seq" in data):
                    status = 422
                    field = "full" if "full" in data else "base_seq"
                    out = {
                        "error": "invalid body",
                        "detail": {"field": field, "reason": "unknown key"},
                    }
                else:
                    report = decode_json(Report, raw)
                    ctl.reports.append(report)
                    if report.seq in ctl.want_full_for:
                        out["want_full"] = True
                body = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def ctl() -> Iterator[_Controller]:
    c = _Controller()
    yield c
    c.stop()


def _reporter(url: str) -> Reporter:
    return Reporter(
        urls=[url],
        token=TOKEN,
        spool=EventSpool(max_events=10),
        build_report=lambda seq, events: full_report(seq),
        clock=FakeClock(),
        rng=random.Random(1),
        timeout_s=2.0,
    )


def test_reporter_sends_deltas_after_an_ack_and_a_full_report_after_want_full(
    ctl: _Controller,
) -> None:
    ctl.want_full_for = {3}
    rep = _reporter(ctl.url)
    for _ in range(5):
        assert rep.report_once().result == "ok"
    rep.close()
    assert [(r.seq, r.full, r.base_seq) for r in ctl.reports] == [
        (1, True, None),
        (2, False, 1),
        (3, False, 2),  # answered want_full
        (4, True, None),
        (5, False, 4),
    ]
    assert all(len(r.gpus) == 2 for r in ctl.reports if r.full)


def test_reporter_falls_back_to_plain_reports_for_a_controller_without_deltas(
    ctl: _Controller,
) -> None:
    ctl.old = True
    rep = _reporter(ctl.url)
    first = rep.report_once()
    assert first.result == "rejected" and first.status == 422
    assert rep.report_once().result == "ok"
    rep.close()
    assert [(r.seq, r.full, len(r.gpus)) for r in ctl.reports] == [(2, None, 2)]
