"""api.max_nodes: a report from a new node beyond the limit is refused naming it, and stores
nothing; nodes already registered keep reporting."""

from __future__ import annotations

import pytest

from tests.builders import Reporter
from trainguard.controller.errors import LimitReached
from trainguard.strict import ConfigError


def test_a_new_node_beyond_max_nodes_is_refused_and_nothing_is_stored(make_core, core_clock):
    c = make_core(api={"max_nodes": 2})
    for name in ("n1", "n2"):
        c.ingest_report(Reporter(name).report(now=core_clock.now()), actor="a")
    with pytest.raises(LimitReached, match=r"api\.max_nodes is 2") as refused:
        c.ingest_report(Reporter("n3").report(now=core_clock.now()), actor="a")
    assert refused.value.status == 403
    assert c.store.nodes.get("n3") is None
    assert sorted(n.name for n in c.list_nodes()) == ["n1", "n2"]
    # the registered ones are not affected
    resp = c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    assert resp.ack_event_id == 0


@pytest.mark.parametrize("value", [0, 1_000_001], ids=["zero", "above-a-million"])
def test_max_nodes_outside_its_range_fails_at_load(core_config, value):
    with pytest.raises(ConfigError, match=r"api\.max_nodes: must be within 1\.\.1000000"):
        core_config(api={"max_nodes": value})
