"""agentctl against several controllers (HA): the fake controller answering as a standby
does (writes 503 naming the leader, reads served) next to one that leads."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import free_port
from trainguard.controller.cli import main


@pytest.fixture
def pair() -> Iterator[tuple[FakeController, FakeController]]:
    """(standby, leader), each with node-12; the standby names the leader."""
    leader = FakeController()
    standby = FakeController()
    standby.standby_of = leader.url
    for ctl in (standby, leader):
        ctl.service.add_node("node-12", gpus=8)
    yield standby, leader
    standby.stop()
    leader.stop()


@pytest.fixture(autouse=True)
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINGUARD_URL", raising=False)
    monkeypatch.setenv("TRAINGUARD_TOKEN", "op-token")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there now


def drains(ctl: FakeController) -> list[tuple[object, ...]]:
    return [c.args for c in ctl.service.calls if c.method == "drain"]


def test_a_drain_against_standby_then_leader_lands_on_the_leader(
    pair: tuple[FakeController, FakeController],
) -> None:
    standby, leader = pair
    code, out, err = run("--url", f"{standby.url},{leader.url}", "drain", "node-12")
    assert code == 0, err
    assert "drained" in out
    assert drains(leader) == [("node-12",)] and drains(standby) == []
    assert [(r.method, r.status) for r in standby.requests] == [("POST", 503)]
    assert leader.service.nodes["node-12"].state == "drained"


def test_the_url_list_comes_from_the_environment_and_the_config_file(
    pair: tuple[FakeController, FakeController],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    standby, leader = pair
    monkeypatch.setenv("TRAINGUARD_URL", f"{standby.url}, {leader.url}")
    assert run("undrain", "node-12")[0] == 0
    monkeypatch.delenv("TRAINGUARD_URL")
    cfg = tmp_path / "agentctl.yaml"
    cfg.write_text(f"urls: [{standby.url}, {leader.url}]\n")
    assert run("--config", str(cfg), "drain", "node-12")[0] == 0
    cfg.write_text(f"url: {standby.url},{leader.url}\n")
    assert run("--config", str(cfg), "undrain", "node-12")[0] == 0
    assert [c.method for c in leader.service.calls if c.method.endswith("drain")] == [
        "undrain",
        "drain",
        "undrain",
    ]
    assert not [c for c in standby.service.calls if c.method.endswith("drain")]


def test_reads_are_served_by_a_standby(pair: tuple[FakeController, FakeController]) -> None:
    standby, leader = pair
    code, out, err = run("--url", f"{standby.url},{leader.url}", "get", "nodes", "-o", "json")
    assert code == 0, err
    assert [n["name"] for n in json.loads(out)] == ["node-12"]
    assert [(r.method, r.status) for r in standby.requests] == [("GET", 200)]
    assert leader.requests == []


def test_a_dead_first_url_is_skipped_for_reads_and_writes(
    pair: tuple[FakeController, FakeController],
) -> None:
    standby, leader = pair
    urls = f"{dead_url()},{standby.url},{leader.url}"
    assert run("--url", urls, "get", "nodes")[0] == 0
    assert run("--url", urls, "drain", "node-12")[0] == 0
    assert drains(leader) == [("node-12",)]


def test_every_url_dead_is_a_connect_error_naming_each() -> None:
    a, b = dead_url(), dead_url()
    code, _, err = run("--url", f"{a},{b}", "drain", "node-12")
    assert code == 5
    assert err.startswith("error: cannot connect to any controller")
    assert a in err and b in err


def test_a_leader_outside_the_list_is_named_and_not_contacted(
    pair: tuple[FakeController, FakeController],
) -> None:
    standby, leader = pair
    code, _, err = run("--url", standby.url, "drain", "node-12")
    assert code == 1
    assert f"the leader is {leader.url}, which is not one of the controller URLs" in err
    assert "add it to --url" in err
    assert leader.requests == []


def test_two_standbys_naming_each_other_retry_once_then_fail_clearly() -> None:
    a, b = FakeController(), FakeController()
    a.standby_of, b.standby_of = b.url, a.url
    try:
        code, _, err = run("--url", f"{a.url},{b.url}", "drain", "node-12")
        assert code == 1
        assert f"{b.url} does not lead; it names {a.url} as the leader" in err
        assert (len(a.requests), len(b.requests)) == (1, 1)
    finally:
        a.stop()
        b.stop()


def test_no_leader_known_tries_the_next_url_then_says_retry() -> None:
    a, b = FakeController(), FakeController()
    a.standby_of = b.standby_of = ""
    try:
        code, _, err = run("--url", f"{a.url},{b.url}", "drain", "node-12")
        assert code == 1
        assert err.startswith("error: 503 no controller leads now")
        assert a.url in err and b.url in err
        assert (len(a.requests), len(b.requests)) == (1, 1)
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("http://a,", "--url[1]: must start with http://"),
        ("http://a,http://A:80/", "--url[1]: names the same controller as entry 0"),
    ],
    ids=["stray-comma", "same-controller-twice"],
)
def test_a_bad_url_list_is_a_usage_error_naming_the_entry(value: str, reason: str) -> None:
    code, _, err = run("--url", value, "get", "nodes")
    assert code == 2
    assert reason in err


def test_url_and_urls_together_in_the_config_file_is_a_usage_error(tmp_path: Path) -> None:
    cfg = tmp_path / "agentctl.yaml"
    cfg.write_text("url: http://a\nurls: [http://b]\n")
    code, _, err = run("--config", str(cfg), "get", "nodes")
    assert code == 2
    assert "urls: set url or urls, not both" in err
