"""A local cluster with two controllers leading in turn (ha.enabled, one PostgreSQL database),
and the DBE remediation run through a failover of its leader: what tests/e2e/
test_e2e_failover.py checks and bench/failover.py times.

`HaCluster` is the devkit's DevCluster with its one controller replaced by two (`a`, `b`),
each with its own port, advertise_url and log, both on the store URL given; every agent is
given both URLs (controller.urls) and follows the leader itself. The cluster's API calls go
to the controller leading now (found by its /metrics: leader 1, the highest lease epoch), so
the DevCluster helpers (wait_job, nodes, inject, ...) work across a failover unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.chaos import check_recovery, job_spec, now, run_until_step
from tests.e2e.test_e2e_crash import (
    DBE_RULES,
    DBE_STEPS,
    Crash,
    check_one_remediation,
    dbe_to_boundary,
    incident_actions,
)
from trainguard.devkit.devcluster import ClusterConfig, ClusterError, DevCluster, free_port
from trainguard.devkit.devcluster import _Proc as Proc

NAMES = ("a", "b")
# controller log lines are stamped ts=2026-11-24T05:23:00.571Z (UTC)
_STAMP = re.compile(r"^ts=(\S+Z) ")
_SAMPLE = re.compile(r"^(trainguard_controller_leader|trainguard_controller_lease_epoch) (\S+)$")


def log_stamp(line: str) -> float | None:
    """The unix time of a controller log line (None for a line without a stamp)."""
    m = _STAMP.match(line)
    if m is None:
        return None
    return datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()


class HaCluster(DevCluster):
    """DevCluster with two controllers on one PostgreSQL database. `extra` (top-level config
    sections, e.g. notify) is merged into both controllers' configs."""

    def __init__(
        self,
        run_dir: Path | str,
        config: ClusterConfig,
        *,
        store_url: str,
        lease_s: float,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(run_dir, config)
        self.store_url = store_url
        self.lease_s = lease_s
        self.extra = dict(extra or {})
        self.ports: dict[str, int] = {}
        self.procs: dict[str, Proc] = {}
        self.log_offsets: dict[str, int] = {}
        self._clients: dict[str, httpx.Client] = {}
        self._leader: str | None = None

    # --- the controllers ----------------------------------------------------------------------

    def controller_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def _write_controller_config(self) -> None:
        super()._write_controller_config()
        base = json.loads((self.run_dir / "controller.yaml").read_text())
        for name in NAMES:
            # two back-to-back free_port() calls may return the same just-freed port
            port = free_port()
            while port in self.ports.values():
                port = free_port()
            self.ports[name] = port
            cfg = {
                **base,
                **self.extra,
                "store": {**self.extra.get("store", {}), "url": self.store_url},
                "api": {**base["api"], "port": self.ports[name]},
                "ha": {
                    "enabled": True,
                    "advertise_url": self.controller_url(name),
                    "lease_s": self.lease_s,
                },
            }
            path = self.run_dir / f"controller-{name}.yaml"
            path.write_text(json.dumps(cfg, indent=2) + "\n")
            script = Path(sys.executable).with_name("trainguard-controller")
            proc = Proc(
                f"controller-{name}",
                [str(script), "--config", str(path)],
                self.run_dir / f"controller-{name}.log",
            )
            self.procs[name] = proc
            self._extra.append(proc)  # close() ends it
        (self.run_dir / "controller.yaml").unlink()

    def start_controller(self, name: str | None = None, *, timeout_s: float = 60.0) -> None:
        """Start the controller `name` (None: every one not running, then wait for a leader);
        a restarted one appends to its log (its lines from `log_offsets[name]` on)."""
        names = [name] if name is not None else [n for n in NAMES if not self.procs[n].alive()]
        for n in names:
            proc = self.procs[n]
            if proc.alive():
                raise ClusterError(f"controller {n} is already running")
            self.log_offsets[n] = len(proc.log())
            self._spawn(proc, append=True)
        for n in names:
            for tries_left in (2, 1, 0):
                try:
                    self.wait(
                        functools.partial(self._healthy, n),
                        timeout_s=timeout_s,
                        what=f"controller {n}'s /healthz",
                    )
                    break
                except ClusterError:
                    # a free port taken by another process between choosing and listening (a
                    # busy machine): choose another and start again; anything else fails
                    lost = "Address already in use" in self.procs[n].log()[self.log_offsets[n] :]
                    if not lost or tries_left == 0 or self.procs[n].alive():
                        raise
                    self._move(n)
                    self.log_offsets[n] = len(self.procs[n].log())
                    self._spawn(self.procs[n], append=True)
        if name is None:
            self.wait(self.leader, timeout_s=timeout_s, what="a leader")

    def _move(self, name: str) -> None:
        """Give controller `name` another free port (its config's api.port and advertise_url)."""
        port = free_port()
        while port in self.ports.values():
            port = free_port()
        self.ports[name] = port
        path = self.run_dir / f"controller-{name}.yaml"
        cfg = json.loads(path.read_text())
        cfg["api"]["port"] = port
        cfg["ha"]["advertise_url"] = self.controller_url(name)
        path.write_text(json.dumps(cfg, indent=2) + "\n")

    def _healthy(self, name: str) -> bool:
        proc = self.procs[name]
        if not proc.alive():
            raise ClusterError(f"controller {name} exited:\n{proc.log()[-3000:]}")
        try:
            r = httpx.get(f"{self.controller_url(name)}/healthz", timeout=1)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def lease(self, name: str) -> tuple[bool, int] | None:
        """(leads, lease epoch) from the controller's /metrics; None if it does not answer."""
        if not self.procs[name].alive():
            return None
        try:
            body = httpx.get(f"{self.controller_url(name)}/metrics", timeout=1).text
        except httpx.HTTPError:
            return None
        found: dict[str, str] = {}
        for line in body.splitlines():
            if (m := _SAMPLE.match(line)) is not None:
                found[m.group(1)] = m.group(2)
        if len(found) < 2:
            return None
        return found["trainguard_controller_leader"] == "1.0", int(
            float(found["trainguard_controller_lease_epoch"])
        )

    def leader(self) -> str | None:
        """The controller that leads now (the highest epoch among those that say so)."""
        leads = [(s[1], n) for n in NAMES if (s := self.lease(n)) is not None and s[0]]
        self._leader = max(leads)[1] if leads else None
        if self._leader is not None:
            self.controller = self.procs[self._leader]
        return self._leader

    def wait_leader(self, *, other_than: str | None = None, timeout_s: float = 60.0) -> str:
        def other() -> str | None:
            name = self.leader()
            return name if name != other_than else None

        return self.wait(
            other,
            timeout_s=timeout_s,
            what=f"a leader other than {other_than}" if other_than else "a leader",
        )

    def signal_leader(self, sig: int) -> tuple[str, float]:
        """Signal the leader (SIGKILL: waited for; SIGSTOP: it stays, stopped); returns its name
        and when the signal was sent (unix s). API calls go to the next leader from now on."""
        name = self._leader or self.wait_leader()
        popen = self.procs[name].popen
        assert popen is not None
        at = time.time()
        popen.send_signal(sig)
        if sig == signal.SIGKILL:
            popen.wait(timeout=30)
        self._leader = None
        return name, at

    def resume(self, name: str) -> None:
        """SIGCONT a stopped controller."""
        popen = self.procs[name].popen
        assert popen is not None
        popen.send_signal(signal.SIGCONT)

    def kill_controller(self, sig: int = signal.SIGKILL) -> None:
        self.signal_leader(sig)

    def controller_log(self, name: str) -> str:
        """The lines of the controller's running (or last) instance."""
        return self.procs[name].log()[self.log_offsets.get(name, 0) :]

    def log_events(self, name: str, event: str) -> list[tuple[float, str]]:
        """(unix time, line) of every `event=<event>` line of the controller's instance."""
        out = []
        for line in self.controller_log(name).splitlines():
            if f" event={event} " in f"{line} " and (at := log_stamp(line)) is not None:
                out.append((at, line))
        return out

    @property
    def url(self) -> str:
        return self.controller_url(self._leader or NAMES[0])

    # --- agents: both URLs ----------------------------------------------------------------------

    def _add_agent(self, name: str, role: str) -> Any:
        node = super()._add_agent(name, role)
        path = node.dir / "agent.yaml"
        cfg = json.loads(path.read_text())
        controller = cfg["controller"]
        del controller["url"]
        controller["urls"] = [self.controller_url(n) for n in NAMES]
        # one report held by a stopped controller costs this long before the next URL
        controller["timeout_s"] = 2.0
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        return node

    # --- the API: the leader --------------------------------------------------------------------

    def _client_of(self, name: str) -> httpx.Client:
        if name not in self._clients:
            self._clients[name] = httpx.Client(
                base_url=self.controller_url(name),
                headers={"Authorization": f"Bearer {self.operator_token}"},
                timeout=10,
            )
        return self._clients[name]

    @property
    def client(self) -> httpx.Client:
        return self._client_of(self._leader or self.wait_leader())

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        for _ in range(3):
            name = self._leader or self.wait_leader()
            try:
                r = self._client_of(name).request(method, path, **kwargs)
            except httpx.HTTPError:
                self._leader = None
                continue
            if r.status_code == 503:  # it stepped down meanwhile
                self._leader = None
                continue
            if r.status_code >= 400:
                raise ClusterError(f"{method} {path}: {r.status_code} {r.text}")
            return r.json() if r.content else None
        raise ClusterError(f"{method} {path}: no leader answered")

    def diagnose(self) -> str:
        lines = [super().diagnose()]
        for name in NAMES:
            tail = self.controller_log(name).splitlines()[-12:]
            lines.append(f"controller {name} log tail:\n  " + "\n  ".join(tail))
        return "\n".join(lines)

    def close(self, *, grace_s: float = 5.0) -> None:
        for name in NAMES:
            proc = self.procs.get(name)
            if proc is not None and proc.alive():
                self.resume(name)  # a stopped controller cannot act on SIGTERM
        for client in self._clients.values():
            client.close()
        super().close(grace_s=grace_s)


@dataclass(frozen=True)
class Failover:
    """What one remediation through a failover showed (unix seconds)."""

    boundary: str
    how: str  # "kill" (kill -9), "stop" (SIGSTOP past the lease, then SIGCONT) or "none"
    injected_at: float
    old: str | None = None
    new: str | None = None
    signalled_at: float | None = None
    leads_at: float | None = None  # the new leader's `event=leader` line
    acts_at: float | None = None  # its first step that succeeded (after taking the lease)
    restarted_at: float = 0.0  # the restart step succeeded (the job trains again)


def remediate_through_failover(
    world: Crash,
    *,
    job: str,
    boundary: str,
    how: str,
    step_time_s: float,
    fault_step: int,
) -> Failover:
    """Run `job` on three free nodes to `fault_step`, inject a DBE on the first and, once the
    remediation reached `boundary` (notify: the trigger held unanswered at the receiver;
    restart: attempt 2 launched; otherwise the step running or done), kill -9 the leader
    (how="kill") or SIGSTOP it until the standby leads, then SIGCONT (how="stop"; it must
    step down); how="none" lets the one leader remediate. Then check the recovery: one
    incident, each step once and succeeded, one drain, one restart, every trigger with the
    same idempotency key, no two attempts alive, every loss equal to the reference's. A
    killed controller is started again (a standby) for the next run."""
    c = world.cluster
    assert isinstance(c, HaCluster)
    nodes = world.free_nodes()
    sick = nodes[0]
    drained_before = world.drained()
    run_until_step(c, job_spec(c, job, nodes, step_time_s=step_time_s), fault_step)
    since = now()
    dbe_to_boundary(c, hook=world.hook, job=job, sick=sick, since=since, boundary=boundary)
    result = Failover(boundary=boundary, how=how, injected_at=since)
    if how != "none":
        old = c.leader()
        assert old is not None
        epoch = c.lease(old)
        assert epoch is not None and epoch[0]
        seen = incident_actions(c, since)
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        old, at = c.signal_leader(sig)
        print(f"{how} of leader {old} at the {boundary} boundary; the steps just before: {seen}")
        world.hook.release()
        try:
            new = c.wait_leader(other_than=old)
        finally:
            if how == "stop":
                c.resume(old)
        if how == "stop":
            # the standby could not lead before the stopped leader's lease ran out: that was
            # lease_s after its last renewal, which came at most one renew interval (lease_s / 3,
            # the default) before the stop
            assert time.time() - at > c.lease_s - c.lease_s / 3
        after = c.lease(new)
        assert after is not None and after[1] == epoch[1] + 1, (epoch, after)
        if how == "stop":
            # woken past its lease: it steps down and answers as a standby
            c.wait(
                lambda: c.log_events(old, "leader_stepped_down"),
                timeout_s=60,
                what=f"{old} to step down",
            )
            state = c.wait(lambda: c.lease(old), timeout_s=30, what=f"{old}'s metrics")
            assert state[0] is False, state
        leads = c.log_events(new, "leader")
        assert leads, f"{new} leads without its event=leader line"
        result = Failover(
            boundary=boundary,
            how=how,
            injected_at=since,
            old=old,
            new=new,
            signalled_at=at,
            leads_at=leads[-1][0],
        )
    detail = check_recovery(
        c,
        job,
        world.reference,
        since=since,
        fault_step=fault_step,
        rules=DBE_RULES,
        steps=DBE_STEPS,
    )
    check_one_remediation(world, job, detail, sick=sick, nodes=nodes, drained_before=drained_before)
    if how == "stop" and result.old is not None and result.signalled_at is not None:
        # the woken leader finished no step: whatever it had in flight was refused
        woken = [
            line
            for at, line in c.log_events(result.old, "action_succeeded")
            if at > result.signalled_at
        ]
        assert woken == [], woken
    restarted = next(
        e["ts"]
        for e in detail["timeline"]
        if e["kind"] == "action_succeeded" and "step restart" in e["message"]
    )
    acts = None
    if result.new is not None:
        taken = c.log_events(result.new, "lease_acquired")[-1][0]
        done = [at for at, _ in c.log_events(result.new, "action_succeeded")]
        acts = min((at for at in done if at >= taken), default=None)
    if how == "kill" and result.old is not None:
        c.start_controller(result.old)  # back as a standby for the next run
        c.wait(
            lambda: c.log_events(result.old or "", "leader_seen"),
            timeout_s=60,
            what=f"{result.old} to see the leader",
        )
    return Failover(
        boundary=result.boundary,
        how=how,
        injected_at=since,
        old=result.old,
        new=result.new,
        signalled_at=result.signalled_at,
        leads_at=result.leads_at,
        acts_at=acts,
        restarted_at=float(restarted),
    )


def stop_job(world: Crash, job: str) -> None:
    """End the job if a failed run left it live (the next run needs its nodes)."""
    c = world.cluster
    with contextlib.suppress(Exception):
        if c.job(job)["state"] in ("pending", "running", "restarting"):
            c.api("POST", f"/v1/jobs/{job}/stop")
            c.wait_job(
                job,
                lambda j: j["state"] not in ("pending", "running", "restarting"),
                timeout_s=60,
                what="stop",
            )
    c.wait(lambda: not c.rank_procs(job), timeout_s=30, what=f"{job}'s ranks to end")
