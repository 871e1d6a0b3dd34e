"""The fake controller: an in-memory ControllerService that records every call, and the same
service behind the real API on a loopback port for tests that speak HTTP (agents, agentctl).

FakeService keeps just enough state to answer like the real controller (nodes, reports and
their events by (instance, id), commands redelivered until their result arrives, drain/undrain,
roles, silences, incidents seeded by tests, an audit log) and raises the same service errors.
FakeController serves it through `create_app` with real bearer tokens, records every request,
can answer a forced status, and can stop and start again on its port (a controller outage).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tests.fakes.api_server import serve
from trainguard.clock import SYSTEM_CLOCK, Clock, FakeClock
from trainguard.controller.api.app import create_app
from trainguard.controller.auth import Role, TokenStore
from trainguard.controller.errors import BadRequest, Conflict, NotFound
from trainguard.controller.views import (
    ActionView,
    AuditEntry,
    IncidentDetail,
    IncidentView,
    JobView,
    NodeRole,
    NodeView,
    PreflightView,
    SilenceView,
    TimelineEntry,
)
from trainguard.leader import LEADER_HEADER
from trainguard.protocol import Command, Event, FaultSpec, Report, ReportResponse

AGENT_TOKEN = "fake-agent-s3cret"
OPERATOR_TOKEN = "op-token"
VIEWER_TOKEN = "viewer-token"


@dataclass
class Call:
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class FakeService:
    def __init__(self, *, clock: Clock | None = None, rules_count: int = 3) -> None:
        self.clock = clock or FakeClock()
        self.calls: list[Call] = []
        self.nodes: dict[str, NodeView] = {}
        self.incidents: dict[int, IncidentDetail] = {}
        self.jobs: dict[str, JobView] = {}
        self.silences: dict[int, SilenceView] = {}
        self.audit: list[AuditEntry] = []
        self.pending: dict[str, list[Command]] = {}
        self.acked: dict[tuple[str, str], int] = {}
        self.reports: list[Report] = []
        self.events: dict[tuple[str, int], Event] = {}  # (instance, id): deduplicated
        self.deliveries = 0  # events received, resends included
        self.rules_count = rules_count
        self.reload_error: str | None = None
        # fencing: node -> {job: current attempt}, sent as ReportResponse.job_attempts
        self.job_attempts: dict[str, dict[str, int]] = {}
        # node -> ReportResponse.report_in_s of every answer to it
        self.report_in_s: dict[str, float] = {}
        # `node return`: the next read of a validating node finds its preflight done, with
        # this failure (None: it passes)
        self.preflight_failure: str | None = None
        self._validating: dict[str, NodeView] = {}
        self._ids = itertools.count(1)
        # held while a report is ingested (on the server's thread): hold it to read
        # reports/events/pending consistently from a test
        self.lock = threading.RLock()

    # --- seeding helpers for tests ---

    def add_node(self, name: str, **kw: Any) -> NodeView:
        view = NodeView(name=name, role=kw.pop("role", "active"), state="active", **kw)
        self.nodes[name] = view
        return view

    def add_incident(self, **kw: Any) -> IncidentView:
        now = self.clock.now()
        iid = kw.pop("id", next(self._ids))
        view = IncidentView(
            id=iid,
            rule=kw.pop("rule", "gpu_dbe"),
            target=kw.pop("target", "gpu:node-1:2"),
            target_text=kw.pop("target_text", "node-1 gpu 2"),
            severity=kw.pop("severity", "critical"),
            state=kw.pop("state", "open"),
            opened_at=kw.pop("opened_at", now),
            updated_at=kw.pop("updated_at", now),
            **kw,
        )
        timeline = (TimelineEntry(ts=now, kind="opened", message="incident opened"),)
        self.incidents[iid] = IncidentDetail(incident=view, timeline=timeline)
        return view

    def add_job(self, name: str, **kw: Any) -> JobView:
        view = JobView(name=name, state=kw.pop("state", "running"), **kw)
        self.jobs[name] = view
        return view

    def queue_command(self, node: str, command: Command) -> None:
        """Hand `command` to `node` on every report until a command_result names it."""
        with self.lock:
            self.pending.setdefault(node, []).append(command)

    def methods_called(self) -> list[str]:
        return [c.method for c in self.calls]

    def events_of(self, kind: str) -> list[Event]:
        with self.lock:
            return [e for e in self.events.values() if e.kind == kind]

    def event_ids(self, instance: str) -> list[int]:
        """The ids stored for one agent instance, in order."""
        with self.lock:
            return sorted(i for inst, i in self.events if inst == instance)

    def last_report(self) -> Report | None:
        with self.lock:
            return self.reports[-1] if self.reports else None

    # --- ControllerService ---

    def _record(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append(Call(method, args, kwargs))

    def _audit(self, actor: str, action: str, target: str, **detail: Any) -> None:
        self.audit.append(
            AuditEntry(
                id=len(self.audit) + 1,
                ts=self.clock.now(),
                actor=actor,
                action=action,
                target=target,
                detail=detail,
            )
        )

    def _node(self, name: str) -> NodeView:
        try:
            return self.nodes[name]
        except KeyError:
            raise NotFound(f"node {name} not found") from None

    def refuse_report(self, *, actor: str, node: str, bound_node: str) -> None:
        """Audit a report refused by the API: `actor` speaks for `bound_node` only (the real
        service also bounds how often; every refusal is kept here)."""
        self._record("refuse_report", actor=actor, node=node, bound_node=bound_node)
        self._audit(
            actor,
            "report_refused",
            node,
            reason="credential bound to another node",
            bound_node=bound_node,
        )

    def ingest_report(self, report: Report, *, actor: str) -> ReportResponse:
        with self.lock:
            self._record("ingest_report", report, actor=actor)
            self.reports.append(report)
            now = self.clock.now()
            old = self.nodes.get(report.node)
            # like the controller: a role hint makes no spare, an operator does
            base = old or NodeView(name=report.node, role="active", state="active")
            self.nodes[report.node] = replace(
                base,
                labels=dict(report.labels),
                last_report_at=now,
                report_age_s=0.0,
                reporting=True,
                gpus=len(report.gpus),
                ib_ports=len(report.ib_ports),
                agent_version=report.agent_version,
            )
            done: set[str] = set()
            for e in report.events:
                self.deliveries += 1
                self.events[(report.instance, e.id)] = e
                if e.kind == "command_result" and isinstance(e.data.get("command_id"), str):
                    done.add(e.data["command_id"])
            # like the real controller: the high-water mark of the ids stored per instance
            key = (report.node, report.instance)
            ack = max([self.acked.get(key, 0), *(e.id for e in report.events)])
            self.acked[key] = ack
            left = [c for c in self.pending.get(report.node, []) if c.id not in done]
            if left:
                self.pending[report.node] = left
            else:
                self.pending.pop(report.node, None)
            return ReportResponse(
                ack_event_id=ack,
                commands=tuple(left),
                server_time=now,
                job_attempts=dict(self.job_attempts[report.node])
                if self.job_attempts.get(report.node)
                else None,
                report_in_s=self.report_in_s.get(report.node),
            )

    def list_nodes(self) -> list[NodeView]:
        self._record("list_nodes")
        return sorted(self.nodes.values(), key=lambda n: n.name)

    def get_node(self, name: str) -> NodeView:
        self._record("get_node", name)
        done = self._validating.pop(name, None)
        if done is not None:
            self.nodes[name] = done
        return self._node(name)

    def set_role(self, name: str, *, role: NodeRole, actor: str) -> NodeView:
        self._record("set_role", name, role=role, actor=actor)
        view = replace(self._node(name), role=role)
        self.nodes[name] = view
        self._audit(actor, "set_role", name, role=role)
        return view

    def drain(self, name: str, *, reason: str, actor: str) -> NodeView:
        self._record("drain", name, reason=reason, actor=actor)
        view = replace(self._node(name), state="drained", drain_reason=reason)
        self.nodes[name] = view
        self._audit(actor, "drain", name, reason=reason)
        return view

    def undrain(self, name: str, *, actor: str, force: bool = False) -> NodeView:
        self._record("undrain", name, actor=actor, force=force)
        view = replace(self._node(name), state="active", drain_reason=None)
        self.nodes[name] = view
        self._audit(actor, "undrain", name)
        return view

    def return_node(self, name: str, *, actor: str) -> NodeView:
        self._record("return_node", name, actor=actor)
        node = self._node(name)
        if node.state not in ("drained", "retired"):
            raise Conflict(f"node {name} is {node.state}: only a drained or retired node returns")
        view = replace(node, state="validating", drain_reason="validating")
        self.nodes[name] = view
        failure = self.preflight_failure
        preflight = PreflightView(
            command_id=f"preflight-{name}",
            passed=failure is None,
            summary="passed (ecc)" if failure is None else f"failed: {failure}",
            done_at=self.clock.now(),
            checks=({"name": "ecc", "passed": failure is None, "detail": failure or "ok"},),
        )
        self._validating[name] = replace(
            view,
            state="active" if failure is None else "drained",
            drain_reason=None if failure is None else f"preflight failed: {failure}",
            last_preflight=preflight,
        )
        self._audit(actor, "validate", name)
        return view

    def retire(self, name: str, *, reason: str, actor: str) -> NodeView:
        self._record("retire", name, reason=reason, actor=actor)
        if not reason.strip():
            raise BadRequest("reason: must say why the node is retired")
        view = replace(self._node(name), state="retired", drain_reason=f"retired: {reason}")
        self.nodes[name] = view
        self._audit(actor, "retire", name, reason=reason)
        return view

    def list_spares(self) -> list[NodeView]:
        self._record("list_spares")
        return [n for n in self.list_nodes() if n.role == "spare"]

    def list_incidents(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        limit: int = 100,
        before_id: int | None = None,
    ) -> list[IncidentView]:
        self._record("list_incidents", state=state, node=node, limit=limit, before_id=before_id)
        out = [d.incident for d in self.incidents.values()]
        out = [i for i in out if (before_id is None or i.id < before_id)]
        out = [i for i in out if (state is None or i.state == state)]
        out = [i for i in out if (node is None or i.node == node)]
        return sorted(out, key=lambda i: -i.id)[:limit]

    def get_incident(self, incident_id: int) -> IncidentDetail:
        self._record("get_incident", incident_id)
        try:
            return self.incidents[incident_id]
        except KeyError:
            raise NotFound(f"incident {incident_id} not found") from None

    def list_jobs(self) -> list[JobView]:
        self._record("list_jobs")
        return sorted(self.jobs.values(), key=lambda j: j.name)

    def get_job(self, name: str) -> JobView:
        self._record("get_job", name)
        try:
            return self.jobs[name]
        except KeyError:
            raise NotFound(f"job {name} not found") from None

    def submit_job(self, spec: Any, *, actor: str) -> JobView:
        self._record("submit_job", spec.name, actor=actor)
        if spec.name in self.jobs:
            raise Conflict(f"job {spec.name!r} exists")
        view = JobView(name=spec.name, state="starting", nodes=tuple(spec.nodes), attempt=1)
        self.jobs[spec.name] = view
        return view

    def job_action(self, name: str, kind: str, *, actor: str) -> ActionView:
        self._record("job_action", name, kind, actor=actor)
        if name not in self.jobs:
            raise NotFound(f"job {name} not found")
        return ActionView(
            id=1,
            incident_id=None,
            kind=kind,
            target=name,
            state="running",
            attempts=1,
            idempotency_key=f"operator:{kind}:{name}:1",
            created_at=0.0,
            updated_at=0.0,
            params={"job": name, "actor": actor},
        )

    def create_silence(
        self,
        *,
        rule: str | None,
        node: str | None,
        duration_s: float,
        comment: str,
        actor: str,
    ) -> SilenceView:
        self._record(
            "create_silence",
            rule=rule,
            node=node,
            duration_s=duration_s,
            comment=comment,
            actor=actor,
        )
        if rule is None and node is None:
            raise BadRequest("a silence needs a rule or a node")
        if duration_s <= 0:
            raise BadRequest("duration_s must be positive")
        now = self.clock.now()
        sid = len(self.silences) + 1
        view = SilenceView(
            id=sid,
            rule=rule,
            node=node,
            created_by=actor,
            created_at=now,
            expires_at=now + duration_s,
            comment=comment,
        )
        self.silences[sid] = view
        self._audit(actor, "silence", rule or node or "", silence=sid)
        return view

    def list_silences(self, *, include_expired: bool = False) -> list[SilenceView]:
        self._record("list_silences", include_expired=include_expired)
        now = self.clock.now()
        return [s for s in self.silences.values() if include_expired or s.expires_at > now]

    def delete_silence(self, silence_id: int, *, actor: str) -> None:
        self._record("delete_silence", silence_id, actor=actor)
        if self.silences.pop(silence_id, None) is None:
            raise NotFound(f"silence {silence_id} not found")
        self._audit(actor, "unsilence", str(silence_id))

    def inject_fault(self, node: str, spec: FaultSpec, *, actor: str) -> str:
        self._record("inject_fault", node, spec, actor=actor)
        self._node(node)
        cid = f"cmd-{next(self._ids)}"
        args = {k: v for k, v in vars(spec).items() if v is not None}
        self.queue_command(node, Command(id=cid, kind="inject_fault", args=args))
        self._audit(actor, "inject_fault", node, kind=spec.kind)
        return cid

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        self._record("audit_log", limit=limit, before_id=before_id)
        newest_first = list(reversed(self.audit))
        return [e for e in newest_first if before_id is None or e.id < before_id][:limit]

    def reload_rules(self, *, actor: str) -> int:
        self._record("reload_rules", actor=actor)
        if self.reload_error is not None:
            raise BadRequest(self.reload_error)
        self._audit(actor, "reload_rules", "rules")
        return self.rules_count


@dataclass(frozen=True)
class SeenRequest:
    """One HTTP request the FakeController answered."""

    method: str
    path: str
    authorization: str  # the header as sent, "" when absent
    status: int


class FakeController:
    """A FakeService (its clock: the system clock) behind the real API on 127.0.0.1.

    Tokens: `agent_token` (role agent) and `people`, {token: (actor, role)} (default:
    OPERATOR_TOKEN for "ops", VIEWER_TOKEN for "viewer"). With `agent_node` the agent token
    is bound to that node (actor "agent-NODE", as `node:` binds one in tokens.yaml) and a
    report for any other node is refused with a 403, as the real API does; without, it is a
    shared token (actor "agents") that speaks for every node, as a controller configured with
    `api.allow_shared_agent_tokens: true` accepts one. Set `forced_status`
    to answer every request with that status (an error body, nothing ingested) until it is
    None again. Set `standby_of` to a leader's URL ("" = no leader known) to answer as a
    standby does: every write 503 with X-Trainguard-Leader and Retry-After, reads served.
    `stop()` then `start()` is a controller outage; the port stays the same."""

    def __init__(
        self,
        *,
        agent_token: str = AGENT_TOKEN,
        agent_node: str | None = None,
        people: Mapping[str, tuple[str, Role]] | None = None,
        service: FakeService | None = None,
    ) -> None:
        self.service = service if service is not None else FakeService(clock=SYSTEM_CLOCK)
        self.agent_token = agent_token
        self.forced_status: int | None = None
        self.standby_of: str | None = None
        self.requests: list[SeenRequest] = []
        self.port = 0
        if people is None:
            people = {OPERATOR_TOKEN: ("ops", "operator"), VIEWER_TOKEN: ("viewer", "viewer")}
        agent: tuple[str, ...] = ("agents", "agent")
        if agent_node is not None:
            agent = (f"agent-{agent_node}", "agent", agent_node)
        tokens = TokenStore.from_plaintext({agent_token: agent, **people})
        self._app = create_app(self.service, tokens=tokens, max_body_bytes=4 * 1024 * 1024)
        self._serving: contextlib.ExitStack | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self._serving is None, "already serving"
        stack = contextlib.ExitStack()
        url = stack.enter_context(serve(self._asgi, port=self.port))
        self.port = int(url.rsplit(":", 1)[1])
        self._serving = stack

    def stop(self) -> None:
        """Stop serving (idempotent); what the service holds stays."""
        if self._serving is not None:
            self._serving.close()
            self._serving = None

    # --- what the service saw, for assertions ---

    @property
    def lock(self) -> threading.RLock:
        return self.service.lock

    @property
    def reports(self) -> list[Report]:
        return self.service.reports

    @property
    def events(self) -> dict[tuple[str, int], Event]:
        return self.service.events

    def events_of(self, kind: str) -> list[Event]:
        return self.service.events_of(kind)

    def queue_command(self, node: str, command: Command) -> None:
        self.service.queue_command(node, command)

    def statuses(self, status: int) -> int:
        """How many requests were answered with `status`."""
        return sum(1 for r in self.requests if r.status == status)

    async def _asgi(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1")

        def note(status: int) -> None:
            # noted before the answer leaves, so a client that has it sees it noted
            self.requests.append(
                SeenRequest(
                    method=scope["method"],
                    path=scope["path"],
                    authorization=authorization,
                    status=status,
                )
            )

        forced = self.forced_status
        leader = self.standby_of
        if forced is None and leader is not None and scope["method"] not in ("GET", "HEAD"):
            await self._refuse_as_standby(receive, send, leader, note)
            return
        if forced is None:

            async def send_and_note(message: Any) -> None:
                if message["type"] == "http.response.start":
                    note(message["status"])
                await send(message)

            await self._app(scope, receive, send_and_note)
            return
        while (await receive()).get("more_body", False):
            pass  # read the request body through before answering
        body = json.dumps({"error": f"forced status {forced}", "detail": None}).encode()
        note(forced)
        await send(
            {
                "type": "http.response.start",
                "status": forced,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _refuse_as_standby(self, receive: Any, send: Any, leader: str, note: Any) -> None:
        while (await receive()).get("more_body", False):
            pass  # read the request body through before answering
        body = json.dumps(
            {"error": "not the leader", "detail": {"leader": leader or None}}
        ).encode()
        note(503)
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (LEADER_HEADER.lower().encode(), leader.encode()),
                    (b"retry-after", b"1"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
