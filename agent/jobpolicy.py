"""What a job may run on this node: the user its processes run as (and the access that
user is given to the heartbeat socket and control dir), and the checks every `start_job`
passes before anything is launched (process cap, environment deny-list, interpreter and
program allow-list).

The agent is the last line of defence: an operator token at the controller can ask any node
to run anything, so these hold whatever the controller sends. A refusal names the setting
that refused it; nothing is silently dropped or rewritten.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import stat
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.agent.config import CONTROL_DIR_MAX_BYTES, JobsConfig

log = logging.getLogger("trainguard.agent")

__all__ = [
    "JobPolicy",
    "JobRefused",
    "JobUser",
    "PolicyError",
    "current_user",
    "env_denied",
    "is_under",
    "policy_from_config",
    "prepare_access",
    "prepare_control_dir",
    "resolve_user",
]


class JobRefused(ValueError):
    """A start_job this node's policy does not allow; the message says which setting."""


class PolicyError(ValueError):
    """The jobs section cannot be honoured on this machine (unknown user, ...): a startup
    error, like any other bad configuration."""


@dataclass(frozen=True)
class JobUser:
    """Who a job's processes run as."""

    name: str
    uid: int
    gid: int  # primary group
    groups: tuple[int, ...]  # supplementary groups, the heartbeat socket's included
    home: str
    # True: the agent (root) sets uid/gids at launch. False: the job runs as the agent's
    # own user and keeps its credentials.
    switch: bool

    def popen_kwargs(self) -> dict[str, Any]:
        """`subprocess.Popen` keyword arguments that make the child this user."""
        if not self.switch:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def env(self) -> dict[str, str]:
        """The login variables of this user (the agent's say root's HOME otherwise); a
        job's own `env` may still set them."""
        if not self.switch:
            return {}
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


@dataclass(frozen=True)
class JobPolicy:
    """The checks of one node; `check` raises JobRefused or returns the user to run as."""

    user: JobUser | None  # None: every job is refused with `refusal`
    refusal: str = ""
    env_deny: tuple[str, ...] = ()
    allowed_paths: tuple[str, ...] = ()  # empty: any interpreter and program
    max_nproc_per_node: int = 1024
    agent_python: str = sys.executable  # always allowed as the interpreter

    @classmethod
    def unrestricted(cls, *, agent_python: str = sys.executable) -> JobPolicy:
        """The agent's own user, no deny-list, no allow-list: for embedding JobRunner in
        tests and tools that vouch for what they launch."""
        return cls(user=current_user(), agent_python=agent_python)

    def check(
        self,
        *,
        env: Mapping[str, str],
        nproc_per_node: int,
        python: str | None,
        program: str,
        cwd: str | None,
        module: str | None = None,
    ) -> JobUser:
        """Refuse what this node does not allow; the user to run the job as otherwise.
        `module`: the job runs `-m module` (then `program` is unused)."""
        if self.user is None:
            raise JobRefused(self.refusal)
        if nproc_per_node > self.max_nproc_per_node:
            raise JobRefused(
                f"nproc_per_node={nproc_per_node} exceeds jobs.max_nproc_per_node="
                f"{self.max_nproc_per_node}"
            )
        denied = sorted(name for name in env if env_denied(name, self.env_deny))
        if denied:
            raise JobRefused(
                f"env {', '.join(denied)}: denied by jobs.env_deny (it would load code into "
                "the interpreter or the launcher)"
            )
        if cwd is not None and not os.path.isabs(cwd):
            raise JobRefused(f"cwd must be an absolute path, got {cwd!r}")
        if python is not None and not os.path.isabs(python):
            raise JobRefused(f"python must be an absolute path, got {python!r}")
        if self.allowed_paths:
            interpreter = python or self.agent_python
            if not self._interpreter_allowed(interpreter):
                raise JobRefused(
                    f"python {interpreter!r} is not under jobs.allowed_paths "
                    f"({', '.join(self.allowed_paths)})"
                )
            base = cwd if cwd is not None else os.getcwd()
            allowed = [os.path.realpath(p) for p in self.allowed_paths]
            if module is not None:
                # `-m` imports from the working directory first, then from the interpreter's
                # own paths (checked above; PYTHONPATH is denied by default)
                if not any(is_under(os.path.realpath(base), p) for p in allowed):
                    raise JobRefused(
                        f"module {module!r}: its working directory {base!r} is not under "
                        f"jobs.allowed_paths ({', '.join(self.allowed_paths)}); `-m` imports "
                        "from the working directory first"
                    )
                return self.user
            resolved = os.path.realpath(os.path.join(base, program))
            if not any(is_under(resolved, p) for p in allowed):
                shown = repr(program) if resolved == program else f"{program!r} (= {resolved})"
                raise JobRefused(
                    f"program {shown} is not under jobs.allowed_paths "
                    f"({', '.join(self.allowed_paths)})"
                )
        return self.user

    def _interpreter_allowed(self, python: str) -> bool:
        resolved = os.path.realpath(python)
        if resolved == os.path.realpath(self.agent_python):
            return True
        # A venv's bin/python is a symlink to the base interpreter and the venv is what
        # the operator listed, so the path as given counts as well as the resolved one.
        given = os.path.normpath(python)
        return any(
            is_under(given, os.path.normpath(p)) or is_under(resolved, os.path.realpath(p))
            for p in self.allowed_paths
        )

    def summary(self) -> str:
        """For the agent's start line: `off` (every start_job refused) or the job user."""
        return "off" if self.user is None else f"as_{self.user.name}"

    def startup_warnings(self) -> list[str]:
        """What an operator must hear about at agent start (logged as WARNING). Nothing when
        jobs are off (a root agent without jobs.run_as_user, as on a Slurm node): the start
        line says `jobs=off` and a start_job is refused with the reason."""
        out = []
        if self.user is not None and self.user.uid == 0:
            out.append(
                "event=jobs_run_as_root hint=jobs.allow_jobs_as_root_is_set "
                "risk=any_operator_token_runs_code_as_root_on_this_node"
            )
        if self.user is not None and not self.allowed_paths:
            out.append(
                "event=jobs_allowed_paths_empty hint=set_jobs.allowed_paths "
                "risk=any_program_an_operator_names_can_run"
            )
        return out


def env_denied(name: str, deny: Iterable[str]) -> bool:
    """Whether `name` is an entry of `deny` or starts with one of its `PREFIX*` entries."""
    for entry in deny:
        if entry.endswith("*"):
            if name.startswith(entry[:-1]):
                return True
        elif name == entry:
            return True
    return False


def is_under(path: str, root: str) -> bool:
    """Whether normalised absolute `path` is `root` or inside it."""
    if root == "/":
        return True
    return path == root or path.startswith(root.rstrip("/") + "/")


def current_user() -> JobUser:
    """The agent's own user, credentials unchanged."""
    uid = os.geteuid()
    try:
        pw = pwd.getpwuid(uid)
        name, home = pw.pw_name, pw.pw_dir
    except KeyError:  # a uid without a passwd entry (containers)
        name, home = str(uid), os.environ.get("HOME", "/")
    return JobUser(
        name=name, uid=uid, gid=os.getegid(), groups=tuple(os.getgroups()), home=home, switch=False
    )


def _lookup(user: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        raise PolicyError(f"jobs.run_as_user: no such user {user!r}") from None


def resolve_user(
    *,
    run_as_user: str,
    allow_as_root: bool,
    socket_gid: int | None,
    euid: int | None = None,
) -> tuple[JobUser | None, str]:
    """(user, refusal): who jobs run as, or None and why every job is refused.

    `socket_gid`: the heartbeat socket's group, added to a switched user's groups so its
    ranks can send heartbeats. Raises PolicyError for a setting this machine cannot honour.
    """
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        me = current_user()
        if run_as_user and _lookup(run_as_user).pw_uid != euid:
            raise PolicyError(
                f"jobs.run_as_user={run_as_user!r}: the agent runs as {me.name} (uid {euid}), "
                "not root, so it cannot start jobs as another user; leave it empty (jobs run "
                "as the agent's user) or run the agent as root"
            )
        return me, ""
    if not run_as_user:
        if allow_as_root:
            return current_user(), ""
        return None, (
            "jobs run as root on this node unless jobs.run_as_user names an unprivileged "
            "user: refusing (set jobs.run_as_user, or jobs.allow_jobs_as_root: true on a "
            "dev/test machine)"
        )
    pw = _lookup(run_as_user)
    if pw.pw_uid == 0:
        if not allow_as_root:
            raise PolicyError(
                f"jobs.run_as_user={run_as_user!r} is root (uid 0): name an unprivileged "
                "user, or set jobs.allow_jobs_as_root: true"
            )
        return current_user(), ""
    groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
    if socket_gid is not None and socket_gid != 0:
        groups.add(socket_gid)
    return (
        JobUser(
            name=pw.pw_name,
            uid=pw.pw_uid,
            gid=pw.pw_gid,
            groups=tuple(sorted(groups)),
            home=pw.pw_dir,
            switch=True,
        ),
        "",
    )


def policy_from_config(
    jc: JobsConfig,
    *,
    socket_gid: int | None,
    euid: int | None = None,
    agent_python: str = sys.executable,
) -> JobPolicy:
    """The node's policy from the `jobs` section; raises PolicyError (a startup error)."""
    user, refusal = resolve_user(
        run_as_user=jc.run_as_user,
        allow_as_root=jc.allow_jobs_as_root,
        socket_gid=socket_gid,
        euid=euid,
    )
    return JobPolicy(
        user=user,
        refusal=refusal,
        env_deny=tuple(jc.env_deny),
        allowed_paths=tuple(jc.allowed_paths),
        max_nproc_per_node=jc.max_nproc_per_node,
        agent_python=agent_python,
    )


def prepare_control_dir(*, heartbeat_socket: Path, control_dir: str) -> str:
    """The directory ranks bind their control sockets in; returns it.

    A configured `control_dir` is used as it is (whoever runs jobs must be able to create
    sockets in it). Empty: `<heartbeat socket dir>/ctl`, the agent's, mode 1777 like /tmp, so
    ranks of every user (the agent's launches, Slurm tasks, hand-started torchrun) can bind
    there: each rank makes its own `u<uid>` directory inside (trainer.channel), the sticky bit
    keeps users from removing or renaming each other's entries, and the agent sends a request
    only to a socket owned by the user whose heartbeat named it (agent.heartbeat). The
    heartbeat socket's directory itself stays the agent's. Raises OSError on a failure (the
    caller makes it a startup error).
    """
    if control_dir:
        return control_dir
    ctl = heartbeat_socket.parent / "ctl"
    if len(str(ctl).encode()) > CONTROL_DIR_MAX_BYTES:
        # a long test or fallback socket path: ranks of the agent's own user bind beside it
        log.warning(
            "event=control_dir_beside_socket path=%s reason=path_too_long max_bytes=%d "
            "hint=other_users_ranks_cannot_bind_there_set_jobs.control_dir",
            heartbeat_socket.parent,
            CONTROL_DIR_MAX_BYTES,
        )
        return str(heartbeat_socket.parent)
    with contextlib.suppress(FileExistsError):
        ctl.mkdir(mode=0o700)
    st = ctl.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EEXIST, "exists and is not a directory of the agent's", str(ctl))
    os.chmod(ctl, 0o1777)  # noqa: S103 - every user's ranks bind here; sticky, like /tmp
    return str(ctl)


def prepare_access(user: JobUser, *, heartbeat_socket: Path, socket_group_set: bool) -> None:
    """Let a switched job user send heartbeats: with no heartbeat.socket_group and a socket
    that others may not write (a socket_mode like 0660), the socket's group becomes the
    user's primary group. The default mode (0666) needs nothing. Raises OSError."""
    if not user.switch or socket_group_set:
        return
    if heartbeat_socket.stat().st_mode & 0o002:
        return
    os.chown(heartbeat_socket, -1, user.gid)
