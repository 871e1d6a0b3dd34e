"""The trainer's side of the agent link: heartbeats out, Control requests in (unix datagrams).

Both directions are non-blocking and best-effort. A missing agent (no socket, refused, full
buffer) turns a heartbeat into a no-op: the training loop never waits on, or dies because of,
the agent. Each rank binds its own control socket and removes it on close.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import select
import socket
import stat
import tempfile
import time
from pathlib import Path

from trainguard.protocol import (
    CONTROL_MAX_BYTES,
    HEARTBEAT_MAX_BYTES,
    PROTOCOL_VERSION,
    Control,
    Heartbeat,
    ProtocolError,
    decode_json,
    encode_json,
    wire_float,
)

__all__ = [
    "DEFAULT_AGENT_SOCKET",
    "AgentChannel",
    "agent_socket_path",
    "control_socket_path",
    "encode_plain_heartbeat",
    "job_name",
]

log = logging.getLogger("trainguard.trainer")

DEFAULT_AGENT_SOCKET = "/run/trainguard/heartbeat.sock"
# A unix socket path must fit sun_path (108 bytes on Linux, including the NUL).
_SUN_PATH_MAX = 107
# "The agent is not there right now": drop the datagram, never raise.
_DROP_ERRNOS = {
    errno.ENOENT,
    errno.ECONNREFUSED,
    errno.EAGAIN,
    errno.ENOBUFS,
    errno.ENOTDIR,
    errno.EACCES,
    errno.EPERM,
}
# ... but these mean an agent is there and this user may not reach it: dropped too, and said
# once (WARNING), since the job is then silently unwatched
_DENIED_ERRNOS = {errno.EACCES, errno.EPERM}
_DENIED_HINT = (
    "hint=the_agent's_heartbeat.socket_mode_must_let_this_user_send:_0666_(the_default)_or_"
    "0660_with_this_user_in_heartbeat.socket_group"
)


# Heartbeat fields whose defaults are not None: the generic encoder always writes them.
_HB_DEFAULTS: dict[str, object] = {
    f.name: f.default
    for f in dataclasses.fields(Heartbeat)
    if f.default is not dataclasses.MISSING and f.default is not None
}
_HB_DEFAULTS["event_data"] = {}
_HB_DEFAULTS["v"] = PROTOCOL_VERSION


def encode_plain_heartbeat(fields: dict[str, object]) -> bytes:
    """The bytes `encode_json(Heartbeat(**fields))` would give, for a heartbeat without an
    event, in a fraction of the time (this runs every step). Flat fields only."""
    out: dict[str, object] = dict(_HB_DEFAULTS)
    for k, v in fields.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, float):
            out[k] = wire_float(v)
        else:
            out[k] = v
    return json.dumps(out, separators=(",", ":"), allow_nan=False).encode()


def job_name(env: dict[str, str] | None = None) -> str:
    """The job the heartbeats name: TRAINGUARD_JOB (the agents' launches set it), else
    `slurm-<SLURM_JOB_ID>` under Slurm (the same id across requeues: how the controller's
    Slurm backend knows the job), else torchrun's run id."""
    e = os.environ if env is None else env
    slurm = e.get("SLURM_JOB_ID")
    return (
        e.get("TRAINGUARD_JOB")
        or (f"slurm-{slurm}" if slurm else "")
        or e.get("TORCHELASTIC_RUN_ID")
        or "default"
    )


def agent_socket_path(env: dict[str, str] | None = None) -> str:
    e = os.environ if env is None else env
    return e.get("TRAINGUARD_AGENT_SOCKET") or DEFAULT_AGENT_SOCKET


def control_socket_path(
    *, job: str, rank: int, pid: int, agent_socket: str, env: dict[str, str] | None = None
) -> str:
    """Where this rank listens: in `$TRAINGUARD_CONTROL_DIR`, else in the agent's `ctl/`
    beside its socket (where the agent made one), else in the agent socket's directory; in a
    shared directory (sticky and world-writable, like the agent's `ctl/`) inside this user's
    own `u<uid>/` (`_own_dir`).

    The agent must be able to reach the path: under its systemd unit (PrivateTmp) it sees
    /run/trainguard but not the rank's /tmp. So a path too long for a unix socket first
    shortens the name (job hashed) in the same directory; only a directory that is itself
    too long falls back to the temp directory, with a warning.
    """
    e = os.environ if env is None else env
    directory = e.get("TRAINGUARD_CONTROL_DIR") or _agent_control_dir(agent_socket)
    directory = _own_dir(directory)
    safe_job = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)[:40]
    name = f"tg-ctl-{safe_job}-r{rank}-{pid}.sock"
    path = os.path.join(directory, name)
    if len(path.encode()) <= _SUN_PATH_MAX:
        return path
    short = f"tg-ctl-{hashlib.sha256(job.encode()).hexdigest()[:8]}-r{rank}-{pid}.sock"
    path = os.path.join(directory, short)
    if len(path.encode()) <= _SUN_PATH_MAX:
        return path
    path = os.path.join(tempfile.gettempdir(), name)
    log.warning(
        "event=control_socket_fallback wanted_dir=%s using=%s reason=path_too_long "
        "hint=an_agent_with_PrivateTmp_cannot_reach_it",
        directory,
        path,
    )
    return path


def _agent_control_dir(agent_socket: str) -> str:
    ctl = Path(agent_socket).parent / "ctl"
    return str(ctl) if ctl.is_dir() else str(ctl.parent)


def _own_dir(directory: str) -> str:
    """`<directory>/u<uid>` (mode 0700, made if missing) when `directory` is shared by every
    user (sticky and world-writable): no other user can then squat this rank's socket name or
    list it. A `u<uid>` that is not this user's own private directory (someone made it first)
    is not used: the rank binds in `directory` itself (the sticky bit still keeps others from
    removing its socket). Any other directory is used as it is."""
    try:
        st = os.stat(directory)
    except OSError:
        return directory
    if not (st.st_mode & stat.S_ISVTX and st.st_mode & 0o002):
        return directory
    uid = os.geteuid()
    own = os.path.join(directory, f"u{uid}")
    with contextlib.suppress(OSError):
        os.mkdir(own, 0o700)
    try:
        mine = os.lstat(own)
    except OSError:
        return directory
    if stat.S_ISDIR(mine.st_mode) and mine.st_uid == uid and not mine.st_mode & 0o077:
        return own
    log.warning(
        "event=control_dir_not_own path=%s owner_uid=%d using=%s", own, mine.st_uid, directory
    )
    return directory


class AgentChannel:
    """Sends Heartbeats to the agent socket and receives Controls on this rank's own socket."""

    def __init__(self, *, agent_socket: str, control_socket: str | None) -> None:
        self.agent_socket = agent_socket
        self.sent = 0
        self.dropped = 0
        self._denied_said = False  # the one WARNING for an agent this user may not reach
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        self._in: socket.socket | None = None
        self.control_socket: str | None = None
        if control_socket is not None:
            self._bind_control(control_socket)

    def _bind_control(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale socket of a dead process with our pid
            sock.bind(path)
        except OSError as e:
            sock.close()
            if e.errno in _DENIED_ERRNOS:
                # the agent is there (its directory is), this user may not bind beside it:
                # the job gets no checkpoint or stop requests
                log.warning(
                    "event=control_socket_denied path=%s reason=%r hint=the_agent's_"
                    "jobs.control_dir_must_be_writable_by_this_user:_leave_it_empty_(its_"
                    "ctl/,_mode_1777)_or_set_TRAINGUARD_CONTROL_DIR",
                    path,
                    e.strerror or str(e),
                )
            else:
                log.info(
                    "event=control_socket_unavailable path=%s reason=%s", path, e.strerror or e
                )
            return
        self._in = sock
        self.control_socket = path

    def send(self, hb: Heartbeat, *, wait_s: float = 0.0) -> bool:
        """Send one heartbeat; True if the kernel took it. Never raises; never blocks, but for
        up to `wait_s` while the agent's queue is full (the last words of a rank: `exit`)."""
        try:
            raw = encode_json(hb)
        except (TypeError, ValueError) as e:
            log.warning(
                "event=heartbeat_encode_failed job=%s rank=%s reason=%s", hb.job, hb.rank, e
            )
            self.dropped += 1
            return False
        return self.send_raw(raw, wait_s=wait_s)

    def send_plain(self, fields: dict[str, object]) -> bool:
        """Send a heartbeat without an event from its fields (the per-step fast path)."""
        try:
            raw = encode_plain_heartbeat(fields)
        except (TypeError, ValueError) as e:
            log.warning("event=heartbeat_encode_failed reason=%s", e)
            self.dropped += 1
            return False
        return self.send_raw(raw)

    def send_raw(self, raw: bytes, *, wait_s: float = 0.0) -> bool:
        """Send encoded heartbeat bytes; oversized ones are logged and dropped. With `wait_s`,
        a full queue (the agent busy: a Unix datagram socket holds only a few) is retried
        every 5 ms until then, instead of dropping at once."""
        if len(raw) > HEARTBEAT_MAX_BYTES:
            log.warning("event=heartbeat_too_large bytes=%d", len(raw))
            self.dropped += 1
            return False
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._out.sendto(raw, self.agent_socket)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self.dropped += 1
                    return False
                time.sleep(0.005)
            except OSError as e:
                self._send_failed(e)
                return False
        self.sent += 1
        return True

    def _send_failed(self, e: OSError) -> None:
        """A send the kernel refused (no agent, denied): counted, said once where it helps."""
        if e.errno in _DENIED_ERRNOS and not self._denied_said:
            self._denied_said = True
            log.warning(
                "event=agent_socket_denied path=%s uid=%d reason=%r %s",
                self.agent_socket,
                os.geteuid(),
                e.strerror or str(e),
                _DENIED_HINT,
            )
        elif e.errno not in _DROP_ERRNOS:
            log.debug("event=heartbeat_send_failed reason=%s", e)
        self.dropped += 1

    def poll(self) -> list[Control]:
        """Every Control waiting on the socket (non-blocking); malformed ones are logged."""
        out: list[Control] = []
        if self._in is None:
            return out
        while True:
            try:
                raw = self._in.recv(CONTROL_MAX_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as e:
                log.warning("event=control_recv_failed reason=%s", e)
                return out
            if len(raw) > CONTROL_MAX_BYTES:
                log.warning("event=control_rejected reason=too_large bytes=%d", len(raw))
                continue
            try:
                out.append(decode_json(Control, raw))
            except ProtocolError as e:
                log.warning("event=control_rejected reason=%s", str(e).replace(" ", "_"))

    def wait_readable(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` until a Control waits on the socket (True); False after the
        timeout or without a control socket (at once)."""
        if self._in is None:
            return False
        try:
            ready, _, _ = select.select([self._in], [], [], max(0.0, timeout_s))
        except InterruptedError:
            return False
        return bool(ready)

    def close(self) -> None:
        self._out.close()
        if self._in is not None:
            self._in.close()
            self._in = None
        if self.control_socket is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.control_socket)
