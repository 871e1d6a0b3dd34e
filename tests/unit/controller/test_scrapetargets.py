"""`trainguard-controller targets HOSTS --port P`: a Prometheus file_sd JSON file for a
hostlist, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.controller.main import main


def test_a_hostlist_becomes_one_target_group_with_its_labels(tmp_path: Path) -> None:
    out = tmp_path / "agents.json"
    argv = ["targets", "node-[01-03],gpu7", "--port", "9500", "--label", "rack=r01"]
    assert main([*argv, "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == [
        {
            "targets": ["node-01:9500", "node-02:9500", "node-03:9500", "gpu7:9500"],
            "labels": {"rack": "r01"},
        }
    ]
    assert out.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["agents.json"]  # no temporary file left


def test_without_out_it_prints_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["targets", "ctl-a", "--port", "8800"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"targets": ["ctl-a:8800"]}]


@pytest.mark.parametrize(
    "argv",
    [
        ["node-[01-03", "--port", "9500"],
        ["node-1", "--port", "0"],
        ["node-1", "--port", "9500", "--label", "no-equals"],
        ["node-1"],
    ],
    ids=["bad-hostlist", "bad-port", "bad-label", "no-port"],
)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["targets", *argv])
    assert stopped.value.code == 2
