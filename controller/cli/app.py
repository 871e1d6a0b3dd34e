"""agentctl's entry: parse the arguments, settle where to connect, run the command, turn its
error into an exit code."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import IO

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.controller.cli import jobs, lifecycle, nodes, reads, rules, silences, tokens
from trainguard.controller.cli.client import REQUEST_TIMEOUT_S, Api
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.parser import COMMAND_OF, build_parser
from trainguard.controller.cli.session import Session
from trainguard.controller.cli.settings import settings_of
from trainguard.controller.completion import completion_script

__all__ = ["main"]

# a command that calls the controller, by its path (command, then subcommand) -> what runs it
Handler = Callable[[Session, argparse.Namespace], None]
API_COMMANDS: dict[tuple[str, ...], Handler] = {
    ("get",): reads.get,
    ("describe",): reads.describe,
    ("drain",): nodes.drain,
    ("undrain",): nodes.undrain,
    ("spares",): nodes.spares,
    ("role",): nodes.role,
    ("inject",): nodes.inject,
    ("silence",): silences.silence,
    ("unsilence",): silences.unsilence,
    ("job", "submit"): jobs.submit,
    ("job", "stop"): jobs.job_step,
    ("checkpoint",): jobs.job_step,
    ("restart",): jobs.job_step,
    ("rules", "reload"): rules.reload,
    ("node", "return"): lifecycle.node_return,
    ("node", "retire"): lifecycle.node_retire,
}


# commands whose output has one form, and what it is: `-o` other than the default is refused
TEXT_ONLY = {"token": "a token and its tokens-file line", "completion": "a shell script"}


def command_path(args: argparse.Namespace) -> tuple[str, ...]:
    """The command and, for a group, its subcommand: ("get",), ("job", "submit")."""
    if args.command == "job":
        return ("job", args.job_command)
    if args.command == "rules":
        return ("rules", args.rules_command)
    if args.command == "node":
        return ("node", args.node_command)
    return (args.command,)


def _run_api(args: argparse.Namespace, out: IO[str], err: IO[str], clock: Clock) -> None:
    settings = settings_of(args, err)
    # --timeout bounds each request; with --wait it bounds the whole wait, each request
    # within it keeping the usual bound
    timeout_s = REQUEST_TIMEOUT_S if args.timeout is None else args.timeout
    if vars(args).get("wait", False):
        timeout_s = min(timeout_s, REQUEST_TIMEOUT_S)
    api = Api(settings.urls, settings.token, timeout_s=timeout_s, ca_file=settings.ca_file)
    API_COMMANDS[command_path(args)](Session(api=api, out=out, err=err, clock=clock), args)


def main(
    argv: Sequence[str] | None = None,
    *,
    stdin: IO[str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> int:
    """Run agentctl; returns the exit code (see EXIT; Ctrl-C: 130, as a shell reports it)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = build_parser()
    try:
        # argparse prints --help, --version and usage errors itself: to our streams
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else EXIT["usage"]
    args.command = COMMAND_OF.get(args.command, args.command)
    try:
        if args.command in TEXT_ONLY and args.output != "table":
            raise CliError(
                f"error: -o: {args.command} prints {TEXT_ONLY[args.command]}; it takes no -o",
                EXIT["usage"],
            )
        if args.command == "token":
            if args.token_command == "issue":  # noqa: S105 (a subcommand's name)
                tokens.token_issue(args, out, err)
            else:
                tokens.token_hash(stdin or sys.stdin, out)
        elif args.command == "completion":
            out.write(completion_script(parser, shell=args.shell))
        elif args.command == "rules" and args.rules_command in ("check", "export"):
            rules.rules_offline(args, out, err)
        else:
            _run_api(args, out, err, clock)
    except CliError as e:
        err.write(f"{e}\n")
        return e.code
    except BrokenPipeError:
        return EXIT["ok"]
    except KeyboardInterrupt:
        # Ctrl-C ends --watch and --wait: no traceback, the shell's code for SIGINT
        return EXIT["interrupted"]
    return EXIT["ok"]


if __name__ == "__main__":
    sys.exit(main())
