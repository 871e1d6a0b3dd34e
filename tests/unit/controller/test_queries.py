"""Reads while the store cannot be reached (controller/queries.py): LastAnswers keeps the last
answer to each recent question and serves it when the store raises StoreUnavailable, and
only then; QueryService answers incidents, an incident's detail, silences, the audit log and
the nodes' open-incident counts from it, while a question never answered fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.builders import Reporter
from trainguard.clock import FakeClock
from trainguard.controller.composition import Controller
from trainguard.controller.errors import NotFound
from trainguard.controller.model import Decision, Target
from trainguard.controller.queries import LastAnswers, QueryService
from trainguard.controller.store import Store
from trainguard.controller.store.errors import StoreUnavailable

LOST = "postgresql://trainguard:***@db:5432/tg: connection lost: server closed the connection"


def _lost() -> Any:
    raise StoreUnavailable(LOST)


# --- LastAnswers --------------------------------------------------------------------------------


def test_the_last_answer_is_served_while_the_store_is_unavailable() -> None:
    memory = LastAnswers()
    assert memory.ask(("incidents", None), lambda: [1, 2]) == [1, 2]
    assert memory.served_total == 0
    assert memory.ask(("incidents", None), _lost) == [1, 2]
    assert memory.served_total == 1
    # a newer answer replaces the older one
    assert memory.ask(("incidents", None), lambda: [1, 2, 3]) == [1, 2, 3]
    assert memory.ask(("incidents", None), _lost) == [1, 2, 3]
    assert memory.served_total == 2


def test_a_question_never_answered_raises_store_unavailable() -> None:
    memory = LastAnswers()
    memory.ask(("incidents", "open"), lambda: [1])
    with pytest.raises(StoreUnavailable, match="connection lost"):
        memory.ask(("incidents", "resolved"), _lost)
    assert memory.served_total == 0


def test_an_answer_of_none_is_an_answer() -> None:
    memory = LastAnswers()
    assert memory.ask(("incident", 9), lambda: None) is None
    assert memory.ask(("incident", 9), _lost) is None
    assert memory.served_total == 1


def test_any_other_error_is_not_answered_from_memory() -> None:
    memory = LastAnswers()
    memory.ask("q", lambda: "kept")

    def broken() -> str:
        raise RuntimeError("duplicate key value violates unique constraint")

    with pytest.raises(RuntimeError, match="duplicate key"):
        memory.ask("q", broken)
    assert memory.served_total == 0


def test_only_the_most_recently_asked_questions_are_kept() -> None:
    memory = LastAnswers(max_entries=2)
    memory.ask("a", lambda: "A")
    memory.ask("b", lambda: "B")
    assert memory.ask("a", _lost) == "A"  # asked again: now the most recent
    memory.ask("c", lambda: "C")  # the third: "b", the least recently asked, goes
    with pytest.raises(StoreUnavailable):
        memory.ask("b", _lost)
    assert (memory.ask("a", _lost), memory.ask("c", _lost)) == ("A", "C")


# --- QueryService over a store that goes away ----------------------------------------------------


class FlakyStore:
    """The real store, except that every call (of the store or of one of its repositories)
    raises StoreUnavailable while `down` is set."""

    def __init__(self, store: Store | object, *, switch: FlakyStore | None = None) -> None:
        self._store = store
        self._switch = self if switch is None else switch
        self.down = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            if name in _REPOSITORIES:
                return FlakyStore(attr, switch=self._switch)
            return attr
        if not self._switch.down:
            return attr
        return lambda *args, **kwargs: _lost()


_REPOSITORIES = frozenset({"nodes", "jobs", "incidents", "actions", "silences", "audit"})


def _decision(node: str, rule: str = "gpu_dbe") -> Decision:
    return Decision(
        rule=rule,
        target=Target(scope="gpu", node=node, gpu=0),
        state="firing",
        severity="critical",
        actions=("notify",),
    )


@pytest.fixture
def setup(
    make_core: Callable[..., Controller], core_clock: FakeClock
) -> tuple[Controller, FlakyStore, QueryService]:
    c = make_core()
    for node in ("n1", "n2"):
        c.ingest_report(Reporter(node).report(now=core_clock.now()), actor="agent")
    c.apply_decisions([_decision("n1")], now=core_clock.now())
    c.create_silence(rule="gpu_hot", node=None, duration_s=600, comment="fans", actor="op")
    store = FlakyStore(c.store)
    queries = QueryService(
        live=c.live,
        jobs=c.jobs,
        store=store,  # type: ignore[arg-type]
        clock=core_clock,
        node_silent_after_s=60,
    )
    return c, store, queries


def test_store_reads_are_answered_from_memory_while_the_store_is_unavailable(
    setup: tuple[Controller, FlakyStore, QueryService], core_clock: FakeClock
) -> None:
    c, store, queries = setup
    incidents = queries.list_incidents(state=None, node=None, limit=50)
    detail = queries.get_incident(incidents[0].id)
    silences = queries.list_silences()
    audit = queries.audit_log(limit=10)
    nodes = queries.list_nodes()
    assert [i.node for i in incidents] == ["n1"]
    assert detail.timeline and silences and audit
    assert {n.name: n.open_incidents for n in nodes} == {"n1": 1, "n2": 0}

    # the store goes; what the controller wrote meanwhile is not seen: the answers are the last
    store.down = True
    c.apply_decisions([_decision("n2")], now=core_clock.now())
    assert queries.list_incidents(state=None, node=None, limit=50) == incidents
    assert queries.get_incident(incidents[0].id) == detail
    assert queries.list_silences() == silences
    assert queries.audit_log(limit=10) == audit
    assert queries.list_nodes() == nodes
    assert queries.get_node("n1").open_incidents == 1
    assert queries.last_answers.served_total == 6

    # back: fresh answers again
    store.down = False
    assert len(queries.list_incidents(state=None, node=None, limit=50)) == 2
    assert {n.name: n.open_incidents for n in queries.list_nodes()} == {"n1": 1, "n2": 1}


@pytest.mark.parametrize(
    "ask",
    [
        pytest.param(lambda q: q.list_incidents(state="open", node=None, limit=50), id="filter"),
        pytest.param(lambda q: q.list_incidents(state=None, node=None, limit=5), id="limit"),
        pytest.param(lambda q: q.get_incident(1), id="detail"),
        pytest.param(lambda q: q.list_silences(include_expired=True), id="silences"),
        pytest.param(lambda q: q.audit_log(limit=3), id="audit"),
        pytest.param(lambda q: q.list_nodes(), id="nodes"),
        pytest.param(lambda q: q.get_node("n1"), id="node"),
    ],
)
def test_a_question_never_answered_fails_while_the_store_is_unavailable(
    setup: tuple[Controller, FlakyStore, QueryService], ask: Callable[[QueryService], Any]
) -> None:
    _, store, queries = setup
    queries.list_incidents(state=None, node=None, limit=50)
    queries.list_silences()
    queries.audit_log(limit=10)
    store.down = True
    with pytest.raises(StoreUnavailable, match="connection lost"):
        ask(queries)


def test_an_incident_not_found_stays_not_found_while_the_store_is_unavailable(
    setup: tuple[Controller, FlakyStore, QueryService],
) -> None:
    _, store, queries = setup
    with pytest.raises(NotFound):
        queries.get_incident(999)
    store.down = True
    with pytest.raises(NotFound):
        queries.get_incident(999)
    with pytest.raises(StoreUnavailable):
        queries.get_incident(998)


def test_nodes_and_jobs_are_answered_from_the_live_state_while_the_store_is_unavailable(
    setup: tuple[Controller, FlakyStore, QueryService], core_clock: FakeClock
) -> None:
    c, store, queries = setup
    queries.list_nodes()
    store.down = True
    # a node that reports now and is made a spare is listed (live state), with the
    # remembered incident counts
    c.ingest_report(Reporter("n3").report(now=core_clock.now()), actor="agent")
    c.set_role("n3", role="spare", actor="op")
    assert [(n.name, n.open_incidents) for n in queries.list_spares()] == [("n3", 0)]
    assert queries.list_jobs() == []
