"""The job commands: job submit|stop, checkpoint and restart."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from trainguard.controller.cli.client import quote_name
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.session import Session
from trainguard.controller.cli.wait import (
    CheckpointTracker,
    JobTracker,
    Tracker,
    add_wait_argument,
    progress_stream,
    wait_for,
    wait_timeout_s,
)
from trainguard.strict import ConfigError, load_yaml

__all__ = ["add_job_commands", "job_step", "submit"]


def add_job_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """job submit|stop, checkpoint and restart."""
    job = add_command(
        sub,
        "job",
        "Submit or stop a training job (job submit|stop).",
        "agentctl job submit llama.yaml",
    )
    jsub = job.add_subparsers(dest="job_command", required=True, metavar="SUBCOMMAND")
    submit = add_command(
        jsub,
        "submit",
        "Submit a job spec (YAML, see docs/jobs.md); prints the job.",
        "agentctl job submit llama.yaml",
        parents=parents,
    )
    submit.add_argument("file")
    add_wait_argument(submit, "until the job's first attempt trains (its first step)")
    jstop = add_command(
        jsub, "stop", "Stop a job on all its nodes.", "agentctl job stop llama", parents=parents
    )
    jstop.add_argument("job")
    for verb, text, until in (
        ("checkpoint", "Ask a job's ranks for a checkpoint now.", "until the checkpoint commits"),
        (
            "restart",
            "Restart a job from its latest committed checkpoint.",
            "until the next attempt trains (its first step)",
        ),
    ):
        verb_parser = add_command(
            sub,
            verb,
            text,
            f"agentctl {verb} llama",
            f"agentctl {verb} llama --wait --timeout 10m",
            parents=parents,
        )
        verb_parser.add_argument("job")
        add_wait_argument(verb_parser, until)


def submit(s: Session, args: argparse.Namespace) -> None:
    try:
        spec = load_yaml(Path(args.file))
    except ConfigError as e:
        raise CliError(f"error: {e}", EXIT["usage"]) from None
    if not isinstance(spec, dict):
        raise CliError(f"error: {args.file}: a job spec must be a mapping", EXIT["usage"])
    data = s.api.request("POST", "/v1/jobs", json=spec)
    s.show(args, "job", data)
    if args.wait:
        tracker = JobTracker(data["name"], min_attempt=max(1, int(data["attempt"])), verb="started")
        wait_for(s, [tracker], timeout_s=wait_timeout_s(args), out=progress_stream(s, args))


def job_step(s: Session, args: argparse.Namespace) -> None:
    """checkpoint, restart or job stop: an audited action step on the job."""
    verb = "stop" if args.command == "job" else args.command
    wait = verb != "stop" and args.wait
    path = f"/v1/jobs/{quote_name(args.job)}"
    before = s.api.request("GET", path) if wait else None
    data = s.api.request("POST", f"{path}/{verb}")
    if args.output in ("table", "wide"):
        s.out.write(f"{verb} of job {args.job}: step #{data['id']} {data['state']}\n")
    else:
        s.show(args, "action", data)
    if before is None:
        return
    tracker: Tracker
    if verb == "checkpoint":
        tracker = CheckpointTracker(
            args.job,
            before=before.get("ckpt_step"),
            failures_before=int(before.get("ckpt_failures") or 0),
        )
    else:
        tracker = JobTracker(
            args.job, min_attempt=int(before["attempt"]) + 1, nodes=tuple(before["nodes"])
        )
    wait_for(s, [tracker], timeout_s=wait_timeout_s(args), out=progress_stream(s, args))
