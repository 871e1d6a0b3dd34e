"""Incidents: the lifecycle state machine, and turning the engine's decisions into incidents
and action plans (with silences, dry-run, cooldowns, the breaker and the budget applied).

Lifecycle (the only allowed moves; anything else raises InvalidTransition):
    open -> acting -> mitigated -> resolved
    open | acting | mitigated -> resolved
    open -> suppressed (a silence matched) -> resolved
One unresolved incident per (rule, target key). Correlation: one fault often trips several
rules (a DBE is both an uncorrectable ECC error and XID 48; a dead node is a silent node and a
crashed job; one stopped rank silences every rank of the job). A decision that fires while an
unresolved incident is remediating the same node or job is attached to that incident (a
`correlated` timeline entry, no incident and no plan of its own), so one fault gets one
remediation; when it asks to take a node out that the running plan does not, a drain of that
node is appended to the plan (the restart treats a node with a pending drain as unusable).
It stays attached until its own condition clears. What a finished remediation left behind
(the node it drained or swapped out, the job's previous attempt) is attached the same way to
the incident that did it, so it never remediates the job a second time. Cooldown: a firing
decision for a (rule, target) whose last incident resolved less than the rule's `cooldown_s`
ago opens nothing; one timeline note is added to that last incident instead.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.actions.base import ActionHandler, HandlerRegistry
from trainguard.controller.actions.worker import step_label
from trainguard.controller.jobstate import JobState
from trainguard.controller.model import Decision
from trainguard.controller.nodestate import NodeState
from trainguard.controller.records import JobRecord, NewAction
from trainguard.controller.safety import Safety, silence_matches
from trainguard.controller.store import Store
from trainguard.controller.views import ActionView, IncidentState, IncidentView, SilenceView
from trainguard.protocol import RankState, wire_float

log = logging.getLogger("trainguard.controller.incidents")

TRANSITIONS: dict[str, frozenset[str]] = {
    "open": frozenset({"acting", "resolved", "suppressed"}),
    "acting": frozenset({"mitigated", "resolved"}),
    "mitigated": frozenset({"resolved"}),
    "suppressed": frozenset({"resolved"}),
    "resolved": frozenset(),
}

# Plan positions for rows added after the rule's own steps, so they sort after them.
SEQ_CORRELATED = 500
SEQ_ESCALATION = 1000
SEQ_RESOLVE = 2000


def _wire_value(value: float | None) -> float | str | None:
    """A decision value for the timeline: JSON has no NaN, so non-finite values travel as the
    wire's strings (a NaN loss is exactly what the nan_loss rule reports)."""
    return None if value is None else wire_float(value)


class JobLookup(Protocol):
    """The live job view the incident layer asks about (controller.jobs.JobManager)."""

    def job_of_node(self, node: str) -> JobRecord | None: ...

    def ranks(self, job: str) -> list[tuple[str, RankState]]: ...


def _disruptive(kind: str) -> bool:
    """A planned or stored kind that takes capacity from a job (ActionKind.disruptive)."""
    member = ActionKind.parse(kind)
    return member is not None and member.disruptive


def _removes_node(kind: str) -> bool:
    """A kind that takes a node out of its job (ActionKind.removes_node)."""
    member = ActionKind.parse(kind)
    return member is not None and member.removes_node


def _job_active(state: str) -> bool:
    """A stored job state in which the job holds its nodes (JobState.active)."""
    member = JobState.parse(state)
    return member is not None and member.active


def _is_trigger(action: ActionView) -> bool:
    return action.params.get("event", "trigger") == "trigger"


def _resolve_notifications(
    incident_id: int, target: str, actions: Iterable[ActionView]
) -> list[NewAction]:
    """A "resolve" notification to each channel the incident's trigger reached."""
    told = sorted(
        {
            str(a.params.get("channel"))
            for a in actions
            if a.kind == ActionKind.NOTIFY
            and a.params.get("event") == "trigger"
            and a.params.get("channel")
            and a.state in ("succeeded", "running")
        }
    )
    return [
        NewAction(
            kind=ActionKind.NOTIFY.value,
            target=target,
            idempotency_key=f"{incident_id}:resolve:notify:{channel}",
            seq=SEQ_RESOLVE,
            params={"channel": channel, "event": "resolve"},
        )
        for channel in told
    ]


class InvalidTransition(ValueError):
    def __init__(self, incident_id: int, current: str, wanted: str) -> None:
        super().__init__(f"incident {incident_id}: cannot go from {current} to {wanted}")
        self.incident_id = incident_id
        self.current = current
        self.wanted = wanted


def check_transition(incident_id: int, current: str, wanted: str) -> None:
    if wanted not in TRANSITIONS.get(current, frozenset()):
        raise InvalidTransition(incident_id, current, wanted)


class IncidentManager:
    """Owns incident state; the only writer of incidents and of planned action rows."""

    def __init__(
        self,
        *,
        store: Store,
        safety: Safety,
        registry: HandlerRegistry,
        channels: Callable[[str, bool], list[str]],
        on_new_actions: Callable[[], None] = lambda: None,
        jobs: JobLookup | None = None,
    ) -> None:
        self._store = store
        self._jobs = jobs
        self._safety = safety
        self._registry = registry
        self._channels = channels  # (severity, page) -> channel names
        self._on_new_actions = on_new_actions
        self._lock = threading.RLock()
        # (rule, target key) -> (incident id, state) for unresolved incidents
        self._open: dict[tuple[str, str], tuple[int, str]] = {}
        self._cooldown_noted: set[int] = set()
        self._resolve_after: dict[int, Decision] = {}  # cleared while remediating
        # (rule, target key) -> the incident a correlated decision is attached to
        self._attached: dict[tuple[str, str], int] = {}
        # (rule, target key) of decisions about an old attempt with no incident to note them
        # on: ignored (logged once) until they clear
        self._ignored: set[tuple[str, str]] = set()
        for inc in store.incidents.unresolved():
            self._open[(inc.rule, inc.target)] = (inc.id, inc.state)
            for entry in store.incidents.timeline(inc.id):
                rule, target = entry.data.get("rule"), entry.data.get("target")
                if entry.kind == "correlated" and isinstance(rule, str) and isinstance(target, str):
                    self._attached[(rule, target)] = inc.id

    # --- queries ----------------------------------------------------------------------------

    def open_incidents(self) -> list[tuple[str, str, int, str]]:
        """(rule, target key, id, state) of every unresolved incident."""
        with self._lock:
            return [(r, k, i, s) for (r, k), (i, s) in self._open.items()]

    def open_incident_id(self, rule: str, target_key: str) -> int | None:
        with self._lock:
            entry = self._open.get((rule, target_key))
        return entry[0] if entry else None

    # --- transitions ------------------------------------------------------------------------

    def transition(
        self,
        incident_id: int,
        wanted: IncidentState,
        *,
        now: float,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> IncidentView:
        with self._lock:
            incident = self._store.incidents.get(incident_id)
            if incident is None:
                raise KeyError(incident_id)
            check_transition(incident_id, incident.state, wanted)
            self._store.incidents.set_state(
                incident_id, wanted, ts=now, kind=wanted, message=message, data=data
            )
            key = (incident.rule, incident.target)
            if wanted == "resolved":
                self._open.pop(key, None)
            else:
                self._open[key] = (incident_id, wanted)
            log.info(
                "event=incident_%s incident=%d rule=%s target=%s",
                wanted,
                incident_id,
                incident.rule,
                incident.target,
            )
            after = self._store.incidents.get(incident_id)
            assert after is not None
            return after

    def end_node_incidents(self, node: str, *, now: float, why: str) -> list[int]:
        """End `node`'s unresolved hardware incidents (controller.lemons' kind) whose steps
        have all finished: the node passed its validation after a repair, so what they were
        about is fixed. Each is resolved with `why` in its timeline, marked so that its rule's
        cooldown does not swallow the node's next fault. The ids resolved; one already
        resolved is left alone, so a step re-run after a crash resolves nothing twice."""
        ended: list[int] = []
        with self._lock:
            for incident in self._store.incidents.hardware_history(since=0.0, node=node):
                if incident.state == "resolved":
                    continue
                steps = self._store.actions.for_incident(incident.id)
                if any(a.state in ("pending", "running") for a in steps):
                    continue  # its remediation goes on (a job's restart): it ends on its own
                # the "resolved" notifications first: a re-run after a crash before the
                # transition adds the same keys again (ignored), after it finds it resolved
                rows = _resolve_notifications(incident.id, incident.target, steps)
                if rows:
                    self._store.actions.add(incident.id, rows, ts=now)
                self.transition(
                    incident.id,
                    "resolved",
                    now=now,
                    message=why,
                    data={"validated": True, "node": node},
                )
                self._resolve_after.pop(incident.id, None)
                ended.append(incident.id)
        if ended:
            self._on_new_actions()
        return ended

    def _ended_by_validation(self, incident_id: int) -> bool:
        """Was the incident resolved by its node's passing validation (end_node_incidents)?"""
        return any(
            e.kind == "resolved" and e.data.get("validated") is True
            for e in self._store.incidents.timeline(incident_id)
        )

    # --- decisions --------------------------------------------------------------------------

    def apply(self, decisions: Iterable[Decision], *, now: float) -> list[int]:
        """Apply one tick's decisions; returns ids of incidents opened."""
        opened: list[int] = []
        added = False
        with self._lock:
            for d in decisions:
                if d.state == "firing":
                    incident_id, planned = self._on_firing(d, now=now)
                    if incident_id is not None:
                        opened.append(incident_id)
                    added = added or planned
                elif d.state == "resolved":
                    added = self._on_resolved(d, now=now) or added
        if added:
            self._on_new_actions()
        return opened

    def _on_firing(self, d: Decision, *, now: float) -> tuple[int | None, bool]:
        key = (d.rule, d.target.key)
        if key in self._open or key in self._attached or key in self._ignored:
            return None, False
        host = self._covering(d)
        if host is not None:
            return None, self._attach(host, d, now=now)
        last = self._store.incidents.last(d.rule, d.target.key)
        if (
            last is not None
            and last.resolved_at is not None
            and d.cooldown_s > 0
            and now - last.resolved_at < d.cooldown_s
            and not self._ended_by_validation(last.id)
        ):
            if last.id not in self._cooldown_noted:
                self._cooldown_noted.add(last.id)
                self._store.incidents.add_timeline(
                    last.id,
                    ts=now,
                    kind="cooldown",
                    message=(
                        f"fired again {now - last.resolved_at:.0f} s after resolving, within the"
                        f" rule's cooldown ({d.cooldown_s:g} s): no new incident"
                    ),
                    data={"value": _wire_value(d.value)},
                )
            return None, False
        hold: str | None = None
        left = self._left_behind(d)
        if left is not None:
            host, why = left
            if host is not None:
                return None, self._attach(host, d, now=now, why=why)
            if d.target.scope in ("rank", "job"):
                self._ignored.add(key)
                log.info(
                    "event=decision_ignored rule=%s target=%s reason=%s",
                    d.rule,
                    d.target.key,
                    why.replace(" ", "_"),
                )
                return None, False
            hold = why  # a node an operator took out: tell people, remediate nothing
        node = d.target.node
        detail = {
            "value": _wire_value(d.value),
            "since": d.since,
            "severity": d.severity,
            "labels": d.labels,
        }
        summary = d.summary
        evidence = self._job_evidence(d)
        if evidence:
            # why the job crashed (node, exit code, output tail): in the notification itself
            detail["job_state_reason"] = evidence
            summary = f"{summary}: {evidence}" if summary else evidence
        incident_id = self._store.incidents.create(
            rule=d.rule,
            target_key=d.target.key,
            target=dataclasses.asdict(d.target),
            target_text=d.target.describe(),
            severity=d.severity,
            summary=summary,
            node=node,
            job=d.target.job,
            ts=now,
            timeline=[("opened", summary or f"{d.rule} fired on {d.target.describe()}", detail)],
        )
        self._open[key] = (incident_id, "open")
        log.info(
            "event=incident_opened incident=%d rule=%s target=%s severity=%s",
            incident_id,
            d.rule,
            d.target.key,
            d.severity,
        )
        silence = self._safety.silence_for(rule=d.rule, node=node, now=now)
        if silence is not None:
            self.transition(
                incident_id,
                "suppressed",
                now=now,
                message=f"silenced by silence {silence.id} ({silence.comment or 'no comment'});"
                " no actions",
                data={"silence_id": silence.id},
            )
            return incident_id, False
        return incident_id, self._plan(incident_id, d, now=now, hold=hold)

    def _plan(self, incident_id: int, d: Decision, *, now: float, hold: str | None = None) -> bool:
        """Write the incident's action plan (the intent rows) in one transaction. `hold`: why
        no step but notifications may run (every other step is written skipped)."""
        rows: list[NewAction] = []
        notes: list[tuple[str, str, dict[str, Any]]] = []
        node = d.target.node
        blocked: str | None = None
        page_reason: str | None = None
        page_tag = ""
        disruptive = [k for k in d.actions if _disruptive(k)]
        if hold is not None:
            notes.append(("safety", hold, {"rule": d.rule, "node": node}))
        elif disruptive and node is not None:
            breaker = self._safety.breaker(rule=d.rule, now=now)
            if breaker.open:
                blocked = breaker.reason
                if breaker.first:
                    self._safety.record_trip(
                        rule=d.rule, now=now, incident_id=incident_id, nodes=breaker.nodes
                    )
                    page_reason, page_tag = breaker.reason, "breaker"
                else:
                    first_id = self._safety.breaker_incident(d.rule)
                    blocked += f" (paged on incident {first_id})"
            elif ActionKind.DRAIN in disruptive:
                budget = self._safety.budget(now=now)
                floor = self._safety.drain_floor(node)
                if not budget.allowed:
                    blocked = budget.reason
                    page_reason, page_tag = budget.reason, "budget"
                elif floor is not None:
                    blocked = floor
                    page_reason, page_tag = floor, "min_nodes"
            if blocked is not None:
                notes.append(("safety", blocked, {"rule": d.rule, "node": node}))
        for index, kind in enumerate(d.actions):
            if kind in (ActionKind.NOTIFY, ActionKind.PAGE):
                page = kind == ActionKind.PAGE
                channels = self._channels(d.severity, page) or [""]
                for channel in channels:
                    rows.append(
                        NewAction(
                            kind=ActionKind.NOTIFY.value,
                            target=d.target.key,
                            idempotency_key=f"{incident_id}:{index}:notify:{channel}",
                            seq=index,
                            params={"channel": channel, "event": "trigger", "page": page},
                        )
                    )
                continue
            params: dict[str, Any] = {"rule": d.rule, "target": d.target.key}
            if d.since is not None:
                params["since"] = d.since  # when the condition began: detect and MTTR
            if node is not None:
                params["node"] = node
            if d.target.job is not None:
                params["job"] = d.target.job
            if kind == ActionKind.DRAIN:
                params["reason"] = f"incident {incident_id}: {d.summary or d.rule}"
            state, result = "pending", ""
            if hold is not None:
                state, result = "skipped", f"skipped: {hold}"
            elif blocked is not None and _disruptive(kind):
                state, result = "skipped", f"skipped: {blocked}"
            rows.append(
                NewAction(
                    kind=kind,
                    target=node or d.target.key,
                    idempotency_key=f"{incident_id}:{index}:{kind}",
                    seq=index,
                    params=params,
                    state=state,
                    result=result,
                )
            )
        if page_reason is not None:
            rows += self._page_rows(incident_id, d.target.key, reason=page_reason, tag=page_tag)
        if self._safety.dry_run:
            rows = [
                dataclasses.replace(r, state="skipped", result="skipped: dry-run (would run)")
                if r.state == "pending"
                else r
                for r in rows
            ]
            notes.append(("dry_run", "dry-run mode: actions recorded, none executed", {}))
        for r in rows:
            if r.state == "skipped":
                label = f"{r.kind} ({r.params['channel']})" if r.params.get("channel") else r.kind
                notes.append(("action_skipped", f"{label} {r.result}", {"key": r.idempotency_key}))
        if rows:
            planned = ", ".join(
                f"{r.kind}:{r.params['channel']}" if r.params.get("channel") else r.kind
                for r in rows
            )
            notes.insert(0, ("planned", f"plan: {planned}", {"steps": len(rows)}))
        self._store.actions.add(incident_id, rows, ts=now, timeline=notes)
        return any(r.state == "pending" for r in rows)

    def _page_rows(
        self, incident_id: int, target: str, *, reason: str, tag: str
    ) -> list[NewAction]:
        return [
            NewAction(
                kind=ActionKind.NOTIFY.value,
                target=target,
                idempotency_key=f"{incident_id}:page:{tag}:notify:{channel}",
                seq=SEQ_ESCALATION,
                params={"channel": channel, "event": "trigger", "page": True, "reason": reason},
            )
            for channel in self._channels("critical", True) or [""]
        ]

    # --- correlation --------------------------------------------------------------------------

    def _job_of_node(self, node: str) -> str | None:
        for job in self._store.jobs.all():
            if _job_active(job.state) and (node in job.nodes or node in job.attempt_nodes):
                return job.name
        return None

    def _covering(self, d: Decision) -> int | None:
        """The unresolved incident whose remediation in progress covers this decision's node
        or job, if any (the oldest such)."""
        node = d.target.node
        job = d.target.job or (self._job_of_node(node) if node is not None else None)
        if node is None and job is None:
            return None
        for incident_id, state in sorted(self._open.values()):
            if state not in ("open", "acting"):
                continue
            incident = self._store.incidents.get(incident_id)
            if incident is None:
                continue
            steps = [
                a
                for a in self._store.actions.for_incident(incident_id)
                if _disruptive(a.kind) and a.state in ("pending", "running")
            ]
            if not steps:
                continue
            jobs = {incident.job, *(a.params.get("job") for a in steps)}
            if incident.node is not None:
                jobs.add(self._job_of_node(incident.node))
            if (node is not None and incident.node == node) or (job is not None and job in jobs):
                return incident_id
        return None

    def _job_evidence(self, d: Decision) -> str:
        """A job-scope decision about a crashed job: the job's recorded reason ("" if none)."""
        if d.target.scope != "job" or not d.target.job:
            return ""
        job = self._store.jobs.get(d.target.job)
        if job is None or job.state != "crashed":
            return ""
        return job.state_reason

    def _left_behind(self, d: Decision) -> tuple[int | None, str] | None:
        """Is this decision about a node or a job attempt that a remediation already took out
        of its job? (the incident to record it on or None, why); None when it is current.

        A finished remediation no longer covers its job, yet its leftovers keep firing: the
        dead node it swapped out goes node_silent, the old attempt's ranks go silent. Those
        must not remediate the job again; a new fault on a node still in the job must."""
        target = d.target
        if target.scope in ("rank", "job"):
            job = self._store.jobs.get(target.job) if target.job else None
            if job is None or not _job_active(job.state) or job.attempt < 1:
                return None
            why = self._old_attempt(d, job)
            return None if why is None else (self._attempt_incident(job), why)
        node = target.node
        if node is None:
            return None
        rec = self._store.nodes.get(node)
        state = NodeState.parse(rec.state) if rec is not None else None
        if state is not None and not state.in_service:
            # drained, or further on in the node lifecycle (diagnosing, repairing,
            # validating, retired): the rest of one fault (a DBE's ECC rule after its XID's)
            # is part of the incident that drained it, not a hardware incident of its own
            drain = self._store.actions.last_drain(node)
            return (
                drain.incident_id if drain is not None else None,
                f"{node} is {state.value}, out of every job already",
            )
        job = self._jobs.job_of_node(node) if self._jobs is not None else None
        if (
            job is not None
            and _job_active(job.state)
            and node not in job.nodes
            and node not in job.attempt_nodes
        ):
            return (
                self._attempt_incident(job),
                f"{node} was taken out of job {job.name}, whose attempt {job.attempt} runs on"
                f" {', '.join(job.attempt_nodes)}",
            )
        return None

    def _old_attempt(self, d: Decision, job: JobRecord) -> str | None:
        """Why a rank/job decision is about an attempt older than the job's current one."""
        target = d.target
        current = f"attempt {job.attempt} of job {job.name}"
        if target.scope == "rank" and target.node is not None:
            if job.attempt_nodes and target.node not in job.attempt_nodes:
                return f"rank {target.rank} on {target.node} is not part of {current}"
            began = self._store.actions.by_key(job.attempt_key) if job.attempt_key else None
            old_pids = (
                set(self._store.actions.output(began.id).get("old_pids", ()))
                if began is not None
                else set()
            )
            for node, rank in self._jobs.ranks(job.name) if self._jobs is not None else ():
                if node == target.node and rank.rank == target.rank and rank.pid in old_pids:
                    return f"rank {target.rank} (pid {rank.pid}) is a process of an earlier attempt"
        started = job.attempt_started_at
        disruptive = any(_disruptive(k) for k in d.actions)
        if disruptive and d.since is not None and started is not None and d.since < started:
            # a notify-only rule (throughput_drop) that outlasts a restart still tells someone
            return f"its condition began before {current} started"
        return None

    def _attempt_incident(self, job: JobRecord) -> int | None:
        """The incident whose step began the job's current attempt (None: an operator's)."""
        if not job.attempt_key:
            return None
        action = self._store.actions.by_key(job.attempt_key)
        return action.incident_id if action is not None else None

    def _attach(self, host_id: int, d: Decision, *, now: float, why: str | None = None) -> bool:
        """Attach a correlated decision to the incident remediating its node or job (or, with
        `why`, to the incident whose finished remediation left that node or attempt behind);
        append a drain when it wants its node out and the host never drained it. True if a
        step was added."""
        self._attached[(d.rule, d.target.key)] = host_id
        node = d.target.node
        rows: list[NewAction] = []
        reason = (
            "part of this incident (its remediation is already under way)"
            if why is None
            else f"{why}; recorded on this incident, not remediated again"
        )
        notes: list[tuple[str, str, dict[str, Any]]] = [
            (
                "correlated",
                f"{d.rule} fired on {d.target.describe()}: {reason}",
                {
                    "rule": d.rule,
                    "target": d.target.key,
                    "value": _wire_value(d.value),
                    "since": d.since,
                },
            )
        ]
        wants_out = node is not None and any(_removes_node(k) for k in d.actions)
        actions = self._store.actions.for_incident(host_id)
        host = self._store.incidents.get(host_id)
        drained = any(a.kind == ActionKind.DRAIN and a.params.get("node") == node for a in actions)
        if node is not None and why is not None:
            rec = self._store.nodes.get(node)
            drained = drained or rec is None or rec.state != "active"
        if wants_out and node is not None and not drained and (host is None or host.node != node):
            budget = self._safety.budget(now=now)
            state, result = "pending", ""
            if not budget.allowed:
                state, result = "skipped", f"skipped: {budget.reason}"
            elif self._safety.dry_run:
                state, result = "skipped", "skipped: dry-run (would run)"
            rows.append(
                NewAction(
                    kind=ActionKind.DRAIN.value,
                    target=node,
                    idempotency_key=f"{host_id}:correlated:drain:{node}",
                    seq=SEQ_CORRELATED,
                    params={
                        "node": node,
                        "rule": d.rule,
                        "target": d.target.key,
                        "reason": f"incident {host_id}: {d.summary or d.rule}",
                    },
                    state=state,
                    result=result,
                )
            )
            notes.append(("planned", f"plan: drain {node} ({d.rule}) {result}".strip(), {}))
        self._store.actions.add(host_id, rows, ts=now, timeline=notes)
        log.info(
            "event=incident_correlated incident=%d rule=%s target=%s drain_added=%s",
            host_id,
            d.rule,
            d.target.key,
            bool(rows),
        )
        return any(r.state == "pending" for r in rows)

    def _on_resolved(self, d: Decision, *, now: float) -> bool:
        if self._attached.pop((d.rule, d.target.key), None) is not None:
            return False
        self._ignored.discard((d.rule, d.target.key))
        entry = self._open.get((d.rule, d.target.key))
        if entry is None:
            return False
        incident_id, state = entry
        if state == "acting" and self._remediating(incident_id):
            # e.g. node_silent clears as soon as the node is drained, while the replace and
            # restart steps are still to come: resolve once the remediation has ended
            if incident_id not in self._resolve_after:
                self._resolve_after[incident_id] = d
                self._store.incidents.add_timeline(
                    incident_id,
                    ts=now,
                    kind="condition_cleared",
                    message="condition cleared; resolving when the remediation in progress ends",
                    data={"value": _wire_value(d.value)},
                )
            return False
        return self._resolve(incident_id, d, now=now)

    def _remediating(self, incident_id: int) -> bool:
        return any(
            a.state in ("pending", "running") and self._registry.get(a.kind).remediation
            for a in self._store.actions.for_incident(incident_id)
        )

    def _resolve(self, incident_id: int, d: Decision, *, now: float) -> bool:
        self._resolve_after.pop(incident_id, None)
        actions = self._store.actions.for_incident(incident_id)
        for a in actions:
            if a.state == "pending":
                self._store.actions.update(
                    a.id,
                    state="skipped",
                    ts=now,
                    result="skipped: incident resolved first",
                    timeline=(
                        incident_id,
                        "action_skipped",
                        f"{a.kind} #{a.id} skipped: incident resolved first",
                        {"action_id": a.id},
                    ),
                )
        self.transition(
            incident_id,
            "resolved",
            now=now,
            message=f"condition cleared: {d.summary}" if d.summary else "condition cleared",
            data={"value": _wire_value(d.value)},
        )
        rows = _resolve_notifications(incident_id, d.target.key, actions)
        if not rows:
            return False
        self._store.actions.add(incident_id, rows, ts=now)
        return True

    # --- silences -----------------------------------------------------------------------------

    def apply_silence(self, silence: SilenceView, *, now: float) -> list[int]:
        """A silence created while matching incidents are open: their pending notifications
        are skipped ("suppressed by silence N"); their remediation goes on (a restart stopped
        half-way leaves the job down, which is worse than finishing it). An open incident
        with no remediation step left goes `suppressed`. Returns the incidents it touched."""
        touched: list[int] = []
        with self._lock:
            for incident_id, state in sorted(self._open.values()):
                if state == "suppressed":
                    continue
                incident = self._store.incidents.get(incident_id)
                if incident is None or not silence_matches(
                    silence, rule=incident.rule, node=incident.node, now=now
                ):
                    continue
                touched.append(incident_id)
                why = f"suppressed by silence {silence.id}"
                actions = self._store.actions.for_incident(incident_id)
                skipped = 0
                for a in actions:
                    if a.kind == ActionKind.NOTIFY and a.state == "pending" and _is_trigger(a):
                        skipped += 1
                        self._store.actions.update(
                            a.id,
                            state="skipped",
                            ts=now,
                            result=f"skipped: {why}",
                            timeline=(
                                incident_id,
                                "action_skipped",
                                f"{step_label(a)} skipped: {why}",
                                {"action_id": a.id, "silence_id": silence.id},
                            ),
                        )
                remediating = self._remediating(incident_id)
                self._store.incidents.add_timeline(
                    incident_id,
                    ts=now,
                    kind="silenced",
                    message=(
                        f"{why} ({silence.comment or 'no comment'}): {skipped} pending"
                        " notification(s) skipped"
                        + (
                            "; the remediation in progress continues"
                            if remediating
                            else "; no remediation in progress"
                        )
                    ),
                    data={"silence_id": silence.id, "skipped": skipped},
                )
                log.info(
                    "event=incident_silenced incident=%d silence=%d skipped=%d remediating=%s",
                    incident_id,
                    silence.id,
                    skipped,
                    remediating,
                )
                if state == "open" and not remediating:
                    self.transition(
                        incident_id,
                        "suppressed",
                        now=now,
                        message=f"{why}; no actions",
                        data={"silence_id": silence.id},
                    )
        return touched

    def notification_gate(self, action: ActionView, *, now: float) -> str | None:
        """Why a notification step must not run now (a silence matches its incident), else
        None. Resolves still go out: they close what the channel was already told."""
        if (
            action.kind != ActionKind.NOTIFY
            or action.incident_id is None
            or not _is_trigger(action)
        ):
            return None
        incident = self._store.incidents.get(action.incident_id)
        if incident is None:
            return None
        silence = self._safety.silence_for(rule=incident.rule, node=incident.node, now=now)
        return None if silence is None else f"suppressed by silence {silence.id}"

    # --- action progress (ActionListener) -----------------------------------------------------

    def on_action_started(self, action: ActionView, handler: ActionHandler, *, now: float) -> None:
        if action.incident_id is None or not handler.remediation:
            return
        with self._lock:
            incident = self._store.incidents.get(action.incident_id)
            if incident is not None and incident.state == "open":
                self.transition(
                    incident.id, "acting", now=now, message=f"remediation started: {action.kind}"
                )

    def on_action_finished(self, action: ActionView, *, now: float) -> None:
        if action.incident_id is None:
            return
        with self._lock:
            incident = self._store.incidents.get(action.incident_id)
            if incident is None or incident.state != "acting":
                return
            steps = [
                a
                for a in self._store.actions.for_incident(incident.id)
                if self._registry.get(a.kind).remediation
            ]
            if any(a.state in ("pending", "running") for a in steps):
                return
            if any(a.state == "succeeded" for a in steps) and not any(
                a.state == "failed" for a in steps
            ):
                done = ", ".join(a.kind for a in steps if a.state == "succeeded")
                self.transition(incident.id, "mitigated", now=now, message=f"mitigated: {done}")
            else:
                self._store.incidents.add_timeline(
                    incident.id,
                    ts=now,
                    kind="remediation_incomplete",
                    message="remediation ended without mitigating; a person must look",
                )
            cleared = self._resolve_after.get(incident.id)
            if cleared is not None and self._resolve(incident.id, cleared, now=now):
                self._on_new_actions()

    def escalate(self, action: ActionView, *, reason: str, now: float) -> None:
        """A step failed for good: page every channel but the one that failed (once per step)."""
        if action.incident_id is None or action.params.get("page"):
            return
        failed_channel = action.params.get("channel")
        rows = [
            r
            for r in self._page_rows(
                action.incident_id,
                action.target,
                reason=f"step {action.kind} #{action.id} failed: {reason}",
                tag=f"a{action.id}",
            )
            if r.params["channel"] != failed_channel and r.params["channel"]
        ]
        if not rows:
            self._store.incidents.add_timeline(
                action.incident_id,
                ts=now,
                kind="escalation_unavailable",
                message=f"step {action.kind} #{action.id} failed and no other channel can page",
            )
            return
        self._store.actions.add(
            action.incident_id,
            rows,
            ts=now,
            timeline=[("escalated", f"paging: step {action.kind} #{action.id} failed", {})],
        )
        self._on_new_actions()


__all__ = [
    "SEQ_CORRELATED",
    "SEQ_ESCALATION",
    "SEQ_RESOLVE",
    "TRANSITIONS",
    "IncidentManager",
    "InvalidTransition",
    "check_transition",
]
