"""The job commands: job submit|stop, checkpoint and restart."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO, Any

from trainguard.controller.cli.client import Api, quote_name
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.format import print_result
from trainguard.strict import ConfigError, load_yaml

__all__ = ["add_job_commands", "job_step", "submit"]


def add_job_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """job submit|stop, checkpoint and restart."""
    job = add_command(
        sub, "job", "Submit or stop a training job.", "agentctl job submit llama.yaml"
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
    jstop = add_command(
        jsub, "stop", "Stop a job on all its nodes.", "agentctl job stop llama", parents=parents
    )
    jstop.add_argument("job")
    for verb, text in (
        ("checkpoint", "Ask a job's ranks for a checkpoint now."),
        ("restart", "Restart a job from its latest committed checkpoint."),
    ):
        verb_parser = add_command(sub, verb, text, f"agentctl {verb} llama", parents=parents)
        verb_parser.add_argument("job")


def submit(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    try:
        spec = load_yaml(Path(args.file))
    except ConfigError as e:
        raise CliError(f"error: {e}", EXIT["usage"]) from None
    if not isinstance(spec, dict):
        raise CliError(f"error: {args.file}: a job spec must be a mapping", EXIT["usage"])
    print_result(out, args, "job", api.request("POST", "/v1/jobs", json=spec))


def job_step(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    """checkpoint, restart or job stop: an audited action step on the job."""
    verb = "stop" if args.command == "job" else args.command
    data = api.request("POST", f"/v1/jobs/{quote_name(args.job)}/{verb}")
    if args.output in ("json", "yaml"):
        print_result(out, args, "action", data)
    else:
        out.write(f"{verb} of job {args.job}: step #{data['id']} {data['state']}\n")
