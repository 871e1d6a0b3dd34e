"""SimHardware: plausible values, determinism, and every fault kind, on a FakeClock."""

from __future__ import annotations

import threading
from typing import get_args

import pytest

from tests.helpers import wait_for
from trainguard.agent.sim import GPU_MEMORY_BYTES, NVLINKS_PER_GPU, SimHardware, SimResetError
from trainguard.clock import FakeClock
from trainguard.model import GpuCollection
from trainguard.protocol import FaultKind, FaultSpec


def make(clock: FakeClock, *, gpus: int = 2, ib_ports: int = 2, seed: int = 7) -> SimHardware:
    return SimHardware(gpus=gpus, ib_ports=ib_ports, node_name="node-1", seed=seed, clock=clock)


def test_healthy_gpus_look_like_h100s() -> None:
    sim = make(FakeClock(), gpus=8)
    gpus = sim.collect().gpus
    assert [g.index for g in gpus] == list(range(8))
    assert len({g.uuid for g in gpus}) == 8
    assert len({g.pci_bus_id for g in gpus}) == 8
    for g in gpus:
        assert g.lost is False
        assert g.temperature_celsius is not None and 30 <= g.temperature_celsius <= 80
        assert g.power_watts is not None and 300 <= g.power_watts <= 700
        assert g.memory_total_bytes == GPU_MEMORY_BYTES
        assert g.memory_used_bytes is not None and 0 < g.memory_used_bytes <= GPU_MEMORY_BYTES
        assert g.throttle_hw_slowdown is False and g.throttle_hw_thermal is False
        assert g.ecc_uncorrected_volatile_total == 0
        assert len(g.nvlinks) == NVLINKS_PER_GPU and all(link.up for link in g.nvlinks)
        assert g.retired_pages_sbe is None  # unsupported on H100: absent, not zero


def test_same_seed_and_clock_give_identical_samples() -> None:
    a, b = make(FakeClock()), make(FakeClock())
    for sim in (a, b):
        sim.inject(FaultSpec(kind="ecc_storm", gpu=1, rate_per_s=10))
    ca, cb = FakeClock(), FakeClock()
    assert a.collect() == b.collect()
    assert a.collect_ib() == b.collect_ib()
    assert make(ca, seed=1).collect() != make(cb, seed=2).collect()


def test_ib_data_counters_climb_in_words_while_port_is_active() -> None:
    clock = FakeClock()
    sim = make(clock)
    before = {p.device: p for p in sim.collect_ib()}
    clock.advance(10)
    after = {p.device: p for p in sim.collect_ib()}
    assert set(after) == {"mlx5_0", "mlx5_1"}
    for dev, p in after.items():
        assert p.state == "ACTIVE" and p.phys_state == "LinkUp" and p.rate_gbps == 400.0
        grown = p.counters["port_xmit_data"] - before[dev].counters["port_xmit_data"]
        # ~500 M words/s for 10 s, with +-10 % noise
        assert 4.5e9 <= grown <= 5.5e9


def test_ecc_storm_raises_corrected_counters_at_the_given_rate() -> None:
    clock = FakeClock()
    sim = make(clock)
    sim.inject(FaultSpec(kind="ecc_storm", gpu=0, rate_per_s=50.0))
    clock.advance(2.0)
    g0, g1 = sim.collect().gpus
    assert g0.ecc_corrected_volatile_total == 100
    assert g1.ecc_corrected_volatile_total == 0


def test_timed_fault_stops_after_its_duration() -> None:
    clock = FakeClock()
    sim = make(clock)
    sim.inject(FaultSpec(kind="ecc_storm", gpu=0, rate_per_s=10.0, duration_s=3.0))
    clock.advance(10.0)
    assert sim.collect().gpus[0].ecc_corrected_volatile_total == 30
    assert sim.active_faults() == []


def test_dbe_counts_uncorrected_sets_remap_pending_and_fires_xid_48() -> None:
    clock = FakeClock()
    sim = make(clock)
    sim.inject(FaultSpec(kind="dbe", gpu=1))
    g = sim.collect().gpus[1]
    assert g.ecc_uncorrected_volatile_total == 1
    assert g.ecc_uncorrected_aggregate_total == 1
    assert g.remapped_rows_pending is True
    events = sim.poll()
    assert [(e.kind, e.gpu, e.code) for e in events] == [("xid", 1, 48)]
    assert events[0].pci_bus_id == g.pci_bus_id
    assert sim.poll() == []  # an event fires once


def test_gpu_lost_marks_sample_lost_and_fires_gpu_lost_and_xid_79() -> None:
    sim = make(FakeClock())
    sim.inject(FaultSpec(kind="gpu_lost", gpu=0))
    g = sim.collect().gpus[0]
    assert g.lost is True
    assert g.temperature_celsius is None and g.nvlinks == ()
    assert [(e.kind, e.code) for e in sim.poll()] == [("gpu_lost", None), ("xid", 79)]


def test_nvlink_down_marks_one_link_and_its_errors_climb() -> None:
    clock = FakeClock()
    sim = make(clock)
    sim.inject(FaultSpec(kind="nvlink_down", gpu=0, link=5, rate_per_s=20.0))
    clock.advance(1.0)
    links = sim.collect().gpus[0].nvlinks
    assert [link.link for link in links if not link.up] == [5]
    assert links[5].replay_errors_total == 20
    assert links[4].replay_errors_total == 0


def test_ib_flap_toggles_state_and_counts_link_downed() -> None:
    sim = make(FakeClock())
    sim.inject(FaultSpec(kind="ib_flap", device="mlx5_1", port=1))
    states = []
    for _ in range(4):
        port = {p.device: p for p in sim.collect_ib()}["mlx5_1"]
        states.append(port.state)
    assert states == ["DOWN", "ACTIVE", "DOWN", "ACTIVE"]
    assert port.counters["link_downed"] == 2
    assert {p.device: p for p in sim.collect_ib()}["mlx5_0"].state == "ACTIVE"


def test_ib_down_holds_port_down_and_freezes_data_counters() -> None:
    clock = FakeClock()
    sim = make(clock)
    sim.inject(FaultSpec(kind="ib_down", device="mlx5_0", port=1))
    first = sim.collect_ib()[0]
    clock.advance(5.0)
    later = sim.collect_ib()[0]
    assert later.state == "DOWN" and later.phys_state == "Disabled"
    assert later.counters["link_downed"] == 1
    assert later.counters["port_xmit_data"] == first.counters["port_xmit_data"]


@pytest.mark.parametrize(
    ("kind", "hw_slowdown", "hw_thermal"),
    [("thermal", True, True), ("slowdown", True, False)],
    ids=["thermal", "slowdown"],
)
def test_throttle_faults_set_reason_bits_and_lower_clock(
    kind: FaultKind, hw_slowdown: bool, hw_thermal: bool
) -> None:
    sim = make(FakeClock())
    sim.inject(FaultSpec(kind=kind, gpu=0))
    g = sim.collect().gpus[0]
    assert g.throttle_hw_slowdown is hw_slowdown
    assert g.throttle_hw_thermal is hw_thermal
    assert g.sm_clock_mhz is not None and g.sm_clock_mhz < 1000
    if kind == "thermal":
        assert g.temperature_celsius is not None and g.temperature_celsius > 85


@pytest.mark.parametrize("kind", ["remap_pending", "remap_failure"], ids=str)
def test_remap_faults_set_their_flag(kind: FaultKind) -> None:
    sim = make(FakeClock())
    sim.inject(FaultSpec(kind=kind, gpu=1))
    g = sim.collect().gpus[1]
    assert g.remapped_rows_pending is (kind == "remap_pending")
    assert g.remapped_rows_failure is (kind == "remap_failure")


def test_xid_fault_fires_the_given_code() -> None:
    sim = make(FakeClock())
    sim.inject(FaultSpec(kind="xid", gpu=1, code=74))
    assert [(e.kind, e.gpu, e.code) for e in sim.poll()] == [("xid", 1, 74)]


def test_clear_removes_faults_but_keeps_counters() -> None:
    clock = FakeClock()
    sim = make(clock)
    sim.inject(FaultSpec(kind="ecc_storm", gpu=0, rate_per_s=10.0))
    sim.inject(FaultSpec(kind="gpu_lost", gpu=1))
    sim.inject(FaultSpec(kind="ib_down", device="mlx5_0"))
    clock.advance(1.0)
    sim.inject(FaultSpec(kind="clear"))
    clock.advance(5.0)
    g0, g1 = sim.collect().gpus
    assert g0.ecc_corrected_volatile_total == 10
    assert g1.lost is False
    assert sim.collect_ib()[0].state == "ACTIVE"
    assert sim.active_faults() == []


def _fault_view(sim: SimHardware) -> tuple[object, ...]:
    """What a fault can change, without the noise of a healthy sample."""
    gpus = tuple(
        (
            g.lost,
            g.ecc_corrected_volatile_total,
            g.ecc_uncorrected_volatile_total,
            g.remapped_rows_pending,
            g.remapped_rows_failure,
            g.throttle_hw_slowdown,
            g.throttle_hw_thermal,
            tuple(link.link for link in g.nvlinks if not link.up),
        )
        for g in sim.collect().gpus
    )
    ports = tuple((p.device, p.state) for p in sim.collect_ib())
    events = tuple((e.kind, e.gpu, e.code) for e in sim.poll())
    return gpus, ports, events


# "clear" has its own test: test_clear_removes_faults_but_keeps_counters; "nvml_hang" blocks
# the GPU collect, so its tests collect in a thread: test_nvml_hang_*; "sdc" and "reset_fail"
# are silent until a burn or a reset: test_sdc_and_reset_fail_show_in_the_burn_and_the_reset
FAULT_KINDS = [
    k for k in get_args(FaultKind) if k not in ("clear", "nvml_hang", "sdc", "reset_fail")
]


def test_sdc_and_reset_fail_show_in_the_burn_and_the_reset() -> None:
    sim = make(FakeClock())
    sim.inject(FaultSpec(kind="sdc", gpu=1))
    sim.inject(FaultSpec(kind="reset_fail", gpu=0))
    assert sim.sdc_gpus() == frozenset({1})
    with pytest.raises(SimResetError, match="GPU 0: reset failed"):
        sim.reset_gpu(0)
    sim.reset_gpu(1)  # a reset ends the GPU's sdc
    assert sim.sdc_gpus() == frozenset()
    with pytest.raises(ValueError, match=r"^duration_s: sdc lasts until the GPU is reset"):
        sim.inject(FaultSpec(kind="sdc", gpu=1, duration_s=5.0))
    with pytest.raises(ValueError, match=r"^gpu: "):
        sim.inject(FaultSpec(kind="reset_fail", gpu=9))
    sim.inject(FaultSpec(kind="clear"))
    sim.reset_gpu(0)


@pytest.mark.parametrize("kind", FAULT_KINDS, ids=str)
def test_every_protocol_fault_kind_is_accepted_and_shows(kind: FaultKind) -> None:
    # a kind the sim took but ignored would leave the node looking healthy
    healthy_clock, faulty_clock = FakeClock(), FakeClock()
    healthy, faulty = make(healthy_clock), make(faulty_clock)
    faulty.inject(FaultSpec(kind=kind, gpu=1, device="mlx5_1"))
    healthy_clock.advance(1.0)
    faulty_clock.advance(1.0)
    assert _fault_view(faulty) != _fault_view(healthy)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (FaultSpec(kind="dbe", gpu=9), "gpu"),
        (FaultSpec(kind="nvlink_down", gpu=0, link=18), "link"),
        (FaultSpec(kind="ib_flap", device="mlx5_7"), "device"),
    ],
    ids=["unknown-gpu", "unknown-link", "unknown-ib-device"],
)
def test_fault_on_missing_hardware_is_rejected_naming_the_field(
    spec: FaultSpec, field: str
) -> None:
    sim = make(FakeClock())
    with pytest.raises(ValueError, match=f"^{field}:"):
        sim.inject(spec)
    assert sim.active_faults() == []


def _collect_in_thread(sim: SimHardware) -> tuple[threading.Thread, list[GpuCollection]]:
    out: list[GpuCollection] = []
    t = threading.Thread(target=lambda: out.append(sim.collect()), daemon=True)
    t.start()
    return t, out


def test_nvml_hang_blocks_the_gpu_collect_until_its_duration_passes() -> None:
    clock = FakeClock()
    sim = make(clock)
    sim.inject(FaultSpec(kind="nvml_hang", duration_s=30.0))
    t, out = _collect_in_thread(sim)
    wait_for(lambda: sim.hung_collects_total == 1, timeout_s=5.0, what="the collect to hang")
    # IB, XIDs and fault injection answer meanwhile (the hang does not hold the sim's lock)
    assert len(sim.collect_ib()) == 2
    sim.inject(FaultSpec(kind="xid", gpu=0, code=79))
    assert [e.code for e in sim.poll()] == [79]
    clock.advance(10.0)
    t.join(0.3)
    assert t.is_alive() and out == []  # 10 s into a 30 s hang: still hung
    clock.advance(21.0)
    t.join(5.0)
    assert not t.is_alive() and len(out[0].gpus) == 2
    assert "nvml_hang" not in [f.kind for f in sim.active_faults()]


@pytest.mark.parametrize("release", ["clear", "close"])
def test_nvml_hang_without_duration_lasts_until_cleared_or_closed(release: str) -> None:
    sim = make(FakeClock())
    sim.inject(FaultSpec(kind="nvml_hang"))
    t, out = _collect_in_thread(sim)
    wait_for(lambda: sim.hung_collects_total == 1, timeout_s=5.0, what="the collect to hang")
    t.join(0.2)
    assert t.is_alive()
    if release == "clear":
        sim.inject(FaultSpec(kind="clear"))
    else:
        sim.close()
    t.join(5.0)
    assert not t.is_alive() and len(out[0].gpus) == 2
