"""The fake controller answers agent tokens as the real API does: a token bound to a node
speaks for that node only (another node's report is a 403, audited, nothing stored), a shared
token speaks for every node."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.builders import Reporter
from tests.fakes.controller_service import AGENT_TOKEN, FakeController
from trainguard.protocol import Event, encode_json

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}


@pytest.fixture
def bound() -> Iterator[FakeController]:
    ctl = FakeController(agent_node="node-1")
    yield ctl
    ctl.stop()


def _post(ctl: FakeController, node: str) -> httpx.Response:
    report = Reporter(node).report(now=1.0, events=(Event(id=1, kind="xid", ts=1.0, code=79),))
    return httpx.post(f"{ctl.url}/v1/reports", content=encode_json(report), headers=AGENT)


def test_bound_agent_token_reports_for_its_own_node(bound: FakeController) -> None:
    r = _post(bound, "node-1")
    assert r.status_code == 200, r.text
    assert [(rep.node, len(rep.events)) for rep in bound.reports] == [("node-1", 1)]
    assert bound.service.calls[-1].kwargs == {"actor": "agent-node-1"}


def test_bound_agent_token_is_refused_for_another_node_and_audited(
    bound: FakeController,
) -> None:
    r = _post(bound, "node-2")
    assert r.status_code == 403
    assert r.json()["detail"] == {
        "credential": "agent-node-1",
        "bound_node": "node-1",
        "node": "node-2",
    }
    assert bound.reports == [] and bound.events == {} and "node-2" not in bound.service.nodes
    (entry,) = bound.service.audit
    assert (entry.actor, entry.action, entry.target) == ("agent-node-1", "report_refused", "node-2")
    assert entry.detail["bound_node"] == "node-1"


def test_shared_agent_token_speaks_for_every_node(fake_controller: FakeController) -> None:
    assert [_post(fake_controller, n).status_code for n in ("node-1", "node-2")] == [200, 200]
    assert sorted(fake_controller.service.nodes) == ["node-1", "node-2"]
