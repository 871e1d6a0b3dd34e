"""The launch wrapper: runs one launch's command as its child and records how it ended.

    python -I -m trainguard.agent.jobwrap --status FILE [--env-file FILE] [--cwd DIR]
        [--uid N --gid N --groups G,G] -- ARGV...

The agent starts every job through it, so the job's exit status survives the agent: a
restarted agent is not torchrun's parent and cannot `waitpid` it, but it reads FILE, which
this wrapper replaces atomically once the command has ended (`{"exit_code": N, ...}`,
negative N = killed by that signal). The wrapper is a child subreaper: workers orphaned by a
launcher that died (kill -9, the OOM killer) are re-parented to it, and it SIGKILLs them
before it writes the status, so a launch ends with its launcher, agent or no agent.

It never forwards signals: a stop is delivered to the whole launch (its process group and
the workers, or the systemd unit's cgroup), so forwarding would hand torchrun a second
SIGTERM. SIGTERM, SIGINT and SIGHUP aimed at the wrapper alone are ignored; it ends when its
command ends. Standard library only (it starts in every launch; the agent's venv is all it
needs), and no import of the rest of trainguard.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["WRAPPER_MODULE", "exit_code_of", "main", "wrapper_argv"]

WRAPPER_MODULE = "trainguard.agent.jobwrap"
_PR_SET_CHILD_SUBREAPER = 36
# After the command ended: how long leftovers (orphaned workers) may take to die of SIGKILL.
_LEFTOVERS_WAIT_S = 10.0
# The command could not be started (missing interpreter, setuid refused): like a shell's 127.
LAUNCH_FAILED_CODE = 127


def wrapper_argv(
    *,
    python: str,
    status_path: str,
    argv: Sequence[str],
    env_file: str | None = None,
    cwd: str | None = None,
    uid: int | None = None,
    gid: int | None = None,
    groups: Sequence[int] = (),
) -> list[str]:
    """The argument list that runs `argv` under the wrapper (never a shell string).

    `-I`: the job's environment (PYTHONPATH, a user site) never reaches the wrapper's own
    interpreter, which runs with the agent's credentials."""
    out = [python, "-I", "-m", WRAPPER_MODULE, "--status", status_path]
    if env_file is not None:
        out += ["--env-file", env_file]
    if cwd is not None:
        out += ["--cwd", cwd]
    if uid is not None:
        out += ["--uid", str(uid)]
    if gid is not None:
        out += ["--gid", str(gid)]
    if groups:
        out += ["--groups", ",".join(str(g) for g in groups)]
    return [*out, "--", *argv]


def exit_code_of(status: int) -> int:
    """A `waitpid` status as Popen reports it: the exit code, or -N for signal N."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _ignore(_signum: int, _frame: Any) -> None:
    """A handler, not SIG_IGN: an ignored disposition would be inherited across exec."""


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _children(proc_root: str = "/proc") -> list[int]:
    """Live (non-zombie) children of this process, from /proc."""
    me = os.getpid()
    out = []
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc_root}/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 2 and fields[0] not in (b"Z", b"X") and int(fields[1]) == me:
            out.append(int(name))
    return out


def _reap_all() -> None:
    """Reap every exited child (orphans re-parented to this subreaper included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_leftovers() -> int:
    """SIGKILL every remaining descendant (re-parented to us as they are orphaned) until none
    is left or the bound passes; returns how many were signalled."""
    killed: set[int] = set()
    deadline = time.monotonic() + _LEFTOVERS_WAIT_S
    while time.monotonic() < deadline:
        _reap_all()
        left = _children()
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.02)
    _reap_all()
    return len(killed)


def write_status(path: str, status: dict[str, Any]) -> None:
    """Replace `path` atomically (temporary file, fsync, rename, fsync of the directory)."""
    directory = os.path.dirname(path) or "."
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(status, sort_keys=True).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainguard.agent.jobwrap")
    p.add_argument("--status", required=True, help="where the exit status is written")
    p.add_argument("--env-file", help="JSON object: the command's environment (then removed)")
    p.add_argument("--cwd", help="the command's working directory")
    p.add_argument("--uid", type=int, help="run the command as this user id")
    p.add_argument("--gid", type=int, help="... with this primary group")
    p.add_argument("--groups", default="", help="... and these supplementary groups (G,G)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no command after --")
    return args


def _read_env(path: str) -> dict[str, str]:
    with open(path, encoding="utf-8") as f:
        env = json.load(f)
    # it may hold the job's secrets: gone as soon as it has been read
    with contextlib.suppress(OSError):
        os.unlink(path)
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError(f"{path}: not a JSON object of strings")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _ignore)
    subreaper = _become_subreaper()
    status: dict[str, Any] = {"wrapper_pid": os.getpid(), "subreaper": subreaper}
    kwargs: dict[str, Any] = {}
    if args.uid is not None:
        kwargs["user"] = args.uid
    if args.gid is not None:
        kwargs["group"] = args.gid
    if args.groups:
        kwargs["extra_groups"] = [int(g) for g in args.groups.split(",")]
    try:
        env = _read_env(args.env_file) if args.env_file else dict(os.environ)
        child = subprocess.Popen(
            args.command, stdin=subprocess.DEVNULL, cwd=args.cwd, env=env, **kwargs
        )
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        print(
            f"trainguard jobwrap: cannot launch {args.command[0]!r}: {e}",
            file=sys.stderr,
            flush=True,
        )
        write_status(args.status, {**status, "exit_code": LAUNCH_FAILED_CODE, "error": str(e)})
        return LAUNCH_FAILED_CODE
    status["child_pid"] = child.pid
    code: int | None = None
    while code is None:
        # every child, orphans included, so none stays a zombie meanwhile
        pid, raw = os.waitpid(-1, 0)
        if pid == child.pid:
            code = exit_code_of(raw)
            child.returncode = code  # reaped here; keep Popen from waiting on it again
    status["leftovers_killed"] = _kill_leftovers() if subreaper else 0
    if status["leftovers_killed"]:
        print(
            f"trainguard jobwrap: the command ended ({code}); killed "
            f"{status['leftovers_killed']} leftover process(es)",
            file=sys.stderr,
            flush=True,
        )
    status["exit_code"] = code
    write_status(args.status, status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
