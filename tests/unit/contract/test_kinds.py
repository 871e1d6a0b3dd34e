"""Event and command kinds are enums on the wire: an unknown kind or a payload that breaks its
kind's schema is a ProtocolError naming the field; the members read as the plain strings."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from trainguard.protocol import (
    EVENT_PAYLOADS,
    Command,
    CommandKind,
    Event,
    EventKind,
    ProtocolError,
    Report,
    TrainerEdge,
    encode_json,
    from_wire,
    to_wire,
)
from trainguard.wire_schemas import json_schema


def _report(*events: dict[str, Any]) -> dict[str, Any]:
    return {"node": "n", "instance": "i", "seq": 1, "sent_at": 1.0, "events": list(events)}


def _event(event_kind: str, **data: Any) -> dict[str, Any]:
    return {"id": 1, "kind": event_kind, "ts": 1.0, "data": data}


def test_every_event_kind_has_a_payload_schema() -> None:
    assert set(EVENT_PAYLOADS) == set(EventKind)


def test_an_unknown_event_kind_is_refused_naming_the_field() -> None:
    with pytest.raises(ProtocolError) as e:
        from_wire(Report, _report(_event("xid"), _event("no_such_kind")))
    assert e.value.field == "events[1].kind"
    assert "'no_such_kind'" in e.value.reason and "'nan_loss'" in e.value.reason


@pytest.mark.parametrize(
    ("event", "field", "reason"),
    [
        pytest.param(_event("job_exit"), "attempt", "required key is missing", id="missing"),
        pytest.param(
            _event("command_result", command_id="c", ok=1),
            "ok",
            "expected true or false, got integer",
            id="int-for-bool",
        ),
        pytest.param(
            _event("source_stale", source="gpu", deadline_s="5", running_s=6.0),
            "deadline_s",
            "expected a number, got string",
            id="string-for-number",
        ),
        pytest.param(
            _event("xid", pci_bus_id=3), "pci_bus_id", "expected a string, got integer", id="opt"
        ),
    ],
)
def test_a_payload_that_breaks_its_schema_is_refused_naming_the_key(
    event: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(ProtocolError) as e:
        from_wire(Report, _report(event))
    assert (e.value.field, e.value.reason) == (f"events[0].data.{field}", reason)


def test_payload_keys_beyond_the_schema_pass_as_before() -> None:
    event = _event("job_exit", attempt=2, node="n1", launch_failed=True)
    (got,) = from_wire(Report, _report(event)).events
    assert got.kind is EventKind.JOB_EXIT
    assert got.data == {"attempt": 2, "node": "n1", "launch_failed": True}


def test_trainer_payloads_are_the_trainers_own() -> None:
    (got,) = from_wire(Report, _report(_event("nan_loss", step=3, loss="NaN", x=[1]))).events
    assert got.data == {"step": 3, "loss": "NaN", "x": [1]}


def test_constructing_an_event_checks_its_payload_too() -> None:
    # the agent cannot spool what a controller would refuse
    with pytest.raises(ValueError, match=r"data\.fault"):
        Event(id=1, kind=EventKind.FAULT_INJECTED, ts=1.0)


def test_kinds_read_encode_and_log_as_their_strings(caplog: pytest.LogCaptureFixture) -> None:
    event = Event(id=1, kind=EventKind.NAN_LOSS, ts=1.0)
    assert EventKind.NAN_LOSS == "nan_loss" and f"{EventKind.NAN_LOSS}" == "nan_loss"
    assert type(to_wire(event)["kind"]) is str
    assert json.loads(encode_json(event))["kind"] == "nan_loss"
    assert {TrainerEdge.NAN_LOSS: 1}.get("nan_loss") == 1
    with caplog.at_level(logging.INFO):
        logging.getLogger("t").info("kind=%s", CommandKind.STOP_JOB)
    assert "kind=stop_job" in caplog.text


def test_an_unknown_command_kind_is_refused_naming_the_field() -> None:
    assert from_wire(Command, {"id": "c", "kind": "stop_job"}).kind is CommandKind.STOP_JOB
    with pytest.raises(ProtocolError) as e:
        from_wire(Command, {"id": "c", "kind": "reboot"})
    assert e.value.field == "kind"


def test_the_published_schema_lists_the_kinds() -> None:
    _, defs = json_schema(Report)
    kind = defs["Event"]["properties"]["kind"]
    assert set(kind["enum"]) == {k.value for k in EventKind}
