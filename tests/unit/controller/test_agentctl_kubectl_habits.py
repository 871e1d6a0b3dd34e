"""agentctl's kubectl habits: one object by name, label selectors, filters that filter or are
refused, `-o name|jsonpath`, `--no-headers`, `--watch` and `--wait` (driven by a scripted fake
clock against the fake controller), and bad flag values as usage errors."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController, FakeService
from trainguard.clock import FakeClock
from trainguard.controller.cli import main
from trainguard.controller.cli.jsonpath import TemplateError, parse_template
from trainguard.controller.cli.values import selected, selector
from trainguard.durations import duration_arg

# --- pure parts ----------------------------------------------------------------------------------

NODES = {
    "items": [
        {"name": "node-1", "state": "active", "labels": {"rack": "r1"}, "gpus": 8},
        {"name": "node-2", "state": "drained", "labels": {}, "gpus": 4},
    ]
}


@pytest.mark.parametrize(
    ("template", "printed"),
    [
        ("{.items[*].name}", "node-1 node-2"),
        ("{.items[0].state}", "active"),
        ("{.items[-1].name}", "node-2"),
        ("{.items[0].labels.rack}", "r1"),
        ("{.items[1].labels.rack}", ""),
        ("{.items[*].gpus}", "8 4"),
        ('{.items[0].name}{"\\n"}', "node-1\n"),
        ("name={.items[0].name}", "name=node-1"),
        ("{.items[0].labels}", '{"rack":"r1"}'),
        ("{.items[5].name}", ""),
    ],
    ids=str,
)
def test_jsonpath_subset_prints_what_kubectl_would(template: str, printed: str) -> None:
    assert parse_template(template).render(NODES) == printed


def test_jsonpath_of_one_object_starts_at_the_object() -> None:
    assert parse_template("{.name}").render({"name": "node-12"}) == "node-12"
    assert parse_template("{.}").render("x") == "x"


@pytest.mark.parametrize(
    "template", ["{.items[*.name}", "{items}", "{.items", "{}", "", '{"\\q"}', "{.a..b}"]
)
def test_jsonpath_templates_outside_the_subset_are_refused(template: str) -> None:
    with pytest.raises(TemplateError):
        parse_template(template)


def test_selector_terms_match_labels() -> None:
    sel = selector("rack=r1,gpu!=a100")
    assert selected({"rack": "r1", "gpu": "h100"}, sel)
    assert selected({"rack": "r1"}, sel)  # no gpu label: not a100
    assert not selected({"rack": "r2"}, sel)
    assert not selected({"rack": "r1", "gpu": "a100"}, sel)
    assert selected({"zone": "b"}, selector("zone==b"))


@pytest.mark.parametrize("text", ["", "rack", "=r1", "rack=r1,", "a=b c"])
def test_a_malformed_selector_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        selector(text)


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30.0), ("5m", 300.0), ("10", 10.0)])
def test_durations_read_with_a_unit_or_as_seconds(text: str, seconds: float) -> None:
    assert duration_arg(text) == seconds


@pytest.mark.parametrize("text", ["-1", "0", "nan", "inf", "abc", "5x", ""])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        duration_arg(text)


# --- against the fake controller ---------------------------------------------------------------


class ScriptedClock(FakeClock):
    """A fake clock whose every sleep first runs the next scripted change (then nothing)."""

    def __init__(self, steps: list[Callable[[], None]]) -> None:
        super().__init__()
        self.steps = list(steps)
        self.sleeps = 0

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        if self.steps:
            self.steps.pop(0)()
        super().sleep(seconds)


@pytest.fixture(scope="module")
def controller() -> Iterator[FakeController]:
    ctl = FakeController()
    yield ctl
    ctl.stop()


@pytest.fixture
def svc(controller: FakeController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeService:
    monkeypatch.setenv("TRAINGUARD_URL", controller.url)
    monkeypatch.setenv("TRAINGUARD_TOKEN", "op-token")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    s = controller.service
    s.nodes.clear()
    s.incidents.clear()
    s.jobs.clear()
    s.silences.clear()
    s.add_node("node-1", labels={"rack": "r1", "gpu": "h100"}, job="llama")
    s.add_node("node-2", labels={"rack": "r2", "gpu": "h100"}, job="llama")
    s.add_node("node-3", role="spare", labels={"rack": "r1", "gpu": "a100"})
    s.add_job("llama", nodes=("node-1", "node-2"), attempt=2, last_step=500, ckpt_step=400)
    s.add_job("bert", state="stopped", nodes=("node-3",), attempt=1)
    return s


def run(*argv: str, clock: FakeClock | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err, clock=clock or FakeClock())
    return code, out.getvalue(), err.getvalue()


def test_get_nodes_name_prints_one_row(svc: FakeService) -> None:
    code, out, _ = run("get", "nodes", "node-2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[0] == "NAME"
    assert [line.split()[0] for line in lines[1:]] == ["node-2"]


def test_get_one_unknown_name_is_not_found(svc: FakeService) -> None:
    code, _, err = run("get", "nodes", "node-9")
    assert code == 3
    assert err.startswith("error: 404")


def test_get_jobs_name_and_incident_id(svc: FakeService) -> None:
    assert run("get", "jobs", "llama", "-o", "name")[1] == "job/llama\n"
    svc.add_incident(id=42, node="node-1")
    code, out, _ = run("get", "incidents", "42", "--no-headers")
    assert code == 0
    assert out.split()[0] == "42"
    code, _, err = run("get", "incidents", "abc")
    assert code == 2
    assert "incident id must be a number" in err


def test_label_selector_filters_nodes(svc: FakeService) -> None:
    assert run("get", "nodes", "-l", "rack=r1", "-o", "name")[1] == "node/node-1\nnode/node-3\n"
    out = run("get", "no", "--selector", "rack=r1,gpu!=a100", "-o", "name")[1]
    assert out == "node/node-1\n"
    assert run("get", "nodes", "-l", "rack=r9", "--no-headers")[1] == ""


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["get", "nodes", "--node", "node-1"], "--node does not apply to nodes"),
        (["get", "jobs", "-l", "a=b"], "-l does not apply to jobs"),
        (["get", "audit", "--state", "open"], "--state does not apply to audit"),
        (["get", "nodes", "--limit", "3"], "--limit does not apply to nodes"),
        (["get", "jobs", "--all"], "--all does not apply to jobs"),
        (["get", "nodes", "--state", "open"], "--state: nodes have no state 'open'"),
        (["get", "nodes", "node-1", "-l", "a=b"], "-l filters a list"),
        (["get", "silences", "7"], "get silences takes no NAME"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_filter_that_does_not_apply_is_a_usage_error(
    svc: FakeService, argv: list[str], named: str
) -> None:
    code, out, err = run(*argv)
    assert code == 2
    assert named in err
    assert out == ""


def test_state_and_node_filter_jobs(svc: FakeService) -> None:
    assert run("get", "jobs", "--state", "stopped", "-o", "name")[1] == "job/bert\n"
    assert run("get", "jobs", "--node", "node-2", "-o", "name")[1] == "job/llama\n"
    assert run("get", "nodes", "--state", "drained", "--no-headers")[1] == ""


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--timeout", "-1", "get", "nodes"], "argument --timeout"),
        (["--timeout", "nan", "get", "nodes"], "argument --timeout"),
        (["get", "nodes", "--timeout", "0s"], "argument --timeout"),
        (["get", "jobs", "--limit", "0"], "argument --limit"),
        (["-o", "jsonpath={.items[", "get", "nodes"], "argument -o/--output"),
        (["get", "nodes", "-o", "xml"], "argument -o/--output"),
        (["get", "nodes", "-l", "rack"], "argument -l/--selector"),
        (["inject", "node-1", "dbe", "--gpu", "-2"], "argument --gpu"),
        (["inject", "node-1", "ecc_storm", "--rate-per-s", "inf"], "argument --rate-per-s"),
        (["inject", "node-1", "thermal", "--for", "soon"], "argument --for"),
        (["drain", "node-1", "--wait", "--timeout", "-5m"], "argument --timeout"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_invalid_flag_values_are_usage_errors_naming_the_flag(
    svc: FakeService, argv: list[str], flag: str
) -> None:
    code, _, err = run(*argv)
    assert code == 2
    assert flag in err
    assert "Traceback" not in err


def test_output_formats_of_a_list(svc: FakeService) -> None:
    svc.add_incident(id=42, node="node-1")
    assert run("get", "nodes", "-o", "jsonpath={.items[*].name}")[1] == "node-1 node-2 node-3"
    assert run("get", "jobs", "-o", "jsonpath={.items[0].state}")[1] == "stopped"
    assert run("get", "nodes", "node-1", "-o", "jsonpath={.labels.rack}")[1] == "r1"
    lines = run("get", "nodes", "--no-headers")[1].splitlines()
    assert [line.split()[0] for line in lines] == ["node-1", "node-2", "node-3"]
    assert json.loads(run("get", "nodes", "node-1", "-o", "json")[1])["name"] == "node-1"
    assert run("get", "inc", "42", "-o", "name")[1] == "incident/42\n"


def test_output_formats_of_one_object_and_of_answers(svc: FakeService) -> None:
    assert run("describe", "node", "node-1", "-o", "jsonpath={.name}")[1] == "node-1"
    assert run("drain", "node-2", "-o", "name")[1] == "node/node-2\n"
    code, out, _ = run("-o", "json", "rules", "check")
    assert code == 0
    assert json.loads(out)["rules"] > 0
    assert json.loads(run("-o", "json", "rules", "reload")[1]) == {"rules": 3}
    code, _, err = run("-o", "name", "rules", "reload")
    assert code == 2
    assert "-o name" in err
    for argv in (["rules", "export"], ["completion", "bash"], ["token", "hash"]):
        code, out, err = run("-o", "json", *argv)
        assert (code, out) == (2, ""), argv
        assert "takes no -o" in err


def test_inject_takes_the_same_flags_as_the_agents_inject(svc: FakeService) -> None:
    code, out, _ = run("inject", "node-1", "nvml_hang", "--for", "30s", "-o", "name")
    assert code == 0
    assert out.startswith("command/")
    code, _, _ = run("inject", "node-1", "ecc_storm", "--gpu", "1", "--rate-per-s", "200")
    assert code == 0
    specs = [c.args[1] for c in svc.calls if c.method == "inject_fault"]
    assert (specs[0].kind, specs[0].duration_s) == ("nvml_hang", 30.0)
    assert (specs[1].gpu, specs[1].rate_per_s) == (1, 200.0)


def test_watch_prints_again_only_when_the_result_changes(svc: FakeService) -> None:
    def step() -> None:
        svc.jobs["llama"] = replace(svc.jobs["llama"], state="restarting")

    def clock_only() -> None:
        svc.jobs["llama"] = replace(svc.jobs["llama"], ckpt_age_s=99.0, ettr=0.5)

    clock = ScriptedClock([clock_only, step, clock_only])
    code, out, _ = run(
        "get", "jobs", "llama", "-o", "jsonpath={.state}{\"\\n\"}", "-w",
        "--watch-limit", "4", clock=clock,
    )  # fmt: skip
    assert code == 0
    assert out == "running\nrestarting\n"
    assert clock.sleeps == 3


def test_watch_ends_cleanly_on_ctrl_c(svc: FakeService) -> None:
    def interrupt() -> None:
        raise KeyboardInterrupt

    code, out, err = run("get", "nodes", "--watch", clock=ScriptedClock([interrupt]))
    assert code == 130
    assert out.splitlines()[0].split()[0] == "NAME"
    assert "Traceback" not in err


def test_drain_wait_ends_when_drained_and_names_how_its_job_moves(svc: FakeService) -> None:
    code, out, err = run("drain", "node-2", "--wait", clock=ScriptedClock([]))
    assert (code, err) == (0, "")
    assert out.splitlines()[-2:] == [
        "node/node-2 drained",
        "job/llama ran on node/node-2: `agentctl restart llama --wait` moves it to a spare",
    ]


def test_restart_wait_prints_a_line_per_step_to_the_first_step(svc: FakeService) -> None:
    job = svc.jobs["llama"]
    # the restart moves on at each poll
    changes = [
        lambda: svc.jobs.update(llama=replace(job, state="restarting", state_reason="operator")),
        lambda: svc.jobs.update(
            llama=replace(job, state="restarting", nodes=("node-1", "node-3"))
        ),
        lambda: svc.jobs.update(llama=replace(job, state="starting", nodes=("node-1", "node-3"),
                                              attempt=3)),
        lambda: svc.jobs.update(llama=replace(job, state="running", nodes=("node-1", "node-3"),
                                              attempt=3, last_step=401)),
    ]  # fmt: skip
    code, out, err = run("restart", "llama", "--wait", clock=ScriptedClock(changes))
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "restart of job llama: step #1 running",
        "job/llama running",
        "job/llama restarting: operator",
        "job/llama spare in: node-3 for node-2",
        "job/llama restarted: attempt 3 on node-1,node-3",
        "job/llama first step: attempt 3 at step 401",
    ]


def test_restart_wait_fails_when_the_job_fails(svc: FakeService) -> None:
    job = svc.jobs["llama"]
    changes = [lambda: svc.jobs.update(llama=replace(job, state="failed", state_reason="no spare"))]
    code, out, err = run("restart", "llama", "--wait", clock=ScriptedClock(changes))
    assert code == 1
    assert err == "error: job/llama failed: no spare\n"
    assert out.startswith("restart of job llama: step #1 running\n")


def test_restart_wait_times_out(svc: FakeService) -> None:
    code, _, err = run("restart", "llama", "--wait", "--timeout", "5s", clock=ScriptedClock([]))
    assert code == 1
    assert err == "error: timed out after 5s waiting for job/llama to train on attempt 3 or later\n"


def test_submit_wait_until_the_first_step(svc: FakeService, tmp_path: Path) -> None:
    spec = tmp_path / "gpt.yaml"
    spec.write_text("name: gpt\nnodes: [node-3]\nnproc_per_node: 8\ncommand: [python, t.py]\n")

    def runs() -> None:
        svc.jobs["gpt"] = replace(svc.jobs["gpt"], state="running", last_step=1)

    code, out, err = run(
        "job", "submit", str(spec), "--wait", "-o", "name", clock=ScriptedClock([runs])
    )
    assert code == 0, err
    assert out == "job/gpt\n"  # progress goes to stderr under a machine-readable -o
    assert err.splitlines() == [
        "job/gpt started: attempt 1 on node-3",
        "job/gpt first step: attempt 1 at step 1",
    ]


def test_checkpoint_wait_until_a_newer_commit_or_a_failed_save(svc: FakeService) -> None:
    job = svc.jobs["llama"]
    commit = [lambda: svc.jobs.update(llama=replace(job, ckpt_step=520))]
    code, out, _ = run("checkpoint", "llama", "--wait", clock=ScriptedClock(commit))
    assert code == 0
    assert out.splitlines()[-1] == "job/llama checkpoint committed at step 520"
    svc.jobs["llama"] = job
    failed = [lambda: svc.jobs.update(llama=replace(job, ckpt_failures=1))]
    code, _, err = run("checkpoint", "llama", "--wait", clock=ScriptedClock(failed))
    assert code == 1
    assert "the trainer reported the checkpoint failed" in err


def test_drain_wait_of_a_node_without_a_running_job_ends_when_drained(svc: FakeService) -> None:
    code, out, _ = run("drain", "node-3", "--wait", "-o", "name", clock=ScriptedClock([]))
    assert (code, out) == (0, "node/node-3\n")
    svc.nodes["node-3"] = replace(svc.nodes["node-3"], job="bert")  # bert is stopped: no hint
    code, _, err = run("drain", "node-3", "--wait", "-o", "name", clock=ScriptedClock([]))
    assert (code, err) == (0, "node/node-3 drained\n")


def test_drain_wait_fails_when_the_node_is_undrained_meanwhile(
    svc: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def undrained() -> None:
        svc.nodes["node-3"] = replace(svc.nodes["node-3"], state="active")

    monkeypatch.setattr(svc, "drain", lambda name, **kw: svc.nodes[name])
    svc.nodes["node-3"] = replace(svc.nodes["node-3"], state="draining")
    code, out, err = run("drain", "node-3", "--wait", clock=ScriptedClock([undrained]))
    assert code == 1
    assert "node/node-3 draining" in out
    assert err == "error: node/node-3 is active again: the drain was undone\n"
