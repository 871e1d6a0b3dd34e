"""Reading examples/train.py step lines out of a job log that stdout and stderr share."""

from __future__ import annotations

from pathlib import Path

from trainguard.devkit.devcluster import read_step_lines


def test_step_lines_survive_output_of_other_threads_and_kills(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(
        "2026-11-22 07:45:14,000 INFO event=trainer_start job=demo rank=0\n"
        '{"step": 1, "loss": 2.5}\n'
        # a log line from another thread landed before the step line's newline
        '{"step": 2, "loss": 2.4}2026-11-22 07:45:14,875 INFO event=snapshot_prepared\n'
        '{"step": 3, "loss": "NaN", "action": "stop"}\n'
        '{"step": 4, "lo\n'  # cut short by SIGKILL
        '{"stepx": 5}\n'
    )
    assert read_step_lines(log) == [
        {"step": 1, "loss": 2.5},
        {"step": 2, "loss": 2.4},
        {"step": 3, "loss": "NaN", "action": "stop"},
    ]


def test_a_missing_log_has_no_step_lines(tmp_path: Path) -> None:
    assert read_step_lines(tmp_path / "absent.log") == []
