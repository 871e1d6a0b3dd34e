"""SignalState: what reports and events turn into, counter semantics of the bounded history,
and an ingest micro-benchmark (printed, never asserted)."""

from __future__ import annotations

import dataclasses
import time
import typing
from dataclasses import replace
from typing import TypeVar

import pytest

from trainguard.controller.model import Target
from trainguard.controller.signals import (
    DEFAULT_TRACKED,
    IB_COUNTERS,
    IB_HW_COUNTERS,
    SIGNALS,
    Series,
    SignalState,
)
from trainguard.model import GpuSample, IbPortSample, NvLinkSample
from trainguard.protocol import Event, RankState, Report
from trainguard.xid_catalog import XidInfo

T0 = 1_700_000_000.0
T = TypeVar("T")


class _Catalog:
    def classify(self, code: int, message: str = "") -> XidInfo:
        severity = "fatal" if code == 79 else "informational"
        return XidInfo(code=code, name="x", severity=severity, action="none", description="")


def _gpu(index: int = 0, **fields: object) -> GpuSample:
    return GpuSample(
        index=index, uuid=f"GPU-{index}", pci_bus_id=f"0000:{index:02x}:00.0", name="H100", **fields
    )  # type: ignore[arg-type]


def _report(node: str = "n1", **kw: object) -> Report:
    return Report(node=node, instance="i", seq=1, sent_at=T0, **kw)  # type: ignore[arg-type]


def _value(s: SignalState, target: Target, name: str, now: float) -> object:
    return s.value(target, name, now=now)


GPU0 = Target("gpu", node="n1", gpu=0)


# --- Series ---------------------------------------------------------------------------------


def _series(
    points: list[tuple[float, float]], *, spacing: float = 0.0, horizon: float = 900.0
) -> Series:
    s = Series(points[0][0], points[0][1])
    for t, v in points[1:]:
        s.update(t, v, min_spacing_s=spacing, horizon_s=horizon)
    return s


def test_increase_treats_a_decrease_as_a_counter_reset() -> None:
    s = _series([(0, 0), (10, 10), (20, 3), (30, 5)])
    assert s.increase(30, 60) == 15  # 10, then reset to 3 (+3), then +2


def test_increase_across_a_64_bit_wrap_counts_the_new_value() -> None:
    s = _series([(0, 2**64 - 5), (10, 10)])
    assert s.increase(10, 60) == 10


def test_window_only_counts_changes_inside_it() -> None:
    s = _series([(0, 0), (100, 5), (500, 7)])
    assert s.increase(550, 100) == 2
    assert s.increase(550, 1000) == 7
    assert s.changes(550, 100) == 1
    assert s.changes(550, 1000) == 2


def test_merged_points_keep_exact_change_counts_and_extremes() -> None:
    flips = [(float(t), float(t % 2)) for t in range(1, 60)]
    s = _series([(0.0, 0.0), *flips], spacing=10.0)
    assert len(s) <= 8
    assert s.changes(59, 600) == 59
    gauge = _series([(0, 1), (1, 9), (2, 2), (3, 3)], spacing=10.0)
    assert gauge.extreme(3, 60, highest=True) == 9
    assert gauge.extreme(3, 60, highest=False) == 1


def test_history_is_bounded_by_horizon_over_spacing() -> None:
    s = _series([(float(t), float(t)) for t in range(20_000)], spacing=5.0, horizon=900.0)
    assert len(s) <= 900 / 5 + 2
    assert s.increase(19_999, 300) == pytest.approx(300, abs=5)


# --- ingest ---------------------------------------------------------------------------------


def test_gpu_fields_are_signals_and_absent_fields_are_absent() -> None:
    s = SignalState()
    s.ingest(_report(gpus=(_gpu(temperature_celsius=60.0, lost=False),)), now=T0, new_events=())
    assert _value(s, GPU0, "temperature_celsius", T0) == 60.0
    assert _value(s, GPU0, "lost", T0) is False
    assert _value(s, GPU0, "power_watts", T0) is None
    assert _value(s, Target("gpu", node="n1", gpu=5), "temperature_celsius", T0) is None


def _filled(cls: type[T], **given: object) -> T:
    """An instance of the sample dataclass `cls` with every optional field present: numbers
    3, booleans False, and `given`."""
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in given or f.default is not None:
            continue
        hint = str(hints[f.name])
        if "bool" in hint:
            values[f.name] = False
        elif "int" in hint or "float" in hint:
            values[f.name] = 3
    return cls(**values, **given)


def test_every_catalogued_signal_has_a_reader() -> None:
    # a report with every source field present, the controller's inventory of the node and
    # the job, and an XID: each catalogued signal then reads a value of its kind
    s = SignalState()
    link = _filled(NvLinkSample, link=0, up=True)
    port = IbPortSample(
        device="mlx5_0",
        port=1,
        state_code=4,
        phys_state_code=5,
        rate_gbps=400.0,
        counters=dict.fromkeys(IB_COUNTERS, 3),
        hw_counters=dict.fromkeys(IB_HW_COUNTERS, 3),
    )
    gpu = _filled(
        GpuSample, index=0, uuid="GPU-0", pci_bus_id="0000:00:00.0", name="H100", nvlinks=(link,)
    )
    rank = _filled(RankState, job="j", rank=0, step=1)
    s.set_node_meta("n1", role="active", state="active", job="j")
    s.set_job_meta("j", nodes=("n1",), state="running")
    xid = Event(id=1, kind="xid", ts=T0, gpu=0, code=79)
    s.ingest(_report(gpus=(gpu,), ib_ports=(port,), ranks=(rank,)), now=T0, new_events=(xid,))
    targets = {
        "gpu": GPU0,
        "nvlink": Target("nvlink", node="n1", gpu=0, link=0),
        "ib_port": Target("ib_port", node="n1", device="mlx5_0", port=1),
        "node": Target("node", node="n1"),
        "rank": Target("rank", job="j", rank=0),
        "job": Target("job", job="j"),
    }
    kinds = {"number": (int, float), "string": (str,)}
    unread = []
    for scope, names in SIGNALS.items():
        for name, spec in names.items():
            value = s.value(targets[scope], name, now=T0 + 1)
            if not isinstance(value, kinds[spec.kind]):
                unread.append(f"{scope}.{name}={value!r} ({spec.kind})")
    assert unread == []
    assert s.value(GPU0, "xid_last_code", now=T0 + 1) == 79
    assert s.value(targets["node"], "report_age_s", now=T0 + 1) == pytest.approx(1.0)


def test_ib_port_state_codes_become_up_signals() -> None:
    s = SignalState()
    port = IbPortSample(
        device="mlx5_0",
        port=1,
        state_code=1,
        phys_state_code=5,
        counters={"symbol_error": 4},
        hw_counters={"out_of_buffer": 2},
    )
    s.ingest(_report(ib_ports=(port,)), now=T0, new_events=())
    t = Target("ib_port", node="n1", device="mlx5_0", port=1)
    assert (_value(s, t, "up", T0), _value(s, t, "phys_up", T0)) == (0, 1)
    assert (_value(s, t, "symbol_error", T0), _value(s, t, "out_of_buffer", T0)) == (4, 2)
    assert _value(s, Target("node", node="n1"), "ib_ports_down", T0) == 1


def test_only_tracked_signals_keep_history() -> None:
    s = SignalState(min_spacing_s=0)
    for i in range(10):
        g = _gpu(temperature_celsius=50.0 + i, ecc_corrected_volatile_total=i)
        s.ingest(_report(gpus=(g,)), now=T0 + i, new_events=())
    assert "temperature_celsius" not in DEFAULT_TRACKED["gpu"]
    # the ECC counter (baseline + 9 changes) and one baseline for each of the 4 node counts
    assert s.series_points() == 10 + 4
    s.track({"gpu": ["temperature_celsius"]})
    s.ingest(
        _report(gpus=(_gpu(temperature_celsius=70.0, ecc_corrected_volatile_total=9),)),
        now=T0 + 10,
        new_events=(),
    )
    assert s.series_points() == 14 + 2


def test_track_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown signal 'temp'"):
        SignalState().track({"gpu": ["temp"]})
    with pytest.raises(ValueError, match="unknown scope"):
        SignalState().track({"rack": ["x"]})


def test_xid_events_count_total_and_fatal_per_gpu_and_node() -> None:
    s = SignalState(xid_catalog=_Catalog())
    s.ingest(_report(gpus=(_gpu(),)), now=T0, new_events=())
    events = [
        Event(id=1, kind="xid", ts=T0, gpu=0, code=13),
        Event(id=2, kind="xid", ts=T0, gpu=0, code=79),
        Event(id=3, kind="xid", ts=T0, gpu=None, code=79),
        Event(id=4, kind="fallen_off_bus", ts=T0, gpu=0),
    ]
    s.ingest(_report(gpus=(_gpu(),)), now=T0 + 1, new_events=events)
    assert _value(s, GPU0, "xid_total", T0 + 1) == 2
    assert _value(s, GPU0, "xid_fatal_total", T0 + 1) == 1
    assert _value(s, GPU0, "xid_last_code", T0 + 1) == 79
    assert _value(s, GPU0, "gpu_lost_total", T0 + 1) == 1
    node = Target("node", node="n1")
    assert (_value(s, node, "xid_total", T0 + 1), _value(s, node, "xid_fatal_total", T0 + 1)) == (
        3,
        2,
    )


def test_event_for_a_gpu_missing_from_the_report_is_kept() -> None:
    s = SignalState(xid_catalog=_Catalog())
    s.ingest(
        _report(gpus=(_gpu(0),)), now=T0, new_events=[Event(id=1, kind="gpu_lost", ts=T0, gpu=3)]
    )
    t = Target("gpu", node="n1", gpu=3)
    assert _value(s, t, "gpu_lost_total", T0) == 1
    assert _value(s, t, "temperature_celsius", T0) is None
    assert _value(s, Target("node", node="n1"), "gpus_lost", T0) == 1


def test_vanished_gpu_keeps_counters_but_loses_sample_values() -> None:
    s = SignalState(xid_catalog=_Catalog())
    s.ingest(
        _report(gpus=(_gpu(0, temperature_celsius=50.0), _gpu(1))),
        now=T0,
        new_events=[Event(id=1, kind="xid", ts=T0, gpu=0, code=79)],
    )
    s.ingest(_report(gpus=(_gpu(1),)), now=T0 + 1, new_events=())
    assert _value(s, GPU0, "temperature_celsius", T0 + 1) is None
    assert _value(s, GPU0, "xid_fatal_total", T0 + 1) == 1
    node = Target("node", node="n1")
    assert (_value(s, node, "gpus", T0 + 1), _value(s, node, "gpus_lost", T0 + 1)) == (1, 1)


def test_rank_ages_grow_with_the_report_age() -> None:
    s = SignalState()
    s.ingest(
        _report(ranks=(RankState(job="j", rank=0, step=5, heartbeat_age_s=1.0, step_age_s=3.0),)),
        now=T0,
        new_events=(),
    )
    t = Target("rank", job="j", rank=0)
    assert _value(s, t, "heartbeat_age_s", T0 + 10) == 11.0
    assert _value(s, t, "step_age_s", T0 + 10) == 13.0
    assert _value(s, Target("node", node="n1"), "report_age_s", T0 + 10) == 10.0


def test_nan_events_count_per_rank_and_job() -> None:
    s = SignalState()
    ranks = (RankState(job="j", rank=0, step=5), RankState(job="j", rank=1, step=5))
    ev = [
        Event(id=1, kind="nan_loss", ts=T0, job="j", rank=1),
        Event(id=2, kind="nan_loss", ts=T0, job="j", rank=1),
    ]
    s.ingest(_report(ranks=ranks), now=T0, new_events=ev)
    assert _value(s, Target("rank", job="j", rank=1), "nan_total", T0) == 2
    assert _value(s, Target("rank", job="j", rank=0), "nan_total", T0) == 0
    assert _value(s, Target("job", job="j"), "nan_total", T0) == 2


def test_job_signals_aggregate_ranks_across_nodes() -> None:
    s = SignalState()
    s.set_job_meta("j", nodes=["n1", "n2"], state="running")
    s.ingest(
        _report(
            "n1", ranks=(RankState(job="j", rank=0, step=7, samples_per_s=10.0, world_size=2),)
        ),
        now=T0,
        new_events=(),
    )
    s.ingest(
        _report(
            "n2", ranks=(RankState(job="j", rank=1, step=9, samples_per_s=12.0, world_size=2),)
        ),
        now=T0,
        new_events=(),
    )
    job = Target("job", job="j")
    got = {
        n: _value(s, job, n, T0)
        for n in ("ranks", "step", "samples_per_s", "world_size", "state", "ranks_reporting")
    }
    assert got == {
        "ranks": 2,
        "step": 9,
        "samples_per_s": 22.0,
        "world_size": 2,
        "state": "running",
        "ranks_reporting": 2,
    }
    assert _value(s, job, "ranks_reporting", T0 + 60) == 0


def test_rank_no_longer_reported_is_dropped_and_empty_job_forgotten() -> None:
    s = SignalState()
    s.ingest(_report(ranks=(RankState(job="j", rank=0, step=1),)), now=T0, new_events=())
    assert s.jobs() == ["j"]
    s.ingest(_report(), now=T0 + 1, new_events=())
    assert s.value(Target("rank", job="j", rank=0), "step", now=T0 + 1) is None
    assert s.jobs() == []


def test_forget_node_drops_node_and_its_ranks() -> None:
    s = SignalState()
    s.ingest(
        _report(ranks=(RankState(job="j", rank=0, step=1),), gpus=(_gpu(),)), now=T0, new_events=()
    )
    s.set_job_meta("j", nodes=["n1"], state="running")
    s.forget_node("n1")
    assert s.nodes() == [] and s.last_report_at("n1") is None
    assert _value(s, Target("job", job="j"), "ranks", T0) == 0


def test_node_meta_overrides_role_hint() -> None:
    s = SignalState()
    s.ingest(replace(_report(), role_hint="spare"), now=T0, new_events=())
    node = Target("node", node="n1")
    assert _value(s, node, "role", T0) == "spare"
    assert _value(s, node, "state", T0) is None
    s.set_node_meta("n1", role="active", state="draining", job="j")
    assert (
        _value(s, node, "role", T0),
        _value(s, node, "state", T0),
        _value(s, node, "job", T0),
    ) == ("active", "draining", "j")
    assert s.nodes() == ["n1"] and s.last_report_at("n1") == T0


def _big_report(node: str, i: int) -> Report:
    gpus = tuple(
        _gpu(
            g,
            temperature_celsius=60.0 + (i + g) % 5,
            power_watts=500.0 + i % 7,
            utilization_gpu_percent=99.0,
            ecc_corrected_volatile_total=i // 100,
            ecc_uncorrected_volatile_total=0,
            remapped_rows_pending=False,
            throttle_hw_slowdown=False,
            nvlinks=tuple(
                NvLinkSample(link=k, up=True, crc_flit_errors_total=0, replay_errors_total=0)
                for k in range(18)
            ),
        )
        for g in range(8)
    )
    ports = tuple(
        IbPortSample(
            device=f"mlx5_{p}",
            port=1,
            state_code=4,
            phys_state_code=5,
            rate_gbps=400.0,
            counters={
                "symbol_error": 0,
                "link_downed": 0,
                "port_rcv_errors": 0,
                "port_xmit_data": i * 1000,
            },
        )
        for p in range(8)
    )
    ranks = tuple(
        RankState(job="j", rank=r, step=i, step_time_s=0.5, samples_per_s=64.0) for r in range(8)
    )
    return Report(
        node=node, instance="i", seq=i, sent_at=T0 + i, gpus=gpus, ib_ports=ports, ranks=ranks
    )


def test_ingest_micro_benchmark_8_gpu_report() -> None:
    """Prints microseconds per 8-GPU/144-NVLink/8-port/8-rank report (not asserted)."""
    s = SignalState()
    reports = [_big_report("n1", i) for i in range(300)]
    started = time.perf_counter()
    for i, rep in enumerate(reports):
        s.ingest(rep, now=T0 + i, new_events=())
    per_report_us = (time.perf_counter() - started) / len(reports) * 1e6
    points = s.series_points()
    print(f"\nsignals ingest: {per_report_us:.0f} us per 8-GPU report (history points {points})")
    assert s.last_report_at("n1") == T0 + 299
