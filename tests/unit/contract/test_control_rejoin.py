"""The `rejoin` Control: it carries a rank's Membership, checked strictly when decoded (the
trainer acts on it alone, so a malformed one must never reach `join_world`)."""

from __future__ import annotations

import json

import pytest

from trainguard.membership import Membership
from trainguard.protocol import Control, ProtocolError, decode_json

MEMBERSHIP = Membership(
    rank=0, world_size=2, store_host="node-01", store_port=29600, epoch=3, host_store=True
)


def wire(**fields: object) -> bytes:
    return json.dumps({"action": "rejoin", "request_id": "r-1", "job": "llm", **fields}).encode()


def test_a_rejoin_control_carries_its_membership() -> None:
    control = decode_json(Control, wire(membership=MEMBERSHIP.to_json()))
    assert control.membership is not None
    assert Membership.from_json(control.membership) == MEMBERSHIP


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "membership: set with action rejoin"),
        ({"membership": "{}"}, "membership: membership: .*missing"),
        ({"membership": MEMBERSHIP.to_json().replace("29600", "70000")}, "store_port must be"),
        ({"membership": "x" * 1025}, "membership"),
    ],
    ids=["missing", "empty-object", "port-out-of-range", "too-long"],
)
def test_a_bad_rejoin_control_is_refused_naming_the_field(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_json(Control, wire(**fields))


def test_a_membership_on_another_action_is_refused() -> None:
    with pytest.raises(ProtocolError, match="membership"):
        decode_json(Control, json.dumps({
            "action": "stop", "request_id": "r-2", "membership": MEMBERSHIP.to_json(),
        }).encode())  # fmt: skip
