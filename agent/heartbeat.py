"""Trainer heartbeats in, Control requests out, over unix datagram sockets.

`HeartbeatServer` owns the agent's heartbeat socket: it keeps the last heartbeat per
(job, rank), derives heartbeat and step ages on the agent's monotonic clock, turns edge
events into spoolable records, and sends Control datagrams to a job's ranks. A flood cannot
cost unbounded memory or CPU: reads are rate limited in total and per sending process
(identified by kernel-supplied credentials), tracked ranks are capped, silent ones forgotten.
A heartbeat speaks only for its sender's own job and rank (agent.senders): the kernel names the
sending process, its origin decides which job it may name, and a rank a live process already
speaks for is not taken over by another.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import logging
import os
import select
import socket
import stat
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainguard.agent.senders import REFUSALS, JobClaims, Origin
from trainguard.clock import Clock
from trainguard.protocol import (
    HEARTBEAT_MAX_BYTES,
    Control,
    EventKind,
    Heartbeat,
    ProtocolError,
    RankState,
    TrainerEdge,
    decode_json,
    encode_json,
)

log = logging.getLogger("trainguard.agent.heartbeat")

DROP_REASONS = (
    "oversized",
    "malformed",
    "out_of_bounds",  # well-formed, but a value outside trainguard.bounds (name, time, int64)
    "unsupported_version",
    "rate_limited",
    "too_many_ranks",
    "sender_not_allowed",  # the sending process may not speak for that job or rank (REFUSALS)
)
# heartbeat `event` names that map to their own Event kind; others become TRAINER_EVENT
KNOWN_EVENTS: dict[str, EventKind] = {
    TrainerEdge.NAN_LOSS: EventKind.NAN_LOSS,
    TrainerEdge.CHECKPOINT_COMMITTED: EventKind.CHECKPOINT_COMMITTED,
    TrainerEdge.CHECKPOINT_FAILED: EventKind.CHECKPOINT_FAILED,
    TrainerEdge.EXIT: EventKind.TRAINER_EXIT,
    TrainerEdge.STOP: EventKind.TRAINER_STOP,
}
# Heartbeat fields a RankState does not carry: the sender's clock, the rank's socket, the edge
# event (spooled as an Event of its own) and the protocol version. Every other Heartbeat field
# reaches RankState under its own name (a test holds the two classes to this).
HEARTBEAT_ONLY_FIELDS = frozenset({"t", "control_socket", "event", "event_data", "v"})
# RankState fields the agent computes itself rather than copies
RANK_STATE_OWN_FIELDS = frozenset({"heartbeat_age_s", "step_age_s"})
RANK_STATE_FROM_HEARTBEAT: tuple[str, ...] = tuple(
    f.name for f in fields(Heartbeat) if f.name not in HEARTBEAT_ONLY_FIELDS
)
MAX_PENDING_EVENTS = 1000  # between two drains (one collect tick); a flood is capped here
MAX_SENDERS = 1024  # token buckets kept, least recently used evicted
STOP_POLL_MS = 500  # the reader notices close() within this
RATE_LIMITED_SLEEP_S = 0.01  # over the total budget: the kernel queue holds the excess
GATHER_S = 0.005
DRAIN_BATCH = 256  # datagrams per drain before checking for stop again
_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
# plain ints: `flags & socket.MSG_TRUNC` builds an enum member per datagram (microseconds)
_MSG_TRUNC = int(socket.MSG_TRUNC)
_CRED_SPACE = socket.CMSG_SPACE(_CRED.size)
REFUSAL_LOG_INTERVAL_S = 60.0  # one log line per (uid, job, reason) at most this often
_MAX_REFUSAL_LOG_KEYS = 256


@dataclass(frozen=True)
class TrainerEvent:
    """A heartbeat's edge event, waiting to be turned into a spooled Event."""

    kind: EventKind
    ts: float
    job: str
    rank: int
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Track:
    hb: Heartbeat
    seen_mono: float
    step_changed_mono: float
    sender_pid: int = -1  # from the kernel's credentials, in the agent's pid namespace
    sender_uid: int = -1  # likewise; the control socket it names must be this user's
    # whether a report took this rank's state since its last heartbeat (`ranks(report=True)`)
    reported: bool = False


def _process_gone(pid: int, proc_root: str = "/proc") -> bool:
    """The process has exited (no /proc entry, or a zombie waiting to be reaped)."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False  # cannot tell (permissions): keep the rank
    return stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X")


class _Bucket:
    """A token bucket on the monotonic clock: `take()` is False once `rate_hz` is exceeded."""

    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, rate_hz: float, now_mono: float) -> None:
        self.rate = rate_hz
        self.burst = max(1.0, rate_hz)  # one second's worth
        self.tokens = self.burst
        self.last = now_mono

    def take(self, now_mono: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now_mono - self.last) * self.rate)
        self.last = now_mono
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def wait_s(self) -> float:
        return max(0.0, (1.0 - self.tokens) / self.rate)


def _gid(group: str) -> int:
    """A group name or number -> gid; an unknown group is an OSError naming it."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise OSError(errno.EINVAL, f"unknown group {group!r}") from None


class HeartbeatServer:
    """Receives Heartbeat datagrams on `path`; call `start()` for the reader thread."""

    def __init__(
        self,
        *,
        path: str | Path,
        clock: Clock,
        max_ranks: int = 256,
        rank_timeout_s: float = 600.0,
        mode: int = 0o666,
        group: str | None = None,
        per_sender_rate_hz: float = 200.0,
        max_rate_hz: float = 5000.0,
        proc_root: str | None = None,
        origin_of: Callable[[int, int], Origin] | None = None,
        claims: JobClaims | None = None,
        on_event: Callable[[], None] | None = None,
        keep_exited_until_reported: bool = False,
    ) -> None:
        self.path = Path(path)
        # called (outside the lock, never blocking) after a datagram carrying an event was
        # accepted: the agent spools it now, not at its next tick
        self._on_event = on_event
        # a rank whose process exited stays until a report took its last state (its last
        # steps and its `exit`), not forgotten before the controller saw them
        self._keep_until_reported = keep_exited_until_reported
        # Who sent a datagram (pid, uid from the kernel) -> what it belongs to; without a
        # resolver every sender is a plain user process known by its uid.
        self._origin_of = origin_of or (lambda pid, uid: Origin("user", uid))
        self._claims = claims if claims is not None else JobClaims()
        self.refused_total: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self._refusal_logged: dict[tuple[int, str, str], float] = {}
        # With a proc root, ranks whose sending process exited are forgotten at once.
        self._proc_root = proc_root
        self._clock = clock
        self._max_ranks = max_ranks
        self._rank_timeout_s = rank_timeout_s
        self._per_sender_rate_hz = per_sender_rate_hz
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], _Track] = {}
        self._events: deque[TrainerEvent] = deque(maxlen=MAX_PENDING_EVENTS)
        self._senders: OrderedDict[int, _Bucket] = OrderedDict()
        self._total_bucket = _Bucket(max_rate_hz, clock.monotonic())
        self.received_total = 0
        self.dropped_total: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.events_dropped_total = 0
        self.control_sent_total = 0
        self.control_errors_total = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_fd = self._take_lock()
        try:
            self._sock = self._bind(mode, group)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def _take_lock(self) -> int:
        """The socket belongs to one agent: an exclusive flock on `<socket>.lock`, held while
        this server lives (the kernel drops it when the process dies, so a crashed agent's
        lock never blocks its successor). A second agent on the same path refuses to start
        instead of unlinking a live socket and leaving the first one blind."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OSError(
                errno.EADDRINUSE,
                f"another agent (pid {holder}) owns this heartbeat socket (lock {self.lock_path});"
                " give this agent its own heartbeat.socket_path",
                str(self.path),
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _bind(self, mode: int, group: str | None) -> socket.socket:
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(
                    errno.EEXIST, "exists and is not a socket; not removing it", str(self.path)
                )
            # We hold the lock, so no live agent serves it: a stale socket of a dead one.
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(str(self.path))
            if group:
                os.chown(self.path, -1, _gid(group))
            os.chmod(self.path, mode)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the reader, close the sockets and remove the socket file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._sock.close()
        self._out.close()
        if self._lock_fd >= 0:
            # Only the lock holder removes the socket, and before it lets go of the lock.
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _run(self) -> None:
        # Waking up costs more than decoding a heartbeat, so the reader wakes once per burst:
        # ranks of a data-parallel job step together, so their heartbeats arrive within
        # a few milliseconds of each other. Block in poll() (no timer wake-ups while idle),
        # then wait GATHER_S for the rest of the burst and drain it in one go. GATHER_S is
        # short enough that the kernel queue (net.unix.max_dgram_qlen, often only 10; a full
        # queue makes non-blocking senders drop) holds what arrives meanwhile.
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(STOP_POLL_MS):  # the timeout bounds how long close() waits
                continue
            self._stop.wait(GATHER_S)
            try:
                n = self.drain()
            except Exception:  # never let one bad datagram end heartbeat collection
                log.exception("event=heartbeat_reader_error")
                n = 0
            if n == 0:
                # readable yet nothing taken: over the total rate budget, let it refill
                self._stop.wait(RATE_LIMITED_SLEEP_S)

    def drain(self, max_datagrams: int = DRAIN_BATCH) -> int:
        """Process queued datagrams without blocking; returns how many were read.

        Stops at `max_datagrams` or the total rate budget: beyond it the kernel queue
        absorbs (and non-blocking senders drop) the excess, so a flood costs bounded CPU.
        """
        n = 0
        while n < max_datagrams:
            now_mono = self._clock.monotonic()
            with self._lock:
                if not self._total_bucket.take(now_mono):
                    break
            try:
                data, anc, flags, _ = self._sock.recvmsg(HEARTBEAT_MAX_BYTES + 1, _CRED_SPACE)
            except (BlockingIOError, InterruptedError):
                with self._lock:
                    self._total_bucket.tokens += 1.0  # nothing read: give the token back
                break
            except OSError:
                if self._stop.is_set():
                    break
                raise
            pid = uid = -1
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid, uid, _ = _CRED.unpack(payload[: _CRED.size])
            truncated = bool(flags & _MSG_TRUNC) or len(data) > HEARTBEAT_MAX_BYTES
            self.handle_datagram(data, pid=pid, uid=uid, truncated=truncated, now_mono=now_mono)
            n += 1
        return n

    # -- processing ------------------------------------------------------------------------

    def handle_datagram(
        self,
        data: bytes,
        *,
        pid: int = -1,
        uid: int = -1,
        truncated: bool = False,
        now_mono: float | None = None,
    ) -> None:
        """Process one datagram from process `pid` of user `uid` (the decision part, testable
        directly; -1: the kernel named no sender) received at `now_mono` (default: now)."""
        if now_mono is None:
            now_mono = self._clock.monotonic()
        with self._lock:
            if not self._sender_allows(pid, now_mono):
                self._drop("rate_limited")
                return
            if truncated or len(data) > HEARTBEAT_MAX_BYTES:
                self._drop("oversized")
                return
        try:
            # the one decoder; a hand-written fast path was slower (BENCHMARKS.md)
            hb = decode_json(Heartbeat, data)
        except ProtocolError as e:
            with self._lock:
                if e.field == "v":
                    self._drop("unsupported_version")
                else:
                    self._drop("out_of_bounds" if e.out_of_bounds else "malformed")
            return
        origin = self._origin_of(pid, uid)
        with self._lock:
            refusal = self._claims.check(origin, hb.job) or self._rank_refusal(hb, pid)
            if refusal is not None:
                self._refuse(refusal, hb, pid=pid, uid=uid, now_mono=now_mono)
                return
            if self._accept(hb, now_mono, sender_pid=pid, sender_uid=uid):
                self._claims.bind(origin, hb.job)
            else:
                return
        if hb.event and self._on_event is not None:
            self._on_event()

    def _sender_allows(self, pid: int, now_mono: float) -> bool:
        bucket = self._senders.get(pid)
        if bucket is None:
            bucket = _Bucket(self._per_sender_rate_hz, now_mono)
            self._senders[pid] = bucket
            if len(self._senders) > MAX_SENDERS:
                self._senders.popitem(last=False)
        else:
            self._senders.move_to_end(pid)
        return bucket.take(now_mono)

    def _drop(self, reason: str) -> None:
        self.dropped_total[reason] += 1

    def _rank_refusal(self, hb: Heartbeat, pid: int) -> str | None:
        """A rank a live process speaks for is not taken over by another process (a restarted
        rank's new process takes over once the old one is gone)."""
        track = self._ranks.get((hb.job, hb.rank))
        if track is None or pid <= 0 or track.sender_pid <= 0 or track.sender_pid == pid:
            return None
        if self._proc_root is None or _process_gone(track.sender_pid, self._proc_root):
            return None
        return "rank_taken"

    def _refuse(self, reason: str, hb: Heartbeat, *, pid: int, uid: int, now_mono: float) -> None:
        self._drop("sender_not_allowed")
        self.refused_total[reason] += 1
        key = (uid, hb.job, reason)
        last = self._refusal_logged.get(key)
        if last is not None and now_mono - last < REFUSAL_LOG_INTERVAL_S:
            return
        if len(self._refusal_logged) >= _MAX_REFUSAL_LOG_KEYS:
            self._refusal_logged.clear()
        self._refusal_logged[key] = now_mono
        log.warning(
            "event=heartbeat_sender_refused reason=%s pid=%d uid=%d job=%s rank=%d",
            reason,
            pid,
            uid,
            hb.job,
            hb.rank,
        )

    def _accept(
        self, hb: Heartbeat, now_mono: float, *, sender_pid: int = -1, sender_uid: int = -1
    ) -> bool:
        key = (hb.job, hb.rank)
        track = self._ranks.get(key)
        if track is None:
            if len(self._ranks) >= self._max_ranks:
                self._expire(now_mono)
            if len(self._ranks) >= self._max_ranks:
                self._drop("too_many_ranks")
                return False
            track = _Track(hb=hb, seen_mono=now_mono, step_changed_mono=now_mono)
            self._ranks[key] = track
        elif hb.step != track.hb.step:
            track.step_changed_mono = now_mono
        track.hb = hb
        track.seen_mono = now_mono
        track.reported = False
        track.sender_pid = sender_pid
        track.sender_uid = sender_uid
        self.received_total += 1
        if hb.event:
            if len(self._events) == self._events.maxlen:
                self.events_dropped_total += 1
            self._events.append(
                TrainerEvent(
                    kind=KNOWN_EVENTS.get(hb.event, EventKind.TRAINER_EVENT),
                    ts=self._clock.now(),
                    job=hb.job,
                    rank=hb.rank,
                    message=hb.event[:64],
                    data={"step": hb.step, "pid": hb.pid, **_bounded(hb.event_data)},
                )
            )
        return True

    def _expire(self, now_mono: float) -> None:
        before = {job for job, _ in self._ranks}
        self._expire_ranks(now_mono)
        for job in before - {job for job, _ in self._ranks}:
            self._claims.forget(job)  # no rank left here: the name is free again

    def _expire_ranks(self, now_mono: float) -> None:
        cutoff = now_mono - self._rank_timeout_s
        for key in [k for k, t in self._ranks.items() if t.seen_mono < cutoff]:
            del self._ranks[key]
            log.info("event=rank_forgotten job=%s rank=%d", key[0], key[1])
        # A rank whose process exited (stopped, crashed, killed) is no silent rank: forget it
        # at once, or a job restarted elsewhere would leave a rank that looks hung here.
        # Only when the kernel told us the sender (SO_PASSCRED); a stopped process stays.
        if self._proc_root is None:
            return
        for key in [
            k
            for k, t in self._ranks.items()
            if t.sender_pid > 0
            and (t.reported or not self._keep_until_reported)
            and _process_gone(t.sender_pid, self._proc_root)
        ]:
            del self._ranks[key]
            log.info("event=rank_forgotten job=%s rank=%d reason=process_exited", key[0], key[1])

    # -- reading state ---------------------------------------------------------------------

    def ranks(self, *, report: bool = False) -> tuple[RankState, ...]:
        """Every tracked rank with ages at the clock's current time; forgets silent ranks.
        `report`: the states go into a report (a rank whose process exited is forgotten once
        one did, with keep_exited_until_reported)."""
        now_mono = self._clock.monotonic()
        with self._lock:
            self._expire(now_mono)
            tracks = [t for _, t in sorted(self._ranks.items(), key=lambda kv: kv[0])]
            if report:
                for t in tracks:
                    t.reported = True
            return tuple(_rank_state(t, now_mono) for t in tracks)

    def drain_events(self) -> list[TrainerEvent]:
        with self._lock:
            events = list(self._events)
            self._events.clear()
            return events

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "received_total": self.received_total,
                "dropped_total": dict(self.dropped_total),
                "events_dropped_total": self.events_dropped_total,
                "control_sent_total": self.control_sent_total,
                "control_errors_total": self.control_errors_total,
                "refused_total": dict(self.refused_total),
                "ranks": len(self._ranks),
            }

    # -- control ---------------------------------------------------------------------------

    def send_control(self, job: str, control: Control) -> tuple[int, int]:
        """Send `control` to every tracked rank of `job` that named a control socket.

        Non-blocking; a dead or full socket is counted, never raised. Returns (sent, failed).
        A heartbeat names the path, so the agent (often root) would send wherever a sender
        points it: it sends only to a socket owned by the user whose process named it
        (`_open_rank_socket`).
        """
        with self._lock:
            targets = sorted(
                {
                    (t.hb.control_socket, t.sender_uid)
                    for (j, _), t in self._ranks.items()
                    if j == job and t.hb.control_socket
                }
            )
        return self._send(job, targets, control)

    def send_control_to(self, job: str, rank: int, control: Control) -> bool:
        """Send `control` to rank `rank` of `job` alone (a `rejoin`: each rank its own
        membership); False when the rank is not tracked here, named no control socket, or the
        send failed (logged)."""
        with self._lock:
            t = self._ranks.get((job, rank))
            target = (t.hb.control_socket, t.sender_uid) if t and t.hb.control_socket else None
        if target is None:
            log.warning(
                "event=control_no_socket job=%s rank=%d action=%s", job, rank, control.action
            )
            return False
        sent, _ = self._send(job, [target], control)
        return sent == 1

    def _send(self, job: str, targets: list[tuple[str, int]], control: Control) -> tuple[int, int]:
        payload = encode_json(control)
        sent = failed = 0
        for path, uid in targets:
            try:
                fd = _open_rank_socket(path, uid=uid)
                try:
                    self._out.sendto(payload, f"/proc/self/fd/{fd}")
                finally:
                    os.close(fd)
                sent += 1
            except OSError as e:
                failed += 1
                log.warning(
                    "event=control_send_failed job=%s path=%s action=%s request_id=%s error=%s",
                    job,
                    path,
                    control.action,
                    control.request_id,
                    e.strerror
                    if e.errno == errno.EPERM
                    else errno.errorcode.get(e.errno or 0, str(e)),
                )
        with self._lock:
            self.control_sent_total += sent
            self.control_errors_total += failed
        return sent, failed


def _open_rank_socket(path: str, *, uid: int) -> int:
    """An O_PATH descriptor of the unix socket at `path`, which must be owned by `uid` (the
    sender of the heartbeat that named it; -1: no credentials, an in-process caller). Sending
    through `/proc/self/fd/<fd>` reaches that very inode, so the path cannot be swapped for
    another user's socket (or a symlink to one) between the check and the send. EPERM, with
    the reason as its message, when the socket is not that user's."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EPERM, "not_a_socket")
        if uid >= 0 and st.st_uid != uid:
            raise OSError(errno.EPERM, "not_the_senders_socket")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _bounded(data: dict[str, Any]) -> dict[str, Any]:
    """At most 16 scalar entries of a trainer's event data (the datagram is already small)."""
    out: dict[str, Any] = {}
    for k, v in list(data.items())[:16]:
        if isinstance(v, str | int | float | bool) or v is None:
            out[str(k)[:64]] = v[:256] if isinstance(v, str) else v
    return out


def _rank_state(t: _Track, now_mono: float) -> RankState:
    hb = t.hb
    return RankState(
        **{name: getattr(hb, name) for name in RANK_STATE_FROM_HEARTBEAT},
        heartbeat_age_s=max(0.0, now_mono - t.seen_mono),
        step_age_s=max(0.0, now_mono - t.step_changed_mono),
    )
