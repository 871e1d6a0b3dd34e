"""The flags of a simulated fault are the same for `agentctl inject` and
`trainguard-agent inject` (trainguard.faultflags), and make the same FaultSpec body."""

from __future__ import annotations

import argparse
from typing import get_args

import pytest

from trainguard.agent.main import _inject_parser
from trainguard.controller.cli.parser import build_parser
from trainguard.faultflags import FAULT_KINDS, fault_body
from trainguard.protocol import FaultKind, FaultSpec

ARGV = ["thermal", "--gpu", "6", "--for", "1m", "--rate-per-s", "20", "--code", "79"]


FLAGS = {"--gpu", "--link", "--device", "--port", "--code", "--rate-per-s", "--for"}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _agentctl_inject() -> argparse.ArgumentParser:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["inject"]
    return parser


def test_both_inject_commands_take_the_same_fault_flags() -> None:
    agent, agentctl = _options(_inject_parser()), _options(_agentctl_inject())
    assert FLAGS <= agent
    assert FLAGS <= agentctl
    assert not {"--rate", "--duration-s"} & (agent | agentctl)


def test_both_make_the_same_fault_spec_body() -> None:
    agent = fault_body(_inject_parser().parse_args(ARGV))
    agentctl = fault_body(_agentctl_inject().parse_args(["node-1", *ARGV]))
    assert (
        agent
        == agentctl
        == {
            "kind": "thermal",
            "gpu": 6,
            "duration_s": 60.0,
            "rate_per_s": 20.0,
            "code": 79,
        }
    )
    FaultSpec(**agent)


def test_every_fault_kind_of_the_wire_is_offered() -> None:
    assert FAULT_KINDS == get_args(FaultKind)
    assert "nvml_hang" in FAULT_KINDS


@pytest.mark.parametrize("argv", [["dbe", "--gpu", "-1"], ["thermal", "--for", "-5s"]])
def test_bad_fault_values_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _inject_parser().parse_args(argv)
    assert e.value.code == 2
