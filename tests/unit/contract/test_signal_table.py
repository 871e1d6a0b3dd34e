"""The signal table (`trainguard.signals`): one row per signal, consistent with the models
whose fields it names and with itself wherever rows share a Prometheus family."""

from __future__ import annotations

import dataclasses
import re

from trainguard.model import GPU_VALUE_FIELDS, NVLINK_VALUE_FIELDS
from trainguard.protocol import RankState
from trainguard.signals import (
    IB_COUNTERS,
    IB_ERROR_COUNTERS,
    IB_HW_COUNTERS,
    SCOPES,
    SIGNALS,
    by_key,
    ib_counter_prom,
)


def _field_rows(scope: str) -> set[str]:
    return {s.name for s in SIGNALS if s.scope == scope and s.field}


def test_one_row_per_signal_of_a_scope() -> None:
    assert len(by_key()) == len(SIGNALS)
    assert {s.scope for s in SIGNALS} == set(SCOPES)


def test_every_sample_field_is_a_row_and_every_field_row_a_sample_field() -> None:
    # a new GpuSample/NvLinkSample field without its row (or a row naming no field) fails here
    assert _field_rows("gpu") == set(GPU_VALUE_FIELDS)
    assert _field_rows("nvlink") == set(NVLINK_VALUE_FIELDS)
    assert _field_rows("rank") <= {f.name for f in dataclasses.fields(RankState)}
    assert _field_rows("ib_port") <= {"rate_gbps"}


def test_rows_of_one_family_agree_on_type_help_and_label_names() -> None:
    families: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for s in SIGNALS:
        if s.prom is None:
            continue
        seen = (s.type, s.prom.help, tuple(k for k, _ in s.prom.labels))
        assert families.setdefault(s.prom.name, seen) == seen, s.prom.name
    selectors = [s.prom.selector for s in SIGNALS if s.prom is not None]
    assert len(selectors) == len(set(selectors)), "two signals export the same series"


def test_metric_names_follow_the_naming_convention() -> None:
    for s in SIGNALS:
        if s.prom is None:
            continue
        assert re.fullmatch(r"trainguard_[a-z0-9_]+", s.prom.name), s.prom.name
        assert s.prom.name.endswith("_total") == (s.type == "counter"), s.prom.name
        assert s.prom.help.endswith("."), s.prom.name


def test_counter_signals_are_named_for_it_except_sysfs_files() -> None:
    for s in SIGNALS:
        if s.scope == "ib_port" and s.name in IB_COUNTERS + IB_HW_COUNTERS:
            continue  # the kernel's file names
        assert s.name.endswith("_total") == (s.type == "counter"), (s.scope, s.name)


def test_ib_counter_files_map_to_their_families() -> None:
    assert ib_counter_prom("port_xmit_data", hw=False).selector == (
        'trainguard_ib_port_data_bytes_total{direction="transmit"}'
    )
    assert ib_counter_prom("port_xmit_data", hw=False).scale == 0.25
    assert ib_counter_prom("anything_new", hw=True).selector == (
        'trainguard_ib_port_hw_events_total{counter="anything_new"}'
    )
    assert "symbol_error" in IB_ERROR_COUNTERS
    assert "port_xmit_packets" not in IB_ERROR_COUNTERS
