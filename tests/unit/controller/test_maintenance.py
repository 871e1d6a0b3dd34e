"""The maintenance scheduler inside the controller: started and stopped with it, jobs that
never stack, a failing job body logged and counted without harm, metrics, the config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

import trainguard.controller.maintenance as maintenance_mod
from tests.helpers import wait_for
from trainguard.controller.config import ControllerConfig, MaintenanceConfig, RetentionConfig
from trainguard.strict import ConfigError, build

DAY_S = 86400.0
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "controller.yaml"


def _sample(core: Any, name: str, **labels: str) -> float | None:
    return core.metrics.registry.get_sample_value(name, labels)


def test_the_controller_starts_and_stops_the_scheduler(make_core):
    core = make_core()
    assert not core.maintenance.running
    core.start()
    assert core.maintenance.running
    assert sorted(core.maintenance.job_ids()) == ["checkpoint", "retention"]
    for job in core.maintenance._scheduler.get_jobs():
        assert job.max_instances == 1 and job.coalesce
    core.stop()
    assert not core.maintenance.running and core.maintenance.job_ids() == []


def test_disabled_maintenance_runs_no_scheduler(make_core):
    core = make_core(maintenance={"enabled": False})
    core.start()
    assert core.running and not core.maintenance.running


def test_a_failing_job_body_is_logged_and_counted_and_the_controller_goes_on(
    make_core, monkeypatch, caplog
):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(maintenance_mod, "run_retention", broken)
    core = make_core()
    core.start()
    errors = "trainguard_controller_maintenance_errors_total"
    for expected in (1.0, 2.0):  # and the job keeps its schedule: it runs again

        def counted(expected: float = expected) -> bool:
            return _sample(core, errors, job="retention") == expected

        core.maintenance.run_now("retention")
        wait_for(counted, timeout_s=10, what=f"retention error number {expected:.0f} counted")
    assert "event=maintenance_error job=retention" in caplog.text
    assert "disk on fire" in caplog.text
    assert core.running and core.maintenance.running and core.ticking(within_s=30)
    core.maintenance.run_now("checkpoint")  # the other job is unaffected
    wait_for(
        lambda: _sample(
            core, "trainguard_controller_maintenance_last_run_timestamp_seconds", job="checkpoint"
        ),
        timeout_s=10,
        what="a checkpoint run after the failures",
    )


def test_a_retention_run_counts_deleted_rows_and_exports_the_store_size(make_core, core_clock):
    core = make_core()
    core.store.events.insert("n9", "i", [(i, "xid", 0.0, {}) for i in range(1, 8)])
    core.store.audit.record(
        ts=core_clock.now(), actor="ops", action="drain", target="n9", detail={}
    )
    core_clock.advance(365 * DAY_S)
    core.maintenance.retention_job()  # the job body, as the scheduler calls it
    name = "trainguard_controller_retention_deleted_rows_total"
    assert _sample(core, name, table="events") == 7
    assert _sample(core, name, table="audit_log") == 1
    assert _sample(core, name, table="incidents") == 0
    last = "trainguard_controller_maintenance_last_run_timestamp_seconds"
    assert _sample(core, last, job="retention") == core_clock.now()
    db_bytes, _ = core.store.space.file_sizes()
    assert _sample(core, "trainguard_controller_store_size_bytes", file="db") == db_bytes > 0
    text = generate_latest(core.metrics.registry).decode()
    assert 'trainguard_controller_store_size_bytes{file="wal"}' in text


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key", "reason"),
    [
        ({"retention": {"events_days": -1}}, "maintenance.retention.events_days", ">= 0"),
        ({"retention": {"batch_rows": 0}}, "maintenance.retention.batch_rows", "1..100000"),
        ({"retention_interval_s": 0}, "maintenance.retention_interval_s", "> 0"),
        ({"vacuum_max_pages": -5}, "maintenance.vacuum_max_pages", ">= 0"),
        ({"retention": {"event_days": 3}}, "maintenance.retention.event_days", "unknown"),
    ],
    ids=["negative-days", "zero-batch", "zero-interval", "negative-pages", "typo"],
)
def test_bad_maintenance_settings_fail_with_key_and_reason(data, key, reason):
    with pytest.raises(ConfigError) as info:
        build(ControllerConfig, {"maintenance": data}, source="test.yaml")
    assert info.value.key == key
    assert reason in info.value.reason


def test_retention_ages_are_days_and_zero_keeps_forever():
    policy = RetentionConfig(events_days=14, audit_days=0)
    assert policy.max_age_s("events") == 14 * DAY_S
    assert policy.max_age_s("audit") is None


def test_the_example_documents_every_maintenance_key_with_its_default():
    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["maintenance"] == dataclasses.asdict(MaintenanceConfig())
