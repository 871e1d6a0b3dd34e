"""A job spec is checked the same whatever the entry point: a YAML file (`strict.build`), the
wire decoder (`POST /v1/jobs` bodies) and the REST API itself give the same key and reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Histogram

from tests.fakes.controller_service import FakeService
from trainguard.clock import FakeClock
from trainguard.controller.api.app import create_app
from trainguard.controller.auth import TokenStore
from trainguard.controller.jobs import JobSpec
from trainguard.protocol import ProtocolError
from trainguard.strict import ConfigError, load_file
from trainguard.wire_schemas import decoder

GOOD = "name: llama\ncommand: [train.py, --lr, '3e-4']\nnodes: [node-1, node-2]\n"


@pytest.mark.parametrize(
    ("extra", "key", "reason"),
    [
        pytest.param(
            "nproc_per_node: 0\n", "nproc_per_node", "must be in [1, 1024], got 0", id="nproc-0"
        ),
        pytest.param("min_nodes: 3\n", "min_nodes", "must be within 1..2, got 3", id="min-nodes"),
        pytest.param(
            "env: {TRAINGUARD_JOB: x}\n",
            "env.TRAINGUARD_JOB",
            "is set by trainguard (use ckpt_dir for the dir)",
            id="reserved-env",
        ),
        pytest.param(
            "nproc_per_nod: 2\n",
            "nproc_per_nod",
            "unknown key (did you mean 'nproc_per_node'?)",
            id="typo",
        ),
        pytest.param(
            "nproc_per_node: '2'\n", "nproc_per_node", "expected an integer, got string", id="type"
        ),
        pytest.param(
            "checkpoint: {interval: often}\n",
            "checkpoint.interval",
            "must be 'auto' or a number of steps in [1, 10000000], got 'often'",
            id="interval-word",
        ),
        pytest.param(
            "checkpoint: {interval: 0}\n",
            "checkpoint.interval",
            "must be 'auto' or a number of steps in [1, 10000000], got 0",
            id="interval-zero",
        ),
        pytest.param(
            "checkpoint: {interval: auto, min_every_steps: 500, max_every_steps: 100}\n",
            "checkpoint.max_every_steps",
            "must be in [min_every_steps (500), 10000000], got 100",
            id="bounds-crossed",
        ),
        pytest.param(
            "checkpoint: {interval: 100, initial_every_steps: 50}\n",
            "checkpoint.initial_every_steps",
            "is for interval: auto only",
            id="initial-without-auto",
        ),
        pytest.param(
            "checkpoint: {interval: auto, initial_every_steps: 5}\n",
            "checkpoint.initial_every_steps",
            "must be within [min_every_steps, max_every_steps], got 5",
            id="initial-out-of-bounds",
        ),
        pytest.param(
            "checkpoint: {retention: {daily_days: 99999}}\n",
            "checkpoint.retention.daily_days",
            "must be in [0, 3660], got 99999",
            id="retention-bound",
        ),
        pytest.param(
            "checkpoint: {retention: {recent_last: true}}\n",
            "checkpoint.retention.recent_last",
            "must be an integer, got True",
            id="retention-type",
        ),
        pytest.param(
            "checkpoint: {retention: {dayly_days: 7}}\n",
            "checkpoint.retention.dayly_days",
            "unknown key (known: daily_days, recent_hours, recent_last, weekly_weeks)",
            id="retention-typo",
        ),
        pytest.param(
            "env: {TRAINGUARD_RETENTION: '{\"weekly_weeks\": -1}'}\n",
            "env.TRAINGUARD_RETENTION.weekly_weeks",
            "must be in [0, 520], got -1",
            id="retention-in-env",
        ),
        pytest.param(
            "env: {TRAINGUARD_RETENTION: 'daily'}\n",
            "env.TRAINGUARD_RETENTION",
            "not a JSON object",
            id="retention-env-not-json",
        ),
        pytest.param(
            "env: {TRAINGUARD_CHECKPOINT_INTERVAL: auto}\n",
            "env.TRAINGUARD_CHECKPOINT_INTERVAL",
            "set it as checkpoint.interval",
            id="interval-in-env",
        ),
        pytest.param(
            "recovery: {in_process: 'yes'}\n",
            "recovery.in_process",
            "expected true or false, got string",
            id="in-process-type",
        ),
        pytest.param(
            "recovery: {inprocess: true}\n",
            "recovery.inprocess",
            "unknown key (did you mean 'in_process'?)",
            id="in-process-typo",
        ),
    ],
)
def test_yaml_and_wire_reject_a_bad_spec_identically(
    tmp_path: Path, extra: str, key: str, reason: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(GOOD + extra)
    with pytest.raises(ConfigError) as from_yaml:
        load_file(JobSpec, path)
    body = json.dumps(yaml.safe_load(GOOD + extra)).encode()
    with pytest.raises(ProtocolError) as from_wire:
        decoder(JobSpec).decode_json(body)
    assert (from_yaml.value.key, from_yaml.value.reason) == (key, reason)
    assert (from_wire.value.field, from_wire.value.reason) == (key, reason)
    assert str(from_yaml.value) == f"{path}: {key}: {reason}"


MODULE_SPEC = "name: titan\nnodes: [node-1]\ncommand: [-m, {module}, --job.config_file, x.toml]\n"


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        pytest.param("torchtitan.train", None, id="dotted-module"),
        pytest.param("train", None, id="top-level-module"),
        pytest.param("torchtitan/train.py", "must be a dotted Python module name", id="a-path"),
        pytest.param("'.train'", "must be a dotted Python module name", id="relative"),
    ],
)
def test_a_module_command_is_checked_the_same_from_yaml_and_the_wire(
    tmp_path: Path, module: str, reason: str | None
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(MODULE_SPEC.format(module=module))
    body = json.dumps(yaml.safe_load(path.read_text())).encode()
    if reason is None:
        spec = load_file(JobSpec, path)
        assert spec.command[:2] == ["-m", module]
        assert decoder(JobSpec).decode_json(body) == spec
        return
    with pytest.raises(ConfigError) as from_yaml:
        load_file(JobSpec, path)
    with pytest.raises(ProtocolError) as from_wire:
        decoder(JobSpec).decode_json(body)
    assert from_yaml.value.key == from_wire.value.field == "command[1]"
    assert reason in from_yaml.value.reason and from_yaml.value.reason == from_wire.value.reason


def test_the_example_module_job_spec_decodes() -> None:
    repo = Path(__file__).resolve().parents[3]
    spec = load_file(JobSpec, repo / "examples" / "own-ckpt-job.yaml")
    assert spec.command[:2] == ["-m", "train_own_ckpt"]
    assert (repo / "examples" / f"{spec.command[1]}.py").is_file()


def test_a_good_spec_decodes_the_same_from_yaml_and_the_wire(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(GOOD)
    body = json.dumps(yaml.safe_load(GOOD)).encode()
    assert load_file(JobSpec, path) == decoder(JobSpec).decode_json(body)


@pytest.fixture
def client() -> TestClient:
    svc = FakeService(clock=FakeClock())
    svc.add_node("node-1")
    svc.add_node("node-2")
    registry = CollectorRegistry()
    app = create_app(
        svc,
        tokens=TokenStore.from_plaintext({"op-token": ("ops", "operator")}),  # type: ignore[arg-type]
        max_body_bytes=64 * 1024,
        metrics_registry=registry,
        report_latency=Histogram("trainguard_test_report_seconds", "x", registry=registry),
    )
    return TestClient(app, raise_server_exceptions=False)


def test_post_jobs_runs_the_spec_checks(client: TestClient) -> None:
    spec: dict[str, Any] = {**yaml.safe_load(GOOD), "nproc_per_node": 0}
    r = client.post("/v1/jobs", json=spec, headers={"Authorization": "Bearer op-token"})
    assert r.status_code == 422
    assert r.json()["detail"] == {
        "field": "nproc_per_node",
        "reason": "must be in [1, 1024], got 0",
    }


def test_post_jobs_takes_the_in_process_opt_in_and_names_a_bad_one(client: TestClient) -> None:
    spec: dict[str, Any] = {**yaml.safe_load(GOOD), "recovery": {"in_process": 1}}
    r = client.post("/v1/jobs", json=spec, headers={"Authorization": "Bearer op-token"})
    assert r.status_code == 422
    assert r.json()["detail"]["field"] == "recovery.in_process"
    spec["recovery"] = {"in_process": True}
    r = client.post("/v1/jobs", json=spec, headers={"Authorization": "Bearer op-token"})
    assert r.status_code == 201, r.text
    assert decoder(JobSpec).decode_json(json.dumps(spec).encode()).recovery.in_process


def test_post_jobs_names_the_bad_checkpoint_field(client: TestClient) -> None:
    spec: dict[str, Any] = {
        **yaml.safe_load(GOOD),
        "checkpoint": {"interval": "auto", "retention": {"weekly_weeks": 9999}},
    }
    r = client.post("/v1/jobs", json=spec, headers={"Authorization": "Bearer op-token"})
    assert r.status_code == 422
    assert r.json()["detail"] == {
        "field": "checkpoint.retention.weekly_weeks",
        "reason": "must be in [0, 520], got 9999",
    }
    spec["checkpoint"] = {"interval": "auto", "min_every_steps": 20, "max_every_steps": 2000}
    r = client.post("/v1/jobs", json=spec, headers={"Authorization": "Bearer op-token"})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("checkpoint", "field"),
    [
        ({"interval": int("9" * 400)}, "checkpoint.interval"),
        ({"interval": "auto", "min_every_steps": int("9" * 400)}, "checkpoint.min_every_steps"),
        ({"interval": float("nan")}, "checkpoint.interval"),
        ({"interval": "auto\nx"}, "checkpoint.interval"),
        ({"retention": {"recent_last": -1}}, "checkpoint.retention.recent_last"),
        ({"interval": "auto", "bad\nkey": 1}, "checkpoint"),
    ],
)
def test_post_jobs_refuses_hostile_checkpoint_values_naming_the_field(
    client: TestClient, checkpoint: dict[str, Any], field: str
) -> None:
    spec: dict[str, Any] = {**yaml.safe_load(GOOD), "checkpoint": checkpoint}
    body = json.dumps(spec, allow_nan=True)  # NaN as JSON's NaN token, which the API may see
    r = client.post(
        "/v1/jobs",
        content=body,
        headers={"Authorization": "Bearer op-token", "Content-Type": "application/json"},
    )
    assert r.status_code in (400, 422), r.text
    assert field in json.dumps(r.json()), r.json()
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer op-token"}).json() in (
        [],
        {"jobs": []},
    )
