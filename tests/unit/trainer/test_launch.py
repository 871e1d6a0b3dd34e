"""A distributed launch without a process group is refused, not run as N single processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainguard.trainer import LaunchMismatch, Trainguard
from trainguard.trainer.launch import check_launch


def test_trainguard_before_init_process_group_in_a_torchrun_launch_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(LaunchMismatch, match=r"init_process_group\(\)") as e:
        Trainguard(model=torch.nn.Linear(2, 2), ckpt_dir=tmp_path, handle_sigterm=False)
    assert "rank 1" in str(e.value) and "WORLD_SIZE=2" in str(e.value)
    assert not any(tmp_path.iterdir()), "nothing was written before the refusal"


def test_single_process_opt_out_runs_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    tg = Trainguard(
        model=torch.nn.Linear(2, 2), ckpt_dir=tmp_path, handle_sigterm=False, single_process=True
    )
    assert tg.world_size == 1
    tg.close()


@pytest.mark.parametrize(
    ("env", "initialized", "single", "refused"),
    [
        ({}, False, False, False),
        ({"WORLD_SIZE": "1"}, False, False, False),
        ({"WORLD_SIZE": "4"}, True, False, False),
        ({"WORLD_SIZE": "4"}, False, True, False),
        ({"WORLD_SIZE": "4"}, False, False, True),
        ({"WORLD_SIZE": "four"}, False, False, True),
    ],
    ids=["no-launcher", "world-1", "process-group", "opt-out", "missing-group", "bad-value"],
)
def test_check_launch(env: dict[str, str], initialized: bool, single: bool, refused: bool) -> None:
    if refused:
        with pytest.raises(LaunchMismatch):
            check_launch(initialized=initialized, single_process=single, env=env)
    else:
        check_launch(initialized=initialized, single_process=single, env=env)
