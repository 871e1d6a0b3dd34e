"""Delta reports on the controller side: merging into the held snapshot, when a full report
is asked for, that a delta never makes anything disappear, and that rule evaluation sees
whole reports while ingest goes on without waiting for it."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from trainguard.agent.reporter import DeltaEncoder
from trainguard.controller.api.errors import json_bytes
from trainguard.controller.api.reports import encode_report_response
from trainguard.controller.model import Target
from trainguard.controller.rules import engine
from trainguard.model import GpuSample, IbPortSample, NvLinkSample
from trainguard.protocol import Command, Event, Report, ReportResponse, to_wire


def gpu(
    index: int, *, dbe: int = 0, temp: float = 50.0, crc: tuple[int, ...] = (0, 0)
) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        pci_bus_id=f"0000:{index:02x}:00.0",
        name="H100",
        temperature_celsius=temp,
        ecc_uncorrected_volatile_total=dbe,
        nvlinks=tuple(
            NvLinkSample(link=i, up=True, crc_flit_errors_total=c) for i, c in enumerate(crc)
        ),
    )


def port(device: str, *, rcv: int = 0) -> IbPortSample:
    return IbPortSample(
        device=device, port=1, state="ACTIVE", state_code=4, counters={"port_rcv_data": rcv}
    )


def report(
    seq: int,
    *,
    gpus: tuple[GpuSample, ...] = (),
    ports: tuple[IbPortSample, ...] = (),
    full: bool | None = True,
    base_seq: int | None = None,
    instance: str = "inst-1",
    events: tuple[Event, ...] = (),
) -> Report:
    return Report(
        node="n1",
        instance=instance,
        seq=seq,
        sent_at=float(seq),
        gpus=gpus,
        ib_ports=ports,
        full=full,
        base_seq=base_seq,
        events=events,
    )


def held_gpu(c: Any, node: str, index: int, now: float) -> GpuSample | None:
    ctx = c.signals.context_for(Target(scope="gpu", node=node, gpu=index), now=now)
    return None if ctx is None else ctx.gpu.sample


def gpu_value(c: Any, index: int, name: str, now: float) -> Any:
    return c.signals.value(Target(scope="gpu", node="n1", gpu=index), name, now=now)


def test_delta_is_merged_into_the_held_snapshot(make_core, core_clock):
    c = make_core()
    now = core_clock.now()
    two = (gpu(0), gpu(1))
    assert (
        c.ingest_report(report(1, gpus=two, ports=(port("a"), port("b"))), actor="a").want_full
        is None
    )
    delta = report(
        2, gpus=(gpu(1, temp=77.0, crc=(0, 3)),), ports=(port("b", rcv=5),), full=False, base_seq=1
    )
    # the delta's GPU 1 lists only its moved link
    delta = dataclasses.replace(
        delta,
        gpus=(
            dataclasses.replace(
                delta.gpus[0], nvlinks=(NvLinkSample(link=1, up=True, crc_flit_errors_total=3),)
            ),
        ),
    )
    assert c.ingest_report(delta, actor="a").want_full is None
    assert held_gpu(c, "n1", 0, now) == gpu(0)
    assert held_gpu(c, "n1", 1, now) == gpu(1, temp=77.0, crc=(0, 3))
    link0 = c.signals.value(Target(scope="nvlink", node="n1", gpu=1, link=0), "up", now=now)
    assert link0 is not None  # the link the delta left out is still there
    assert c.get_node("n1").gpus == 2 and c.get_node("n1").ib_ports == 2
    assert (
        c.signals.value(Target(scope="ib_port", node="n1", device="a", port=1), "up", now=now) == 1
    )


def test_a_delta_never_makes_a_gpu_or_port_disappear_but_a_full_report_does(make_core, core_clock):
    c = make_core()
    now = core_clock.now()
    c.ingest_report(report(1, gpus=(gpu(0, dbe=1), gpu(1)), ports=(port("a"),)), actor="a")
    c.ingest_report(report(2, gpus=(gpu(1, temp=60.0),), full=False, base_seq=1), actor="a")
    c.ingest_report(report(3, full=False, base_seq=2), actor="a")
    assert gpu_value(c, 0, "ecc_uncorrected_volatile_total", now) == 1
    assert (
        c.signals.value(Target(scope="ib_port", node="n1", device="a", port=1), "up", now=now) == 1
    )
    c.tick()
    assert [i.rule for i in c.list_incidents(node="n1")] == ["gpu_dbe"]
    c.ingest_report(report(4, gpus=(gpu(1),)), actor="a")  # full: GPU 0 and port a are gone
    assert gpu_value(c, 0, "ecc_uncorrected_volatile_total", now) is None
    assert (
        c.signals.value(Target(scope="ib_port", node="n1", device="a", port=1), "up", now=now)
        is None
    )


@pytest.mark.parametrize(
    ("history", "delta", "want"),
    [
        pytest.param([], report(5, full=False, base_seq=4), True, id="unknown-node-new-controller"),
        pytest.param([report(1)], report(2, full=False, base_seq=1), None, id="base-matches"),
        pytest.param([report(1)], report(3, full=False, base_seq=2), True, id="gap-in-seq"),
        pytest.param(
            [report(1)],
            report(2, full=False, base_seq=1, instance="inst-2"),
            True,
            id="other-instance",
        ),
        pytest.param([report(1)], report(2, full=False), True, id="delta-without-base"),
        pytest.param(
            [report(1, full=None)], report(2, full=False, base_seq=1), True, id="base-was-legacy"
        ),
        pytest.param([report(1)], report(2, full=None), None, id="legacy-report"),
    ],
)
def test_when_the_controller_asks_for_a_full_report(make_core, history, delta, want):
    c = make_core()
    for r in history:
        c.ingest_report(r, actor="a")
    assert c.ingest_report(delta, actor="a").want_full is want


def test_deltas_stay_refused_until_a_full_report_arrives(make_core):
    c = make_core()
    c.ingest_report(report(1), actor="a")
    assert c.ingest_report(report(3, full=False, base_seq=2), actor="a").want_full is True
    # a delta based on the report just refused must not be taken as a clean base either
    assert c.ingest_report(report(4, full=False, base_seq=3), actor="a").want_full is True
    assert c.ingest_report(report(5), actor="a").want_full is None
    assert c.ingest_report(report(6, full=False, base_seq=5), actor="a").want_full is None


def test_refused_delta_still_delivers_its_events_and_values(make_core, core_clock):
    c = make_core()
    c.ingest_report(report(1, gpus=(gpu(0),)), actor="a")
    ev = Event(id=1, kind="xid", ts=1.0, gpu=0, code=48)
    resp = c.ingest_report(
        report(3, gpus=(gpu(0, dbe=1),), full=False, base_seq=2, events=(ev,)), actor="a"
    )
    assert resp.want_full is True and resp.ack_event_id == 1
    assert c.store.events.count("n1") == 1
    assert gpu_value(c, 0, "ecc_uncorrected_volatile_total", core_clock.now()) == 1


def test_legacy_agents_never_see_want_full_on_the_wire(make_core):
    c = make_core()
    resp = c.ingest_report(report(7, full=None), actor="a")
    assert "want_full" not in json.loads(json.dumps(to_wire(resp)))


def test_agent_deltas_with_lost_responses_keep_the_controller_equal_to_the_agent(
    make_core, core_clock
):
    """The agent's encoder and the controller together, over random changes and random lost
    requests and responses: after every acknowledged report the controller holds exactly
    the agent's snapshot."""
    c = make_core()
    rng = random.Random(7)
    enc = DeltaEncoder(full_every=10)
    gpus = [gpu(i, crc=(0, 0, 0)) for i in range(4)]
    ports = [port(f"mlx5_{i}") for i in range(2)]
    for seq in range(1, 300):
        core_clock.advance(1.0)
        for i in range(len(gpus)):
            if rng.random() < 0.3:
                g = gpus[i]
                links = tuple(
                    dataclasses.replace(ln, crc_flit_errors_total=ln.crc_flit_errors_total + 1)
                    if rng.random() < 0.2
                    else ln
                    for ln in g.nvlinks
                )
                gpus[i] = dataclasses.replace(
                    g, temperature_celsius=rng.choice([50.0, 51.0]), nvlinks=links
                )
        if rng.random() < 0.3:
            j = rng.randrange(len(ports))
            ports[j] = port(ports[j].device, rcv=ports[j].counters["port_rcv_data"] + 1)
        sent = enc.prepare(report(seq, gpus=tuple(gpus), ports=tuple(ports)))
        fate = rng.random()
        if fate < 0.1:  # the request is lost: the controller never sees it
            enc.acknowledged(False)
            continue
        resp = c.ingest_report(sent, actor="a")
        if fate < 0.2:  # the response is lost
            enc.acknowledged(False)
            continue
        enc.acknowledged(True, want_full=bool(resp.want_full))
        if not resp.want_full:
            now = core_clock.now()
            assert [held_gpu(c, "n1", i, now) for i in range(len(gpus))] == gpus, f"seq {seq}"
            held_ports = [
                c.signals.value(
                    Target(scope="ib_port", node="n1", device=p.device, port=1),
                    "port_rcv_data",
                    now=now,
                )
                for p in ports
            ]
            assert held_ports == [p.counters["port_rcv_data"] for p in ports], f"seq {seq}"
    assert enc.delta_total > enc.full_total > 0


def test_reports_arriving_during_evaluation_are_applied_whole_after_it(
    make_core, core_clock, monkeypatch
):
    """Rule evaluation does not hold the ingest lock: a report that arrives meanwhile is
    answered at once, is not seen by that evaluation, and is applied right after it."""
    c = make_core()
    c.ingest_report(report(1, gpus=(gpu(0),)), actor="a")
    real = engine.evaluate
    seen: dict[str, Any] = {}

    def evaluate(**kwargs: Any) -> Any:
        resp = c.ingest_report(report(2, gpus=(gpu(0, dbe=1),), full=False, base_seq=1), actor="a")
        seen["ack"] = resp.ack_event_id
        seen["during"] = gpu_value(c, 0, "ecc_uncorrected_volatile_total", core_clock.now())
        return real(**kwargs)

    monkeypatch.setattr(engine, "evaluate", evaluate)
    c.tick()
    assert seen == {"ack": 0, "during": 0}  # answered, but not applied under the evaluation
    assert gpu_value(c, 0, "ecc_uncorrected_volatile_total", core_clock.now()) == 1
    assert c.list_incidents(node="n1") == []
    monkeypatch.setattr(engine, "evaluate", real)
    c.tick()
    assert [i.rule for i in c.list_incidents(node="n1")] == ["gpu_dbe"]


@pytest.mark.parametrize(
    "resp",
    [
        pytest.param(ReportResponse(ack_event_id=0, server_time=1700000000.123456), id="plain"),
        pytest.param(ReportResponse(ack_event_id=2**63 - 1, server_time=1e-7), id="big-ack"),
        pytest.param(
            ReportResponse(ack_event_id=3, server_time=2.0, want_full=True), id="want-full"
        ),
        pytest.param(
            ReportResponse(ack_event_id=3, server_time=2.0, want_full=False), id="want-full-false"
        ),
        pytest.param(
            ReportResponse(
                ack_event_id=1, commands=(Command(id="c1", kind="checkpoint", args={"job": "j"}),)
            ),
            id="with-command",
        ),
        pytest.param(
            ReportResponse(ack_event_id=2, server_time=2.0, job_attempts={"llm": 4}),
            id="job-attempts",
        ),
        pytest.param(ReportResponse(ack_event_id=2, server_time=2.0, spare=True), id="spare"),
        pytest.param(
            ReportResponse(ack_event_id=2, server_time=2.0, want_full=True, spare=False),
            id="not-spare-want-full",
        ),
        pytest.param(
            ReportResponse(ack_event_id=2, server_time=2.0, spare=True, report_in_s=0.1),
            id="report-in",
        ),
    ],
)
def test_report_response_fast_encoding_matches_the_wire_encoder(resp):
    assert encode_report_response(resp) == json_bytes(to_wire(resp))
