"""Decoding the controller's answer: strict, except that a command kind this agent does not
know travels on (to be answered "unknown command kind") instead of failing the response."""

from __future__ import annotations

import json

import pytest

from trainguard.agent.commands import default_executor
from trainguard.agent.reporter import decode_response
from trainguard.protocol import Command, Control, ProtocolError


class NoRanks:
    def send_control(self, job: str, control: Control) -> tuple[int, int]:
        return 0, 0


def test_known_kinds_decode_as_before() -> None:
    raw = json.dumps(
        {
            "ack_event_id": 4,
            "commands": [{"id": "c1", "kind": "collect_stacks", "args": {"job": "j"}}],
        }
    ).encode()
    answer = decode_response(raw)
    assert answer.ack_event_id == 4
    assert answer.commands == (Command(id="c1", kind="collect_stacks", args={"job": "j"}),)


def test_an_unknown_kind_does_not_fail_the_response_and_is_answered_as_unknown() -> None:
    raw = json.dumps(
        {
            "ack_event_id": 9,
            "commands": [
                {"id": "c1", "kind": "reboot_node", "args": {"now": True}},
                {"id": "c2", "kind": "checkpoint", "args": {"job": "j"}},
            ],
        }
    ).encode()
    answer = decode_response(raw)
    assert answer.ack_event_id == 9  # the events are acknowledged all the same
    assert [(c.id, c.kind) for c in answer.commands] == [
        ("c1", "reboot_node"),
        ("c2", "checkpoint"),
    ]
    result = default_executor(sender=NoRanks(), fault_target=None).execute(answer.commands[0])
    assert not result.ok and result.message == "unknown command kind 'reboot_node'"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"ack_event_id": "x"}, "ack_event_id"),
        ({"ack_event_id": 1, "commands": [{"id": 5, "kind": "reboot_node"}]}, "commands[0].id"),
        ({"ack_event_id": 1, "commands": [{"id": "c", "kind": 3}]}, "commands[0].kind"),
    ],
    ids=["bad-ack", "bad-id-of-unknown-kind", "kind-not-a-string"],
)
def test_other_malformed_answers_still_fail_naming_the_field(
    body: dict[str, object], field: str
) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_response(json.dumps(body).encode())
    assert e.value.field == field
