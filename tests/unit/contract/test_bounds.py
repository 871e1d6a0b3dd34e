"""Every bound of trainguard.bounds, through the one decoder: a value outside it is refused
with its dotted path, a reason that says which bound, `out_of_bounds` set; the edge inside
it is accepted."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainguard.bounds import (
    INT64_MAX,
    INT64_MIN,
    MAX_EVENTS_PER_REPORT,
    MAX_GPUS_PER_REPORT,
    MAX_MAP_ENTRIES,
    MAX_NVLINKS_PER_GPU,
    MAX_RANKS_PER_REPORT,
    NAME_MAX_CHARS,
    UNIX_TIME_MAX_S,
    bad_name_reason,
    metric_value,
)
from trainguard.protocol import Heartbeat, ProtocolError, Report, decode_json, from_wire

BASE: dict[str, Any] = {"node": "n1", "instance": "i1", "seq": 1, "sent_at": 1_700_000_000.0}
GPU: dict[str, Any] = {"index": 0, "uuid": "GPU-0", "pci_bus_id": "0000:18:00.0", "name": "H100"}
RANK: dict[str, Any] = {"job": "j", "rank": 0, "step": 1}
EVENT: dict[str, Any] = {"id": 1, "kind": "xid", "ts": 1_700_000_000.0}


def report(**fields: Any) -> dict[str, Any]:
    return {**BASE, **fields}


def refused(raw: dict[str, Any] | bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        if isinstance(raw, bytes):
            decode_json(Report, raw)
        else:
            from_wire(Report, raw)
    assert e.value.out_of_bounds, e.value
    return e.value


BAD_NAMES = {
    "empty": "",
    "space": " ",
    "nul": "\x00",
    "newline": "n1\nevent=forged",
    "inner-space": "node 1",
    "leading-dot": ".n1",
    "too-long": "n" * (NAME_MAX_CHARS + 1),
    "non-ascii": "nöde",
}


@pytest.mark.parametrize("name", BAD_NAMES.values(), ids=BAD_NAMES.keys())
def test_a_bad_node_name_is_refused_naming_the_pattern(name: str) -> None:
    e = refused(report(node=name))
    assert e.field == "node"
    assert e.reason.startswith("must match [A-Za-z0-9][A-Za-z0-9._-]{0,127}")
    assert len(e.reason) < 120  # a 10k name is never quoted whole
    assert bad_name_reason(name) is not None


@pytest.mark.parametrize("name", BAD_NAMES.values(), ids=BAD_NAMES.keys())
def test_a_bad_job_name_is_refused_in_ranks_and_heartbeats(name: str) -> None:
    assert refused(report(ranks=[{**RANK, "job": name}])).field == "ranks[0].job"
    with pytest.raises(ProtocolError) as e:
        from_wire(Heartbeat, {"job": name, "rank": 0, "step": 1, "t": 1.0})
    assert (e.value.field, e.value.out_of_bounds) == ("job", True)


@pytest.mark.parametrize(
    "name", ["n1", "gpu-node-12.cluster.example.com", "A_b.c-d", "x" * NAME_MAX_CHARS]
)
def test_good_names_are_accepted(name: str) -> None:
    assert from_wire(Report, report(node=name)).node == name
    assert bad_name_reason(name) is None


HUGE = 10**400


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        pytest.param({"ranks": [{**RANK, "step": HUGE}]}, "ranks[0].step", id="step-10e400"),
        pytest.param({"ranks": [{**RANK, "step": INT64_MAX + 1}]}, "ranks[0].step", id="step"),
        pytest.param(
            {"ranks": [{**RANK, "step": INT64_MIN - 1}]}, "ranks[0].step", id="step-below"
        ),
        pytest.param(
            {"ranks": [{**RANK, "ckpt_step": HUGE}]}, "ranks[0].ckpt_step", id="ckpt-step"
        ),
        pytest.param(
            {"gpus": [{**GPU, "ecc_uncorrected_volatile_total": HUGE}]},
            "gpus[0].ecc_uncorrected_volatile_total",
            id="ecc",
        ),
        pytest.param(
            {"gpus": [{**GPU, "ecc_corrected_volatile_total": -1}]},
            "gpus[0].ecc_corrected_volatile_total",
            id="ecc-negative",
        ),
        pytest.param({"events": [{**EVENT, "code": HUGE}]}, "events[0].code", id="event-code"),
        pytest.param({"events": [{**EVENT, "id": INT64_MAX + 1}]}, "events[0].id", id="event-id"),
        pytest.param(
            {"events": [{**EVENT, "data": {"x": {"y": [HUGE]}}}]},
            "events[0].data.x",
            id="event-data-deep",
        ),
        pytest.param({"seq": INT64_MAX + 1}, "seq", id="seq"),
    ],
)
def test_integers_outside_int64_are_refused(fields: dict[str, Any], path: str) -> None:
    e = refused(json.dumps(report(**fields)).encode())
    assert e.field == path
    assert "out of range" in e.reason
    assert len(e.reason) < 120  # 10**400 is never quoted whole


def test_int64_edges_are_accepted() -> None:
    r = from_wire(Report, report(ranks=[{**RANK, "step": INT64_MAX, "ckpt_step": INT64_MIN}]))
    assert (r.ranks[0].step, r.ranks[0].ckpt_step) == (INT64_MAX, INT64_MIN)


@pytest.mark.parametrize(
    ("raw_ts", "ok"),
    [
        pytest.param("Infinity", False, id="inf-string"),
        pytest.param("-Infinity", False, id="minus-inf-string"),
        pytest.param("NaN", False, id="nan-string"),
        pytest.param("1e308", False, id="1e308"),
        pytest.param("-1e308", False, id="minus-1e308"),
        pytest.param("-1", False, id="before-epoch"),
        pytest.param(repr(UNIX_TIME_MAX_S + 1), False, id="after-2100"),
        pytest.param("0", True, id="epoch"),
        pytest.param(repr(UNIX_TIME_MAX_S), True, id="2100"),
    ],
)
def test_event_timestamps_are_finite_and_within_the_window(raw_ts: str, ok: bool) -> None:
    value = raw_ts if raw_ts[0].isdigit() or raw_ts[0] == "-" else json.dumps(raw_ts)
    body = json.dumps(report(events=[{**EVENT}])).replace("1700000000.0}", f"{value}}}")
    if ok:
        decode_json(Report, body.encode())
        return
    e = refused(body.encode())
    assert e.field == "events[0].ts"
    assert "finite" in e.reason or "out of range" in e.reason


def test_a_nan_timestamp_is_refused_not_silently_dropped() -> None:
    e = refused(b'{"node":"n","instance":"i","seq":1,"sent_at":NaN}')
    assert (e.field, e.reason) == ("sent_at", "must be a finite number, got nan")


def test_an_integer_beyond_a_floats_range_in_a_float_field_is_out_of_range() -> None:
    e = refused(report(ranks=[{**RANK, "loss": HUGE}]))
    assert e.field == "ranks[0].loss"
    assert e.reason.startswith("out of range: beyond a float's range")
    # JSON's reading of such a number is infinity: refused where the field must be finite
    e = refused(f'{{"node":"n","instance":"i","seq":1,"sent_at":1{"0" * 400}}}'.encode())
    assert e.field == "sent_at" and "finite" in e.reason


def test_a_nan_loss_is_still_data() -> None:
    r = from_wire(Report, report(ranks=[{**RANK, "loss": "NaN"}]))
    assert r.ranks[0].loss != r.ranks[0].loss


@pytest.mark.parametrize(
    ("fields", "path", "cap"),
    [
        pytest.param({"gpus": [GPU] * (MAX_GPUS_PER_REPORT + 1)}, "gpus", 64, id="gpus"),
        pytest.param(
            {"gpus": [{**GPU, "nvlinks": [{"link": 0}] * (MAX_NVLINKS_PER_GPU + 1)}]},
            "gpus[0].nvlinks",
            64,
            id="nvlinks",
        ),
        pytest.param({"ranks": [RANK] * (MAX_RANKS_PER_REPORT + 1)}, "ranks", 1024, id="ranks"),
        pytest.param(
            {"events": [EVENT] * (MAX_EVENTS_PER_REPORT + 1)}, "events", 1000, id="events"
        ),
        pytest.param(
            {"labels": {f"k{i}": "v" for i in range(MAX_MAP_ENTRIES + 1)}},
            "labels",
            64,
            id="labels",
        ),
    ],
)
def test_counts_per_report_are_capped(fields: dict[str, Any], path: str, cap: int) -> None:
    e = refused(report(**fields))
    assert (e.field, e.reason) == (path, f"too many entries: at most {cap}")


def test_gpus_up_to_the_cap_are_accepted() -> None:
    gpus = [{**GPU, "index": i} for i in range(MAX_GPUS_PER_REPORT)]
    assert len(from_wire(Report, report(gpus=gpus)).gpus) == MAX_GPUS_PER_REPORT


def test_a_wrong_type_is_not_out_of_bounds() -> None:
    with pytest.raises(ProtocolError) as e:
        from_wire(Report, report(seq="1"))
    assert (e.value.field, e.value.out_of_bounds) == ("seq", False)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1.0), (True, 1.0), (2**63, float(2**63)), (float("nan"), None), ("1", None), (HUGE, None)],
    ids=["int", "bool", "int64-edge", "nan", "string", "10e400"],
)
def test_metric_value_is_a_float_or_none(value: Any, expected: float | None) -> None:
    got = metric_value(value)
    if value != value:  # NaN is a valid sample value
        assert got is not None and got != got
    else:
        assert got == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("ckpt_replica_step", -1, id="replica-step-negative"),
        pytest.param("ckpt_replica_lag_s", -0.5, id="replica-lag-negative"),
        pytest.param("ckpt_replica_lag_s", float("inf"), id="replica-lag-inf"),
        pytest.param("ckpt_replica_lag_s", 1e12, id="replica-lag-past-the-duration-bound"),
    ],
)
def test_replica_health_out_of_bounds_is_refused_from_a_trainer_and_in_a_report(
    field: str, value: float
) -> None:
    with pytest.raises(ProtocolError) as e:
        from_wire(Heartbeat, {"job": "j", "rank": 0, "step": 1, "t": 1.0, field: value})
    assert (e.value.field, e.value.out_of_bounds) == (field, True)
    assert refused(report(ranks=[{**RANK, field: value}])).field == f"ranks[0].{field}"


def test_replica_health_inside_its_bounds_is_accepted() -> None:
    hb = from_wire(
        Heartbeat,
        {"job": "j", "rank": 0, "step": 9, "t": 1.0, "ckpt_replica_step": 8,
         "ckpt_replica_lag_s": 0.0},
    )  # fmt: skip
    assert (hb.ckpt_replica_step, hb.ckpt_replica_lag_s) == (8, 0.0)
