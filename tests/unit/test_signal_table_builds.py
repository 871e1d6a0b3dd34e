"""What is built from the contract's signal table: the agent's exposition, the controller's
signal catalogue, the rule export and the metrics reference in docs/agent.md. Adding a hardware
signal is one row (plus its model field and the collector code that reads it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric

from trainguard.agent.metrics import OWN_METRICS, AgentSnapshot, metric_families
from trainguard.agent.sim import _IB_HW_COUNTERS
from trainguard.controller.rules.export import PROM_SIGNALS, prom_signals
from trainguard.controller.signals.catalogue import SIGNALS as CATALOGUE
from trainguard.controller.signals.catalogue import build_catalogue
from trainguard.model import GpuSample, IbPortSample
from trainguard.signals import IB_ERROR_COUNTERS, IB_HW_COUNTERS, SIGNALS, Prom, Signal

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _families(fams: list[Metric]) -> dict[str, Metric]:
    return {f.name: f for f in fams}


def test_every_row_reaches_the_catalogue_and_every_exported_row_the_rule_export() -> None:
    for s in SIGNALS:
        spec = CATALOGUE[s.scope][s.name]
        assert (spec.kind, spec.counter, spec.doc) == (s.value, s.type == "counter", s.doc)
        if s.prom is not None:
            assert PROM_SIGNALS[s.scope, s.name].selector == s.prom.selector


def test_the_exposition_has_a_family_for_every_exported_row() -> None:
    names = {f.name for f in metric_families(AgentSnapshot(node="n", version="v"))}
    for s in SIGNALS:
        if s.prom is not None:
            # prometheus_client keeps a counter's name without `_total`
            assert s.prom.name.removesuffix("_total") in names, s.prom.name


def test_a_new_hardware_signal_is_one_row() -> None:
    @dataclass(frozen=True)
    class FanGpu(GpuSample):  # stands for the new model field
        fan_speed_percent: float | None = None

    row = Signal(
        "gpu",
        "fan_speed_percent",
        "fan speed, percent of its maximum",
        "percent",
        "gauge",
        "nvml",
        field=True,
        prom=Prom("trainguard_gpu_fan_speed_ratio", "Fan speed.", div=100),
    )
    table = (*SIGNALS, row)
    gpu = FanGpu(
        index=0, uuid="GPU-0", pci_bus_id="0000:01:00.0", name="H100", fan_speed_percent=42
    )
    fams = _families(
        metric_families(AgentSnapshot(node="n", version="v", gpus=(gpu,)), signals=table)
    )
    (sample,) = fams["trainguard_gpu_fan_speed_ratio"].samples
    assert sample.labels == {"node": "n", "gpu": "0", "uuid": "GPU-0"}
    assert sample.value == 0.42
    assert fams["trainguard_gpu_fan_speed_ratio"].documentation == "Fan speed."
    assert build_catalogue(table)["gpu"]["fan_speed_percent"].doc == row.doc
    exported = prom_signals(table)["gpu", "fan_speed_percent"]
    assert (exported.selector, exported.scale) == ("trainguard_gpu_fan_speed_ratio", 100)


def test_ib_counter_files_are_exported_by_their_table_family() -> None:
    port = IbPortSample(
        device="mlx5_0", port=1, counters={"symbol_error": 2}, hw_counters={"out_of_buffer": 3}
    )
    fams = _families(metric_families(AgentSnapshot(node="n", version="v", ib_ports=(port,))))
    (err,) = fams["trainguard_ib_port_errors"].samples
    (hw,) = fams["trainguard_ib_port_hw_events"].samples
    assert (err.labels["counter"], err.value) == ("symbol_error", 2)
    assert (hw.labels["counter"], hw.value) == ("out_of_buffer", 3)


def test_the_simulator_counts_only_table_counters() -> None:
    assert set(_IB_HW_COUNTERS) <= set(IB_HW_COUNTERS)
    assert IB_ERROR_COUNTERS  # the sim starts every error counter of the table at 0


def _documented_metrics() -> dict[str, str]:
    """metric name -> type, from the tables of docs/agent.md's Metrics reference."""
    text = (DOCS / "agent.md").read_text()
    section = text.split("## Metrics reference", 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`trainguard_"):
            continue
        for name in re.findall(r"`(trainguard_[a-z0-9_]+)`", cells[0]):
            out[name] = cells[1]
    return out


def test_docs_list_every_exported_metric_and_no_other() -> None:
    table = {s.prom.name: s.type for s in SIGNALS if s.prom is not None}
    table.update({name: kind for name, (kind, _, _) in OWN_METRICS.items()})
    assert _documented_metrics() == table


def _documented_signals() -> dict[tuple[str, str], list[str]]:
    """(scope, signal) -> the cells of its row in docs/rules.md's "Signals by scope"."""
    text = (DOCS / "rules.md").read_text()
    section = text.split("### Signals by scope", 1)[1].split("\n## ", 1)[0]
    out: dict[tuple[str, str], list[str]] = {}
    scope = ""
    for line in section.splitlines():
        heading = re.fullmatch(r"### `(\w+)`", line.strip())
        if heading:
            scope = heading.group(1)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`(\w+)`", cells[0])
        if scope and name and len(cells) == 5:
            out[scope, name.group(1)] = cells
    return out


def test_docs_describe_every_signal_as_the_table_does() -> None:
    documented = _documented_signals()
    assert set(documented) == {(s.scope, s.name) for s in SIGNALS}
    for s in SIGNALS:
        _, value, doc, _, prom = documented[s.scope, s.name]
        assert (value, doc) == (s.value, s.doc), (s.scope, s.name)
        if s.prom is not None:
            assert prom.startswith(f"`{s.prom.selector}`"), (s.scope, s.name, prom)
