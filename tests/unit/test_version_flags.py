"""`--version` on every console script prints `<prog> <version>` from `trainguard.__version__`."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest

from trainguard import __version__
from trainguard.agent.main import main as agent_main
from trainguard.controller.cli import main as agentctl_main
from trainguard.controller.main import main as controller_main


def _agentctl(argv: list[str]) -> int:
    out = io.StringIO()
    code = agentctl_main(argv, stdout=out)
    print(out.getvalue(), end="")
    return code


@pytest.mark.parametrize(
    ("prog", "main"),
    [
        pytest.param("trainguard-agent", agent_main, id="agent"),
        pytest.param("trainguard-controller", controller_main, id="controller"),
        pytest.param("agentctl", _agentctl, id="agentctl"),
    ],
)
def test_version_prints_prog_and_package_version(
    prog: str, main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["--version"])
    except SystemExit as e:  # argparse's version action exits
        code = e.code  # type: ignore[assignment]
    assert code == 0
    assert capsys.readouterr().out == f"{prog} {__version__}\n"
