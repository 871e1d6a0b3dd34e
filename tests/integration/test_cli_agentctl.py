"""agentctl against the fake controller (the real API on a loopback port over a recording
FakeService), with its own named operator and viewer."""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tests.fakes.controller_service import FakeController, FakeService
from tests.helpers import free_port
from tests.integration.controller_proc import dbe_rules
from trainguard import __version__
from trainguard.controller.auth import Role, hash_token
from trainguard.controller.cli import main
from trainguard.controller.cli.format import format_age
from trainguard.controller.cli.parser import build_parser
from trainguard.controller.views import UnknownXidView
from trainguard.durations import parse_duration
from trainguard.protocol import FaultSpec
from trainguard.rules import shipped_dir
from trainguard.xid_catalog import XidCatalog

TOKENS: dict[str, tuple[str, Role]] = {
    "op-token": ("ops-alice", "operator"),
    "viewer-token": ("viewer-bob", "viewer"),
}


@pytest.fixture(scope="module")
def controller() -> Iterator[FakeController]:
    """One fake controller for the module (its state is reset by `svc` for each test)."""
    ctl = FakeController(people=TOKENS)
    yield ctl
    ctl.stop()


@pytest.fixture
def svc(controller: FakeController) -> FakeService:
    s = controller.service
    s.nodes.clear()
    s.incidents.clear()
    s.jobs.clear()
    s.silences.clear()
    s.calls.clear()
    s.reload_error = None
    s.add_node("node-1", gpus=8, report_age_s=3.0, reporting=True, job="llama")
    s.add_node("node-2", role="spare", gpus=8, report_age_s=130.0)
    return s


@pytest.fixture
def env(controller: FakeController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """URL and operator token from the environment; no user config file."""
    monkeypatch.setenv("TRAINGUARD_URL", controller.url)
    monkeypatch.setenv("TRAINGUARD_TOKEN", "op-token")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path


def run(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_get_nodes_prints_aligned_table_with_ages(env: Path, svc: FakeService) -> None:
    code, out, _ = run("get", "nodes")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "NAME",
        "ROLE",
        "STATE",
        "REPORTING",
        "LAST-REPORT",
        "GPUS",
        "JOB",
        "INCIDENTS",
    ]
    assert lines[1].split() == ["node-1", "active", "active", "yes", "3s", "8", "llama", "0"]
    assert lines[2].split() == ["node-2", "spare", "active", "no", "2m", "8", "-", "0"]
    col = lines[0].index("STATE")
    assert all(line[col - 2 : col] == "  " for line in lines)


def test_get_nodes_json_is_the_api_payload(env: Path, svc: FakeService) -> None:
    code, out, _ = run("get", "nodes", "-o", "json")
    assert code == 0
    assert [n["name"] for n in json.loads(out)] == ["node-1", "node-2"]


def test_describe_node_shows_the_xid_codes_the_catalog_does_not_list(
    env: Path, svc: FakeService
) -> None:
    now = time.time()
    seen = UnknownXidView(code=999, count=3, first_at=now - 600, last_at=now - 60)
    svc.nodes["node-1"] = replace(svc.nodes["node-1"], unknown_xids=(seen,))
    code, out, _ = run("describe", "node", "node-1")
    assert code == 0, out
    lines = out.splitlines()
    start = lines.index("unknown_xids:")
    block = "\n".join(lines[start : start + 6])
    assert "code:" in block and "999" in block, out
    assert "count:" in block and "3" in block, out
    assert "ago)" in block, out
    code, out, _ = run("describe", "node", "node-1", "-o", "json")
    assert json.loads(out)["unknown_xids"] == [
        {"code": 999, "count": 3, "first_at": now - 600, "last_at": now - 60}
    ]


def test_get_incidents_passes_filters_and_shows_age(env: Path, svc: FakeService) -> None:
    svc.add_incident(id=7, node="node-1", opened_at=time.time() - 125, summary="DBE on gpu 2")
    code, out, _ = run("get", "incidents", "--node", "node-1", "--state", "open")
    assert code == 0, out
    # a page of 1,000 (and one more, to tell a full page)
    assert svc.calls[-1].kwargs == {
        "state": "open",
        "node": "node-1",
        "limit": 1001,
        "before_id": None,
    }
    row = out.splitlines()[1]
    assert row.split()[:6] == ["7", "gpu_dbe", "node-1", "gpu", "2", "critical"]
    assert " 2m " in row
    assert row.endswith("DBE on gpu 2")


def test_describe_incident_shows_timeline(env: Path, svc: FakeService) -> None:
    svc.add_incident(id=3, node="node-1")
    code, out, _ = run("describe", "incident", "3")
    assert code == 0
    assert "rule:" in out
    assert "timeline:" in out
    assert "incident opened" in out


def test_get_jobs_and_describe_job(env: Path, svc: FakeService) -> None:
    svc.add_job("llama", nodes=("node-1",), ranks=8, ettr=0.97, last_step=120)
    code, out, _ = run("get", "jobs")
    assert code == 0
    assert out.splitlines()[1].split() == [
        "llama",
        "running",
        "torchrun",
        "1",
        "8",
        "0",
        "120",
        "-",
        "0",
        "97.0%",
    ]
    code, out, _ = run("describe", "job", "llama", "-o", "json")
    assert json.loads(out)["ettr"] == 0.97
    svc.jobs["llama"] = replace(svc.jobs["llama"], scheduler="slurm", scheduler_job_id="4242")
    code, out, _ = run("get", "jobs")
    assert out.splitlines()[1].split()[2:4] == ["slurm", "4242"]


def test_drain_undrain_role_and_spares(env: Path, svc: FakeService) -> None:
    assert run("drain", "node-1", "--reason", "xid 79")[0] == 0
    assert svc.nodes["node-1"].drain_reason == "xid 79"
    assert svc.calls[-1].kwargs == {"reason": "xid 79", "actor": "ops-alice"}
    assert run("undrain", "node-1")[0] == 0
    assert svc.nodes["node-1"].state == "active"
    assert svc.calls[-1].kwargs == {"actor": "ops-alice", "force": False}
    assert run("undrain", "--force", "node-1")[0] == 0
    assert svc.calls[-1].kwargs == {"actor": "ops-alice", "force": True}
    assert run("role", "node-1", "spare")[0] == 0
    _, out, _ = run("spares", "-o", "json")
    assert sorted(n["name"] for n in json.loads(out)) == ["node-1", "node-2"]


def test_silence_and_unsilence(env: Path, svc: FakeService) -> None:
    code, out, _ = run(
        "silence",
        "--rule",
        "gpu_dbe",
        "--node",
        "node-1",
        "--for",
        "2h",
        "--comment",
        "rma",
        "-o",
        "json",
    )
    assert code == 0
    silence = json.loads(out)
    assert silence["expires_at"] - silence["created_at"] == pytest.approx(7200)
    assert svc.calls[-1].kwargs["comment"] == "rma"
    code, out, _ = run("get", "silences")
    assert out.splitlines()[1].split()[:4] == [str(silence["id"]), "gpu_dbe", "node-1", "ops-alice"]
    assert run("unsilence", str(silence["id"]))[0] == 0
    assert run("unsilence", str(silence["id"]))[0] == 3


def test_inject_fault_goes_through_the_controller(env: Path, svc: FakeService) -> None:
    code, out, _ = run("inject", "node-1", "dbe", "--gpu", "2")
    assert code == 0
    assert "queued for node-1" in out
    call = svc.calls[-1]
    assert call.method == "inject_fault"
    assert call.args == ("node-1", FaultSpec(kind="dbe", gpu=2))


@pytest.mark.parametrize(
    ("argv", "token", "code"),
    [
        pytest.param(["describe", "node", "ghost"], "op-token", 3, id="not-found-3"),
        pytest.param(["get", "nodes"], "wrong-token", 4, id="unauthorized-4"),
        pytest.param(["drain", "node-1", "--reason", "x"], "viewer-token", 4, id="forbidden-4"),
        pytest.param(["get", "widgets"], "op-token", 2, id="usage-2"),
        pytest.param(["drain"], "op-token", 2, id="missing-node-2"),
        pytest.param(["get", "nodes", "-o", "xml"], "op-token", 2, id="unknown-format-2"),
        pytest.param(["describe", "incident", "x"], "op-token", 2, id="incident-id-not-a-number-2"),
        pytest.param(
            ["silence", "--rule", "r", "--for", "soon"], "op-token", 2, id="bad-duration-2"
        ),
        pytest.param(["rules", "reload"], "op-token", 1, id="request-failed-1"),
    ],
)
def test_exit_codes(
    env: Path,
    svc: FakeService,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    token: str,
    code: int,
) -> None:
    svc.reload_error = "rules/bad.yaml: rule x: unknown signal"
    monkeypatch.setenv("TRAINGUARD_TOKEN", token)
    got, _, err = run(*argv)
    assert got == code, err
    if code != 2:
        assert err.startswith("error")
    assert token not in err


def test_cannot_connect_is_exit_5(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()  # nothing listens there now
    code, _, err = run("--url", f"http://127.0.0.1:{port}", "get", "nodes")
    assert code == 5
    assert "cannot connect" in err


def test_url_and_token_file_from_config_file(
    controller: FakeController,
    svc: FakeService,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRAINGUARD_URL", raising=False)
    monkeypatch.delenv("TRAINGUARD_TOKEN", raising=False)
    cfg_dir = tmp_path / "xdg" / "trainguard"
    cfg_dir.mkdir(parents=True)
    (cfg_dir / "token").write_text("viewer-token\n")
    (cfg_dir / "agentctl.yaml").write_text(f"url: {controller.url}\ntoken_file: token\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert run("get", "nodes")[0] == 0
    # a flag beats the config file: this token file holds an unknown token
    (tmp_path / "other").write_text("nope")
    assert run("get", "nodes", "--token-file", str(tmp_path / "other"))[0] == 4


def test_config_file_with_unknown_key_is_usage_error(tmp_path: Path) -> None:
    cfg = tmp_path / "agentctl.yaml"
    cfg.write_text("url: http://x\ntokenfile: t\n")
    code, _, err = run("--config", str(cfg), "get", "nodes")
    assert code == 2
    assert "tokenfile" in err
    assert "unknown key" in err


def test_token_hash_prints_tokens_file_line() -> None:
    code, out, _ = run("token", "hash", stdin="s3cret\n")
    assert code == 0
    assert out == f"sha256: {hash_token('s3cret')}\n"
    assert run("token", "hash", stdin="")[0] == 2


RULE = dbe_rules()


def test_rules_check_ok_and_bad(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(RULE)
    code, out, _ = run("rules", "check", str(good))
    assert (code, out) == (0, "OK: 1 rules\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(RULE.replace("ecc_uncorrected_volatile_total", "no_such_signal"))
    code, out, err = run("rules", "check", str(bad))
    assert code == 1
    assert str(bad) in err
    assert "gpu_dbe" in err


@pytest.mark.slow
def test_console_script_exit_code_and_output(env: Path, svc: FakeService) -> None:
    exe = Path(sys.executable).parent / "agentctl"
    r = subprocess.run(
        [str(exe), "get", "nodes", "-o", "json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 2
    r = subprocess.run(
        [str(exe), "describe", "node", "ghost"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3


def test_age_and_duration_formats() -> None:
    assert [format_age(s) for s in (0, 3, 119, 120, 7199, 7200, 172800, None)] == [
        "0s",
        "3s",
        "119s",
        "2m",
        "119m",
        "2h",
        "2d",
        "-",
    ]
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90
    with pytest.raises(ValueError):
        parse_duration("2x")


def test_rules_export_prometheus_passes_promtool(tmp_path: Path) -> None:
    rules_dir = Path(__file__).parents[2] / "rules"
    code, out, err = run("rules", "export", "--format", "prometheus", str(rules_dir))
    assert code == 0, err
    doc = yaml.safe_load(out)
    assert doc["groups"]
    assert all(line.startswith("warning: ") for line in err.splitlines())
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required in CI (Debian package prometheus)")
        pytest.skip("promtool not installed")
    exported = tmp_path / "exported.yaml"
    exported.write_text(out)
    r = subprocess.run(
        [promtool, "check", "rules", str(exported)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_export_of_bad_file_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(RULE.replace("severity: critical", "severity: apocalyptic"))
    code, out, err = run("rules", "export", "--format", "prometheus", str(bad))
    assert (code, out) == (1, "")
    assert "gpu_dbe" in err


def test_drain_without_reason_records_who_and_that_agentctl_did(
    env: Path, svc: FakeService
) -> None:
    code, out, err = run("drain", "node-1")
    assert (code, err) == (0, "")
    assert "drained by ops-alice (operator) via agentctl" in out
    assert svc.nodes["node-1"].drain_reason == "drained by ops-alice (operator) via agentctl"
    _, out, _ = run("get", "nodes", "-o", "wide")
    assert out.splitlines()[1].endswith("drained by ops-alice (operator) via agentctl")


def test_cordon_and_uncordon_are_drain_and_undrain(env: Path, svc: FakeService) -> None:
    assert run("cordon", "node-1", "--reason", "ib flaps")[0] == 0
    assert (svc.nodes["node-1"].state, svc.nodes["node-1"].drain_reason) == ("drained", "ib flaps")
    assert svc.calls[-1].method == "drain"
    assert run("uncordon", "node-1")[0] == 0
    assert svc.nodes["node-1"].state == "active"
    assert svc.calls[-1].method == "undrain"


@pytest.mark.parametrize(
    ("names", "resource"),
    [
        pytest.param(("nodes", "node", "no"), "nodes", id="nodes"),
        pytest.param(("incidents", "incident", "inc"), "incidents", id="incidents"),
        pytest.param(("jobs", "job"), "jobs", id="jobs"),
        pytest.param(("silences", "silence"), "silences", id="silences"),
    ],
)
def test_get_accepts_singular_plural_and_short_names(
    env: Path, svc: FakeService, names: tuple[str, ...], resource: str
) -> None:
    svc.add_incident(id=4, node="node-1")
    svc.add_job("llama", nodes=("node-1",))
    outputs = set()
    for name in names:
        code, out, err = run("get", name, "-o", "json")
        assert code == 0, err
        outputs.add(out)
    assert len(outputs) == 1
    assert run("get", resource, "-o", "json")[1] in outputs


def test_describe_accepts_resource_aliases(env: Path, svc: FakeService) -> None:
    svc.add_incident(id=5, node="node-1")
    assert (
        run("describe", "no", "node-1", "-o", "json")[1]
        == run("describe", "node", "node-1", "-o", "json")[1]
    )
    code, out, _ = run("describe", "inc", "5", "-o", "json")
    assert code == 0
    assert json.loads(out)["incident"]["id"] == 5


def _headers(argv: list[str]) -> list[str]:
    code, out, err = run(*argv)
    assert code == 0, err
    return out.splitlines()[0].split()


@pytest.mark.parametrize(
    ("argv", "wide_only"),
    [
        pytest.param(["get", "nodes"], {"IB-PORTS", "AGENT", "LABELS", "DRAIN-REASON"}, id="nodes"),
        pytest.param(["get", "incidents"], {"NODE", "JOB", "UPDATED", "RESOLVED"}, id="incidents"),
        pytest.param(
            ["get", "jobs"],
            {
                "WORLD",
                "PER-NODE",
                "MIN-NODES",
                "AGE",
                "CKPT-AGE",
                "CKPT-FAILS",
                "NODE-LIST",
                "REASON",
            },
            id="jobs",
        ),
        pytest.param(["get", "silences"], {"AGE", "EXPIRES-AT"}, id="silences"),
        pytest.param(["get", "audit"], {"TIME"}, id="audit"),
        pytest.param(["spares"], {"IB-PORTS", "AGENT", "LABELS", "DRAIN-REASON"}, id="spares"),
    ],
)
def test_wide_adds_columns_that_table_leaves_out(
    env: Path, svc: FakeService, argv: list[str], wide_only: set[str]
) -> None:
    svc.add_incident(id=6, node="node-1", summary="DBE on gpu 2")
    svc.add_job("llama", nodes=("node-1",), ranks=8, state_reason="running fine")
    run("silence", "--rule", "gpu_dbe", "--for", "1h")
    table = _headers(argv)
    wide = _headers([*argv, "-o", "wide"])
    assert set(wide) - set(table) == wide_only
    assert [h for h in wide if h in table] == table  # same order, nothing dropped


def test_wide_row_cells_line_up_with_headers(env: Path, svc: FakeService) -> None:
    svc.nodes["node-1"] = replace(
        svc.nodes["node-1"], ib_ports=4, agent_version="0.1.0", labels={"rack": "r7"}
    )
    _, out, _ = run("get", "nodes", "-o", "wide")
    header, row = out.splitlines()[:2]
    cells = dict(zip(header.split(), row.split(), strict=True))
    assert cells["IB-PORTS"] == "4"
    assert cells["AGENT"] == "0.1.0"
    assert cells["LABELS"] == "rack=r7"
    assert cells["DRAIN-REASON"] == "-"


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["get", "nodes"], id="get-nodes"),
        pytest.param(["get", "incidents"], id="get-incidents"),
        pytest.param(["get", "jobs"], id="get-jobs"),
        pytest.param(["get", "silences"], id="get-silences"),
        pytest.param(["get", "audit"], id="get-audit"),
        pytest.param(["spares"], id="spares"),
        pytest.param(["describe", "node", "node-1"], id="describe-node"),
        pytest.param(["describe", "incident", "8"], id="describe-incident"),
        pytest.param(["describe", "job", "llama"], id="describe-job"),
    ],
)
def test_yaml_output_is_the_same_payload_as_json(
    env: Path, svc: FakeService, argv: list[str]
) -> None:
    svc.add_incident(id=8, node="node-1")
    svc.add_job("llama", nodes=("node-1",))
    code, as_yaml, err = run(*argv, "-o", "yaml")
    assert code == 0, err
    assert yaml.safe_load(as_yaml) == json.loads(run(*argv, "-o", "json")[1])
    code, _, err = run(*argv, "-o", "wide")
    assert code == 0, err


def test_version_flag_prints_prog_and_version() -> None:
    assert run("--version") == (0, f"agentctl {__version__}\n", "")


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _parsers(sub, (*path, name))


SUBCOMMANDS = [path for path, _ in _parsers(build_parser())]


def test_the_walk_finds_every_subcommand() -> None:
    assert len(SUBCOMMANDS) == len(set(SUBCOMMANDS)) > 20
    assert {("get",), ("job", "submit"), ("rules", "export"), ("cordon",)} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("path", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_help_has_a_one_line_description_and_an_example(
    path: tuple[str, ...],
) -> None:
    code, out, _ = run(*path, "--help")
    assert code == 0
    parser = dict(_parsers(build_parser()))[path]
    description = parser.description or ""
    assert description.strip()
    assert "\n" not in description.strip()
    assert description in out
    epilog = parser.epilog or ""
    assert epilog.startswith(("example:", "examples:"))
    examples = epilog.splitlines()[1:]
    assert examples
    assert all("agentctl " in line for line in examples)
    assert epilog in out  # kept as written (RawDescriptionHelpFormatter)


def test_group_readable_token_file_warns_with_the_fix(
    controller: FakeController, svc: FakeService, tmp_path: Path
) -> None:
    token = tmp_path / "op.token"
    token.write_text("op-token\n")
    token.chmod(0o644)
    code, _, err = run("--url", controller.url, "--token-file", str(token), "get", "nodes")
    assert code == 0
    assert err.startswith("warning: ")
    assert str(token) in err
    assert f"chmod 600 {token}" in err
    token.chmod(0o600)
    assert run("--url", controller.url, "--token-file", str(token), "get", "nodes")[2] == ""


def test_rules_check_without_a_path_checks_the_shipped_rules_and_xid_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # nowhere near a checkout
    code, out, err = run("rules", "check")
    assert code == 0, err
    rules_line, catalog_line = out.splitlines()
    assert rules_line.startswith("OK: ") and rules_line.endswith(" rules")
    assert int(rules_line.split()[1]) > 0
    catalog = XidCatalog.load()
    assert catalog_line == f"OK: XID catalog {catalog.source}: {len(catalog)} XIDs"
    assert Path(catalog.source).parent == shipped_dir()


def test_rules_export_without_a_path_exports_the_shipped_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run("rules", "export", "--format", "prometheus")
    assert code == 0, err
    assert out == run("rules", "export", "--format", "prometheus", str(shipped_dir()))[1]
    assert yaml.safe_load(out)["groups"]


def test_rules_check_of_a_directory_with_a_bad_xid_catalog_exits_1(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(RULE)
    (tmp_path / "xid_catalog.yaml").write_text("version: 1\nxids: {}\n")
    code, out, err = run("rules", "check", str(tmp_path))
    assert (code, out) == (1, "")
    assert "xid_catalog.yaml" in err


def _bash_complete(script: Path, words: list[str]) -> list[str]:
    """Source the completion script in bash and call its function as bash would for `words`
    (the last one being completed)."""
    words_q = " ".join(shlex.quote(w) for w in words)
    r = subprocess.run(
        [
            "bash",
            "--norc",
            "--noprofile",
            "-c",
            f"source {shlex.quote(str(script))}\n"
            f"COMP_WORDS=({words_q}); COMP_CWORD={len(words) - 1}; COMPREPLY=()\n"
            '_agentctl; printf "%s\\n" "${COMPREPLY[@]}"',
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return [w for w in r.stdout.splitlines() if w]


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("bash") is None:
        pytest.skip("bash not installed")
    code, out, _ = run("completion", "bash")
    assert code == 0
    script = tmp_path_factory.mktemp("completion") / "agentctl.bash"
    script.write_text(out)
    return script


def test_bash_completion_script_is_valid_bash(bash_script: Path) -> None:
    r = subprocess.run(
        ["bash", "-n", str(bash_script)], check=False, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    assert "complete -o default -F _agentctl agentctl" in bash_script.read_text()


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        pytest.param(["agentctl", "ge"], ["get"], id="command"),
        pytest.param(["agentctl", "un"], ["undrain", "uncordon", "unsilence"], id="commands"),
        pytest.param(["agentctl", "get", "inc"], ["incidents", "incident", "inc"], id="resource"),
        pytest.param(
            ["agentctl", "--url", "x", "-o", "json", "rules", "e"], ["export"], id="after-options"
        ),
        pytest.param(["agentctl", "job", ""], ["submit", "stop"], id="nested"),
        pytest.param(["agentctl", "get", "nodes", "-o", "w"], ["wide"], id="option-value"),
        pytest.param(["agentctl", "role", "node-1", "s"], ["spare"], id="second-positional"),
        pytest.param(["agentctl", "drain", "node-1", "--r"], ["--reason"], id="option"),
        pytest.param(["agentctl", "completion", ""], ["bash", "zsh"], id="shells"),
        pytest.param(["agentctl", "drain", ""], [], id="free-text-falls-back"),
    ],
)
def test_bash_completion_completes_subcommands_and_choices(
    bash_script: Path, words: list[str], expected: list[str]
) -> None:
    assert _bash_complete(bash_script, words) == expected


def test_zsh_completion_script_registers_and_offers_the_same_words(tmp_path: Path) -> None:
    code, out, _ = run("completion", "zsh")
    assert code == 0
    assert "compdef _agentctl_zsh agentctl" in out
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("zsh not installed")
    script = tmp_path / "agentctl.zsh"
    script.write_text(out)
    assert subprocess.run([zsh, "-n", str(script)], check=False, timeout=30).returncode == 0
    # compdef and compadd stand in for the completion system's own
    r = subprocess.run(
        [
            zsh,
            "-f",
            "-c",
            "compdef() { print -r -- compdef $*; }\n"
            'compadd() { print -rl -- "$@"; }\n'
            f"source {shlex.quote(str(script))}\n"
            "words=(agentctl get in); CURRENT=3; _agentctl_zsh",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    lines = r.stdout.splitlines()
    assert lines[0] == "compdef _agentctl_zsh agentctl"
    assert lines[1:] == [
        "--",
        "nodes",
        "node",
        "no",
        "incidents",
        "incident",
        "inc",
        "jobs",
        "job",
        "silences",
        "silence",
        "audit",
    ]


def test_get_follows_pages_to_show_every_job_incident_and_audit_entry(
    env: Path, svc: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(2345):
        svc.add_job(f"job-{i:05d}")
    for i in range(1, 1201):
        svc.add_incident(id=i, node="node-1", opened_at=time.time(), summary=f"i{i}")
    svc.audit.clear()
    for i in range(1100):
        svc._audit("ops-alice", "drain", f"node-{i}")
    code, out, _ = run("get", "jobs", "-o", "json")
    assert code == 0, out
    assert [j["name"] for j in json.loads(out)] == [f"job-{i:05d}" for i in range(2345)]
    code, out, _ = run("get", "incidents", "-o", "json")
    assert [i["id"] for i in json.loads(out)] == list(range(1200, 0, -1))
    code, out, _ = run("get", "audit", "-o", "json")
    assert [e["id"] for e in json.loads(out)] == list(range(1100, 0, -1))
    # --limit: at most N, without a note
    code, out, err = run("get", "inc", "--limit", "1050", "-o", "json")
    assert len(json.loads(out)) == 1050 and not err
    # past the default bound: what fits, and a note saying how to see more
    monkeypatch.setattr("trainguard.controller.cli.reads.LIST_MOST", 2000)
    code, out, err = run("get", "jobs", "-o", "json")
    assert code == 0 and len(json.loads(out)) == 2000
    assert "showing the first 2,000 jobs" in err


def test_node_retire_records_the_reason_and_prints_the_node(env: Path, svc: FakeService) -> None:
    code, out, err = run("node", "retire", "node-2", "--reason", "RMA 4411: row remaps")
    assert code == 0, err
    assert svc.nodes["node-2"].state == "retired"
    assert svc.nodes["node-2"].drain_reason == "retired: RMA 4411: row remaps"
    assert "retired" in out


def test_node_retire_without_a_reason_is_a_usage_error(env: Path, svc: FakeService) -> None:
    code, _, err = run("node", "retire", "node-2", "--reason", "  ")
    assert code == 2 and "--reason" in err
    assert svc.nodes["node-2"].state == "active"


def test_node_return_waits_for_the_preflight_and_prints_its_result(
    env: Path, svc: FakeService
) -> None:
    run("node", "retire", "node-2", "--reason", "RMA")
    code, out, err = run("node", "return", "node-2")
    assert code == 0, err
    assert out == "node node-2 returned (spare): preflight passed (ecc)\n"
    assert svc.nodes["node-2"].state == "active"


def test_node_return_that_fails_validation_exits_1_with_the_reason(
    env: Path, svc: FakeService
) -> None:
    svc.preflight_failure = "ecc: 2 uncorrectable errors"
    try:
        run("drain", "node-2")
        code, _, err = run("node", "return", "node-2")
    finally:
        svc.preflight_failure = None
    assert code == 1
    assert "node node-2 stays drained: preflight failed: ecc: 2 uncorrectable errors" in err
