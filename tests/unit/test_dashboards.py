"""The Grafana dashboards, their provisioning and Prometheus files, checked statically.

Structure (importable JSON: uids, the DS_PROMETHEUS input, variables, units, no hosts),
metric names (every `trainguard_*` name a panel reads is one the agent or the controller
exports, taken from the exporters themselves), thresholds tied to rules/default.yaml, and
dashboards/alerts.yml being the current export of the default rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.agent.metrics import AgentSnapshot, metric_families
from trainguard.agent.sim import SimHardware
from trainguard.clock import FakeClock
from trainguard.controller.metrics import REMEDIATION_PHASES, ControllerMetrics
from trainguard.controller.rules.export import to_prometheus_rules
from trainguard.controller.rules.lang import Arith, Call, Cmp, Node, Num, Sig
from trainguard.controller.rules.loader import Rule, default_rules_path, load_rules
from trainguard.controller.views import JobView
from trainguard.protocol import RankState

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
FILES = ("cluster-overview", "node-detail", "training-job")
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
METRIC_RE = re.compile(r"\btrainguard_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# (dashboard, panel title) -> (rule, signal): the panel's alarm threshold is the rule's
THRESHOLD_TIES = {
    ("training-job", "Straggler score (compute time / job median)"): (
        "straggler",
        "compute_time_s",
    ),
    ("training-job", "Heartbeat age"): ("rank_silent", "heartbeat_age_s"),
    ("training-job", "Step age"): ("training_stall", "step_age_s"),
    ("training-job", "Job throughput vs 15 min peak"): ("throughput_drop", "samples_per_s"),
    ("node-detail", "Correctable ECC rate"): (
        "gpu_correctable_ecc_rate",
        "ecc_corrected_volatile_total",
    ),
    ("node-detail", "NVLink CRC flit error rate (worst link)"): (
        "nvlink_error_rate",
        "crc_flit_errors_total",
    ),
    ("node-detail", "NVLink replay error rate (worst link)"): (
        "nvlink_error_rate",
        "replay_errors_total",
    ),
    ("node-detail", "IB symbol and receive error rate"): ("ib_error_rate", "symbol_error"),
}
# Panels whose colours are visual guides while no default rule reads their signal.
GUIDE_ONLY = {
    ("node-detail", "Temperature"): "temperature_celsius",
    ("cluster-overview", "Hottest GPUs"): "temperature_celsius",
}


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DASHBOARDS / f"{name}.json").read_text())
    return data


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        if p["type"] != "row":
            yield p


def panel(name: str, title: str) -> dict[str, Any]:
    found = [p for p in panels(load(name)) if p["title"] == title]
    assert len(found) == 1, f"{name}: {len(found)} panels titled {title!r}"
    return found[0]


def red_line(p: dict[str, Any]) -> float:
    """The panel's highest threshold step: where it turns to the alarm colour."""
    steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
    values = [s["value"] for s in steps if s["value"] is not None]
    assert values, f"panel {p['title']!r} has no threshold step"
    return float(max(values))


# --- structure ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_dashboard_is_importable_grafana_json_with_the_prometheus_input(name: str) -> None:
    dash = load(name)
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["id"] is None, "an exported dashboard carries no instance id"
    assert dash["title"].startswith("trainguard / ")
    (inp,) = dash["__inputs"]
    assert inp["name"] == "DS_PROMETHEUS"
    assert (inp["type"], inp["pluginId"]) == ("datasource", "prometheus")
    # provisioned (not imported) dashboards resolve ${DS_PROMETHEUS} through this variable
    ds_var = dash["templating"]["list"][0]
    assert (ds_var["name"], ds_var["type"], ds_var["query"]) == (
        "DS_PROMETHEUS",
        "datasource",
        "prometheus",
    )


def test_dashboard_uids_are_unique_and_stable() -> None:
    uids = [load(n)["uid"] for n in FILES]
    assert len(set(uids)) == len(uids)
    assert all(re.fullmatch(r"trainguard-[a-z]+", u) for u in uids), uids


@pytest.mark.parametrize("name", FILES)
def test_every_panel_and_query_uses_the_ds_prometheus_datasource(name: str) -> None:
    for p in panels(load(name)):
        assert p["datasource"] == DS, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t["datasource"] == DS, p["title"]
            assert t["expr"].strip(), p["title"]


@pytest.mark.parametrize("name", FILES)
def test_every_panel_has_a_unit_and_a_unique_id_and_fits_the_grid(name: str) -> None:
    dash = load(name)
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    for p in panels(dash):
        assert p["fieldConfig"]["defaults"].get("unit"), f"panel {p['title']!r} has no unit"
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        for t in p["targets"]:
            refs = [t["refId"] for t in p["targets"]]
            assert len(set(refs)) == len(refs), p["title"]


@pytest.mark.parametrize(
    ("name", "title", "unit"),
    [
        ("node-detail", "Temperature", "celsius"),
        ("node-detail", "Power", "watt"),
        ("node-detail", "Utilisation", "percentunit"),
        ("node-detail", "Memory used", "bytes"),
        ("node-detail", "SM clock", "hertz"),
        ("node-detail", "IB throughput", "Bps"),
        ("training-job", "Step and compute time per rank", "s"),
        ("training-job", "Checkpoint save duration", "s"),
        ("cluster-overview", "ETTR by job", "percentunit"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_panels_carry_the_unit_of_their_metric(name: str, title: str, unit: str) -> None:
    assert panel(name, title)["fieldConfig"]["defaults"]["unit"] == unit


@pytest.mark.parametrize(
    ("name", "variables"),
    [
        ("cluster-overview", []),
        ("node-detail", ["node", "gpu"]),
        ("training-job", ["job"]),
    ],
    ids=FILES,
)
def test_template_variables_are_label_values_queries(name: str, variables: list[str]) -> None:
    dash = load(name)
    found = [v for v in dash["templating"]["list"] if v["type"] == "query"]
    assert [v["name"] for v in found] == variables
    for v in found:
        assert v["datasource"] == DS
        query = v["query"]["query"]
        assert re.fullmatch(rf"label_values\(trainguard_\w+(\{{.*\}})?, {v['name']}\)", query)
        assert v["definition"] == query
    used = {
        m for p in panels(dash) for t in p["targets"] for m in re.findall(r"\$(\w+)", t["expr"])
    }
    assert used - {"__rate_interval", "__interval", "__range"} == set(variables)


@pytest.mark.parametrize("name", FILES)
def test_dashboards_name_no_hosts(name: str) -> None:
    text = (DASHBOARDS / f"{name}.json").read_text()
    assert not re.search(r"https?://|localhost|\b\d{1,3}(\.\d{1,3}){3}\b|:9090|:9500", text)


# --- metric names -------------------------------------------------------------------------


def exported_names() -> set[str]:
    """Every series name the agent (over a sim snapshot) and the controller expose."""
    clock = FakeClock()
    sim = SimHardware(gpus=2, ib_ports=2, node_name="n1", seed=1, clock=clock)
    rank = RankState(
        job="j", rank=0, step=10, loss=1.0, grad_norm=1.0, samples_per_s=1.0,
        tokens_per_s=1.0, step_time_s=0.1, ckpt_step=5,
    )  # fmt: skip
    snap = AgentSnapshot(
        node="n1",
        version="0",
        gpus=sim.collect().gpus,
        ib_ports=sim.collect_ib(),
        ranks=(rank,),
        xid_total={(0, "48", "fatal"): 1},
        collect_duration_s={"gpu": 0.001},
        collect_errors_total={"gpu": 0},
        reports_total={"ok": 1},
        heartbeats_dropped_total={"malformed": 0},
        events_total={"xid": 1},
        commands_total={("drain", "ok"): 1},
        checkpoints={("j", 0): (0.5, 1.0)},
    )
    families = list(metric_families(snap))
    metrics = ControllerMetrics()
    metrics.set_jobs([JobView(name="j", state="running", nodes=("n1",), ettr=0.9)])
    metrics.set_spares({"h100": 1})
    metrics.set_node_incidents({"n1": 0})
    metrics.known_rules(["r"])
    metrics.count("drain", "succeeded")
    metrics.incidents_open.labels(rule="r", severity="critical").set(1)
    metrics.notifications_failed_total.labels(channel="slack").inc()
    metrics.events_total.labels(kind="xid").inc()
    families.extend(metrics.registry.collect())
    names: set[str] = set()
    for fam in families:
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.add(f"{fam.name}_total")
        elif fam.type == "histogram":
            names.update(f"{fam.name}{suffix}" for suffix in HISTOGRAM_SUFFIXES)
        else:
            names.add(fam.name)
    return names


def unknown_metrics(exprs: list[str], known: set[str]) -> set[str]:
    return {m for e in exprs for m in METRIC_RE.findall(e) if m not in known}


def test_every_metric_a_panel_reads_is_exported_by_the_agent_or_controller() -> None:
    known = exported_names()
    exprs = [t["expr"] for n in FILES for p in panels(load(n)) for t in p["targets"]]
    exprs += [v["query"]["query"] for n in FILES for v in load(n)["templating"]["list"]
              if v["type"] == "query"]  # fmt: skip
    assert unknown_metrics(exprs, known) == set()


def test_unknown_metric_check_catches_a_misspelt_name() -> None:
    known = exported_names()
    assert "trainguard_gpu_temperature_celsius" in known
    assert "trainguard_controller_remediation_phase_seconds_bucket" in known
    bad = ['rate(trainguard_gpu_temprature_celsius{node="$node"}[5m])']
    assert unknown_metrics(bad, known) == {"trainguard_gpu_temprature_celsius"}


def test_panels_cover_the_job_and_remediation_metrics() -> None:
    exprs = " ".join(t["expr"] for n in FILES for p in panels(load(n)) for t in p["targets"])
    for name in (
        "trainguard_controller_job_ettr_ratio",
        "trainguard_controller_job_restarts_total",
        "trainguard_controller_job_attempt",
        "trainguard_controller_job_checkpoint_step",
        "trainguard_controller_job_step",
        "trainguard_controller_job_nodes",
        "trainguard_controller_spares",
        "trainguard_controller_remediation_phase_seconds_bucket",
        "trainguard_controller_remediation_lost_steps_sum",
        "trainguard_controller_nodes",
        "trainguard_controller_incidents_open",
        "trainguard_controller_actions_total",
        "trainguard_trainer_checkpoint_duration_seconds",
        "trainguard_trainer_checkpoint_timestamp_seconds",
    ):
        assert re.search(rf"\b{name}\b", exprs), name


# --- the exporters' side of the dashboard metrics -----------------------------------------


def test_agent_exports_checkpoint_duration_and_commit_time_per_rank() -> None:
    rank = RankState(job="j", rank=3, step=7)
    snap = AgentSnapshot(
        node="n1",
        version="0",
        ranks=(rank,),
        checkpoints={("j", 3): (0.25, 1_700_000_000.0), ("j", 4): (None, 1_700_000_001.0)},
    )
    samples = {
        (s.name, s.labels["rank"]): s.value
        for fam in metric_families(snap)
        for s in fam.samples
        if s.name.startswith(
            ("trainguard_trainer_checkpoint_duration", "trainguard_trainer_checkpoint_timestamp")
        )
    }
    assert samples == {
        ("trainguard_trainer_checkpoint_duration_seconds", "3"): 0.25,
        # a commit without a usable duration: the time is known, the duration is absent
        ("trainguard_trainer_checkpoint_timestamp_seconds", "3"): 1_700_000_000.0,
        ("trainguard_trainer_checkpoint_timestamp_seconds", "4"): 1_700_000_001.0,
    }


def controller_samples(
    metrics: ControllerMetrics,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in metrics.registry.collect()
        for s in fam.samples
    }


def test_controller_exports_job_views_and_drops_jobs_that_leave() -> None:
    metrics = ControllerMetrics()
    job = JobView(name="llm", state="running", nodes=("a", "b"), attempt=2, last_step=90,
                  ckpt_step=80, restarts=1, ettr=0.97)  # fmt: skip
    metrics.set_jobs([job, JobView(name="new", state="pending")])
    got = controller_samples(metrics)
    llm = (("job", "llm"),)
    assert got[("trainguard_controller_job_ettr_ratio", llm)] == 0.97
    assert got[("trainguard_controller_job_restarts_total", llm)] == 1
    assert got[("trainguard_controller_job_attempt", llm)] == 2
    assert got[("trainguard_controller_job_step", llm)] == 90
    assert got[("trainguard_controller_job_checkpoint_step", llm)] == 80
    assert got[("trainguard_controller_job_nodes", llm)] == 2
    # unknown ETTR and steps are absent, never a made-up zero
    new = (("job", "new"),)
    assert ("trainguard_controller_job_ettr_ratio", new) not in got
    assert ("trainguard_controller_job_step", new) not in got
    assert got[("trainguard_controller_job_attempt", new)] == 0
    metrics.set_jobs([])
    assert not [
        k for k in controller_samples(metrics) if k[0].startswith("trainguard_controller_job_")
    ]


def test_controller_exports_spares_per_pool_with_the_default_pool_always_present() -> None:
    metrics = ControllerMetrics()
    got = controller_samples(metrics)
    assert got[("trainguard_controller_spares", (("pool", "default"),))] == 0
    metrics.set_spares({"h100": 3})
    got = controller_samples(metrics)
    assert got[("trainguard_controller_spares", (("pool", "h100"),))] == 3
    assert got[("trainguard_controller_spares", (("pool", "default"),))] == 0


def test_controller_remediation_histograms_export_every_phase_before_any_recovery() -> None:
    got = controller_samples(ControllerMetrics())
    for phase in REMEDIATION_PHASES:
        key = ("trainguard_controller_remediation_phase_seconds_count", (("phase", phase),))
        assert got[key] == 0, phase
    assert got[("trainguard_controller_remediation_lost_steps_count", ())] == 0
    assert set(REMEDIATION_PHASES) == {"detect", "checkpoint", "drain", "restart", "mttr"}


def test_controller_exports_per_node_incidents_and_rules_at_zero() -> None:
    metrics = ControllerMetrics()
    metrics.set_node_incidents({"a": 0, "b": 2})
    metrics.known_rules(["gpu_fatal_xid"])
    got = controller_samples(metrics)
    assert got[("trainguard_controller_node_incidents_open", (("node", "a"),))] == 0
    assert got[("trainguard_controller_node_incidents_open", (("node", "b"),))] == 2
    key = ("trainguard_controller_incidents_opened_total", (("rule", "gpu_fatal_xid"),))
    assert got[key] == 0


# --- thresholds and rules -------------------------------------------------------------------


def constants_for(node: Node, signal: str) -> list[float]:
    """Numbers a rule condition compares `signal` against (k in `x > k` or `x > k * f(x)`)."""
    out: list[float] = []

    def reads(n: Node) -> bool:
        # the signal itself or its rate/increase; job_count(x) >= 3 is no threshold on x
        return (isinstance(n, Sig) and n.name == signal) or (
            isinstance(n, Call)
            and n.func in ("rate", "increase")
            and isinstance(n.arg, Sig)
            and n.arg.name == signal
        )

    def walk(n: Node) -> None:
        if isinstance(n, Cmp) and reads(n.left):
            if isinstance(n.right, Num):
                out.append(n.right.value)
            elif isinstance(n.right, Arith) and isinstance(n.right.left, Num):
                out.append(n.right.left.value)
        for child in ("left", "right", "operand", "arg"):
            sub = getattr(n, child, None)
            if sub is not None and not isinstance(sub, str | int | float):
                walk(sub)

    walk(node)
    return out


def default_rules() -> dict[str, Rule]:
    return {r.name: r for r in load_rules([default_rules_path()]).rules}


@pytest.mark.parametrize(
    ("dashboard", "title"), sorted(THRESHOLD_TIES), ids=[t for _, t in sorted(THRESHOLD_TIES)]
)
def test_panel_threshold_matches_the_default_rule(dashboard: str, title: str) -> None:
    rule_name, signal = THRESHOLD_TIES[dashboard, title]
    rule = default_rules()[rule_name]
    constants = constants_for(rule.condition.ast, signal)
    assert len(constants) == 1, f"rule {rule_name}: {signal} compared with {constants}"
    assert red_line(panel(dashboard, title)) == pytest.approx(constants[0])


def test_ib_panel_threshold_covers_both_error_counters_of_the_rule() -> None:
    rule = default_rules()["ib_error_rate"]
    line = red_line(panel("node-detail", "IB symbol and receive error rate"))
    assert constants_for(rule.condition.ast, "port_rcv_errors") == [line]


@pytest.mark.parametrize(
    ("dashboard", "title"), sorted(GUIDE_ONLY), ids=[t for _, t in sorted(GUIDE_ONLY)]
)
def test_guide_only_thresholds_become_ties_once_a_rule_reads_the_signal(
    dashboard: str, title: str
) -> None:
    signal = GUIDE_ONLY[dashboard, title]
    readers = {
        n: c for n, r in default_rules().items() if (c := constants_for(r.condition.ast, signal))
    }
    assert not readers, (
        f"default rules now read {signal} ({readers}): move {title!r} into THRESHOLD_TIES "
        "and set its red line to the rule's number"
    )


def test_threshold_extraction_reads_the_numbers_it_claims() -> None:
    rule = default_rules()["straggler"]
    assert constants_for(rule.condition.ast, "compute_time_s") == [pytest.approx(1.10)]
    assert constants_for(default_rules()["rank_silent"].condition.ast, "heartbeat_age_s") == [30]


# --- Prometheus and Grafana files -----------------------------------------------------------


def test_alerts_yml_is_the_current_export_of_the_default_rules() -> None:
    expected, _ = to_prometheus_rules(load_rules([default_rules_path()]))
    checked_in = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    assert checked_in == expected, (
        "dashboards/alerts.yml is stale: regenerate it with "
        "`agentctl rules export --format prometheus rules/default.yaml > dashboards/alerts.yml` "
        "(and keep its two header comment lines)"
    )


def test_example_prometheus_config_keeps_trainguard_job_labels_and_loads_the_alerts() -> None:
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {s["job_name"]: s for s in config["scrape_configs"]}
    assert set(jobs) == {"trainguard-agent", "trainguard-controller"}
    for scrape in jobs.values():
        # without it Prometheus renames the training job's `job` label to exported_job
        assert scrape["honor_labels"] is True
        assert "static_configs" not in scrape  # targets come from files: no hosts here


def test_grafana_provisioning_examples_are_well_formed() -> None:
    ds = yaml.safe_load((DASHBOARDS / "provisioning" / "datasource.yaml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"].startswith("$"), "the URL comes from the environment, not a host"
    boards = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards.yaml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"]


def test_docs_dcgm_mapping_names_only_exported_metrics() -> None:
    text = (ROOT / "docs" / "dashboards.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("|") and "DCGM_FI_" in line]
    assert len(rows) >= 12, "the dcgm-exporter mapping table lost rows"
    for name in (
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
    ):
        assert name in text, name
    known = exported_names()
    assert unknown_metrics(rows, known) == set()
    for name in FILES:
        assert f"{name}.json" in text
