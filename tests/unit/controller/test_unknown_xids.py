"""XID codes the catalog does not list, per node (controller/unknownxids.py): counted with
their first and last report, bounded per node, shown in the node's view and by `agentctl
describe node`, and rebuilt by a restarted controller from the events it replays."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest

from tests.builders import Reporter
from trainguard.clock import FakeClock
from trainguard.controller.cli.format import write_object
from trainguard.controller.composition import Controller
from trainguard.controller.unknownxids import UnknownXids
from trainguard.controller.views import UnknownXidView
from trainguard.protocol import Event, to_wire
from trainguard.xid_catalog import XidCatalog


def test_codes_are_counted_with_first_and_last_time_the_most_recent_first() -> None:
    seen = UnknownXids()
    seen.note("n1", 999, at=10.0)
    seen.note("n1", 700, at=11.0)
    seen.note("n1", 999, at=12.0)
    assert seen.of("n1") == (
        UnknownXidView(code=999, count=2, first_at=10.0, last_at=12.0),
        UnknownXidView(code=700, count=1, first_at=11.0, last_at=11.0),
    )
    assert seen.of("n2") == ()


def test_a_node_keeps_a_bounded_number_of_codes_the_least_recent_gives_way() -> None:
    seen = UnknownXids(max_codes_per_node=3)
    for i, code in enumerate((901, 902, 903, 901, 904)):
        seen.note("n1", code, at=float(i))
    assert [v.code for v in seen.of("n1")] == [904, 901, 903]
    assert seen.evicted_total == 1
    with pytest.raises(ValueError, match="at least 1"):
        UnknownXids(max_codes_per_node=0)


def test_only_xids_the_catalog_does_not_list_are_noted() -> None:
    seen = UnknownXids()
    catalog = XidCatalog.load()
    for event in (
        Event(id=1, kind="xid", ts=1.0, gpu=0, code=79, message="fallen off the bus"),
        Event(id=2, kind="xid", ts=1.0, gpu=0, code=145, message="RLW_REMAP Nonfatal XC0"),
        Event(id=3, kind="gpu_lost", ts=1.0, gpu=0),
        Event(id=4, kind="xid", ts=1.0, gpu=0, code=999, message="new"),
    ):
        seen.note_event("n1", event, catalog=catalog, at=5.0)
    assert seen.of("n1") == (UnknownXidView(code=999, count=1, first_at=5.0, last_at=5.0),)


def _xid(event_id: int, code: int, now: float) -> Event:
    return Event(id=event_id, kind="xid", ts=now, gpu=1, code=code, message="pid=1, new")


def test_the_node_view_shows_the_unknown_codes_it_reported_and_survives_a_restart(
    make_core: Callable[..., Controller], core_clock: FakeClock
) -> None:
    c = make_core()
    r = Reporter("n1")
    t0 = core_clock.now()
    events = (_xid(1, 999, t0), _xid(2, 79, t0))
    c.ingest_report(r.report(now=t0, events=events), actor="agent")
    core_clock.advance(30.0)
    again = (*events, _xid(3, 999, core_clock.now()))  # a resend is not counted twice
    c.ingest_report(r.report(now=core_clock.now(), events=again), actor="agent")
    expected = (UnknownXidView(code=999, count=2, first_at=t0, last_at=t0 + 30.0),)
    assert c.get_node("n1").unknown_xids == expected
    c.stop()

    restarted = make_core()  # the same store: the acknowledged events are replayed
    assert restarted.get_node("n1").unknown_xids == expected


def test_describe_node_prints_the_unknown_codes() -> None:
    view = UnknownXidView(code=999, count=2, first_at=100.0, last_at=130.0)
    out = io.StringIO()
    write_object(out, {"name": "n1", "unknown_xids": [to_wire(view)]}, 160.0)
    text = out.getvalue()
    assert "unknown_xids:" in text
    assert "code:" in text and "999" in text
    assert "count:" in text and "2" in text
    assert "last_at:" in text and "30s ago" in text
