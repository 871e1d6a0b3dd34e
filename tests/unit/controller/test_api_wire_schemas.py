"""The compiled wire decoder accepts and rejects exactly what the wire's rules say.

The rules, written out as a plain walk over the type hints (`_reference` below, test code
only): unknown keys fail, nothing is coerced (no "1" for 1, no true for 1, no 1.0 for an
int; an int is a float), non-finite floats travel as "NaN"/"Infinity"/"-Infinity", and `v`
must be the protocol version. Bounds: every integer (in `Any` values too) fits int64, and a
field annotated with a `Bound` keeps to its range, finiteness, pattern, length and count.
The decoder must agree with it on every report and mutation.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import enum
import json
import math
import re
import types
import typing
from typing import Any, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.decode import INT64_MAX, INT64_MIN, NONFINITE, Bound, Invalid
from trainguard.model import GpuSample, IbPortSample, NvLinkSample
from trainguard.protocol import (
    EVENT_PAYLOADS,
    PROTOCOL_VERSION,
    Command,
    Event,
    EventKind,
    FaultSpec,
    JobProcess,
    ProtocolError,
    RankState,
    Report,
    ReportResponse,
    decode_json,
    encode_json,
    from_wire,
    to_wire,
)
from trainguard.wire_schemas import decoder


class _Reject(Exception):
    def __init__(self, path: str) -> None:
        self.path = path


def _reference(cls: type, raw: bytes) -> Any:
    """The wire's decoding rules as a walk over the type hints; raises _Reject(path)."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise _Reject("") from None
    if not isinstance(data, dict):
        raise _Reject("")
    if data.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise _Reject("v")
    return _walk(cls, data, "")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _int64_everywhere(value: Any) -> bool:
    if type(value) is int:
        return INT64_MIN <= value <= INT64_MAX
    if isinstance(value, dict):
        return all(_int64_everywhere(v) for v in value.values())
    if isinstance(value, list):
        return all(_int64_everywhere(v) for v in value)
    return True


def _bounded(bound: Bound, value: Any, path: str) -> None:
    """`value` (already of its type) against `bound`, as the bound's docstring words it."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if bound.finite and not math.isfinite(value):
            raise _Reject(path)
        if bound.ge is not None and value < bound.ge:
            raise _Reject(path)
        if bound.le is not None and value > bound.le:
            raise _Reject(path)
    if isinstance(value, str):
        if bound.pattern is not None and not re.fullmatch(bound.pattern, value):
            raise _Reject(path)
        if bound.max_length is not None and len(value) > bound.max_length:
            raise _Reject(path)
    if isinstance(value, tuple | list | dict) and bound.max_items is not None:
        if len(value) > bound.max_items:
            raise _Reject(path)


def _walk(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        out = _walk(args[0], value, path)
        for bound in args[1:]:
            _bounded(bound, out, path)
        return out
    if tp is Any:
        if not _int64_everywhere(value):
            raise _Reject(path)  # the `Any` value as a whole, however deep the integer
        return value
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        return _walk(next(a for a in args if a is not type(None)), value, path)
    if origin is typing.Literal:
        if value not in args or type(value) is not type(args[0]):
            raise _Reject(path)
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if type(value) is not str or value not in {m.value for m in tp}:
            raise _Reject(path)
        return tp(value)
    if origin in (list, tuple):
        if type(value) is not list:
            raise _Reject(path)
        items = [_walk(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, collections.abc.Mapping):
        if type(value) is not dict:
            raise _Reject(path)
        return {k: _walk(args[1], v, _join(path, k)) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if type(value) is not dict:
            raise _Reject(path)
        hints = typing.get_type_hints(tp, include_extras=True)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        for key in value:
            if key not in fields:
                raise _Reject(_join(path, key))
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = _walk(hints[name], value[name], _join(path, name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Reject(_join(path, name))
        try:
            return tp(**kwargs)
        except Invalid as e:  # the class's own rule (an event kind's payload)
            raise _Reject(_join(path, e.key)) from None
    if tp is float:
        if isinstance(value, str) and value in NONFINITE:
            return NONFINITE[value]
        if type(value) not in (int, float):
            raise _Reject(path)
        try:
            return float(value)
        except OverflowError:  # JSON's 1e400 or 10**400 reads as infinity
            return math.inf if value > 0 else -math.inf
    if type(value) is not tp:  # bool, int, str: exactly
        raise _Reject(path)
    if tp is int and not INT64_MIN <= value <= INT64_MAX:
        raise _Reject(path)
    return value


# no surrogates: Python's json accepts lone surrogates in strings, JSON parsers need not
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
# node and job names, and identifiers (kinds, ids): within trainguard.bounds
names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,12}", fullmatch=True)
idents = st.from_regex(r"[!-~]{1,12}", fullmatch=True)
floats = st.floats(allow_nan=True, allow_infinity=True)
finite = st.floats(allow_nan=False, allow_infinity=False)
times = st.floats(0.0, 4_102_444_800.0)
opt_float = st.none() | floats
opt_finite = st.none() | finite
counts = st.integers(0, INT64_MAX)
opt_int = st.none() | counts
opt_bool = st.none() | st.booleans()

nvlinks = st.builds(
    NvLinkSample,
    link=st.integers(0, 17),
    up=opt_bool,
    crc_flit_errors_total=opt_int,
    replay_errors_total=opt_int,
)
gpus = st.builds(
    GpuSample,
    index=st.integers(0, 7),
    uuid=text,
    pci_bus_id=text,
    name=text,
    lost=st.booleans(),
    temperature_celsius=opt_finite,
    power_watts=opt_finite,
    memory_used_bytes=opt_int,
    throttle_hw_slowdown=opt_bool,
    ecc_uncorrected_volatile_total=opt_int,
    nvlinks=st.lists(nvlinks, max_size=3).map(tuple),
)
ib_ports = st.builds(
    IbPortSample,
    device=names,
    port=st.integers(1, 2),
    state=st.none() | text,
    rate_gbps=opt_finite,
    counters=st.dictionaries(text, counts, max_size=3),
    unreadable=st.lists(text, max_size=2).map(tuple),
)
json_any = st.recursive(
    st.none() | st.booleans() | st.integers(INT64_MIN, INT64_MAX) | finite | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)
_PAYLOAD_VALUES: dict[tuple[type, ...], st.SearchStrategy[Any]] = {
    (str,): text,
    (int,): counts,
    (bool,): st.booleans(),
    (int, float): finite,
    (list, tuple): st.lists(json_any, max_size=2),
}


def _event_data(kind: EventKind) -> st.SearchStrategy[dict[str, Any]]:
    """A payload of `kind`: its required keys, some of its optional ones and other keys."""
    payload = EVENT_PAYLOADS[kind]
    declared = set(payload.required) | set(payload.optional)
    extra = st.dictionaries(text.filter(lambda k: k not in declared), json_any, max_size=2)
    return st.builds(
        lambda req, opt, more: {**more, **opt, **req},
        st.fixed_dictionaries({k: _PAYLOAD_VALUES[t] for k, t in payload.required.items()}),
        st.fixed_dictionaries(
            {}, optional={k: _PAYLOAD_VALUES[t] for k, t in payload.optional.items()}
        ),
        extra,
    )


events = st.sampled_from(list(EventKind)).flatmap(
    lambda kind: st.builds(
        Event,
        id=st.integers(0, 2**40),
        kind=st.just(kind),
        ts=times,
        gpu=st.none() | st.integers(0, 7),
        code=st.none() | st.integers(0, 200),
        data=_event_data(kind),
    )
)
ranks = st.builds(
    RankState,
    job=names,
    rank=st.integers(0, 100),
    step=st.integers(0, 10**6),
    loss=opt_float,
    ckpt_step=st.none() | st.integers(0, 10),
)
jobs = st.builds(
    JobProcess,
    job=names,
    attempt=st.integers(0, 5),
    state=st.sampled_from(["starting", "running", "stopping", "exited"]),
    exit_code=st.none() | st.integers(-9, 255),
)
reports = st.builds(
    Report,
    node=names,
    instance=idents,
    seq=st.integers(0, 10**9),
    sent_at=times,
    role_hint=st.none() | st.sampled_from(["active", "spare"]),
    labels=st.dictionaries(idents, text, max_size=3),
    gpus=st.lists(gpus, max_size=2).map(tuple),
    ib_ports=st.lists(ib_ports, max_size=2).map(tuple),
    ranks=st.lists(ranks, max_size=2).map(tuple),
    jobs=st.lists(jobs, max_size=1).map(tuple),
    events=st.lists(events, max_size=2).map(tuple),
    health=st.dictionaries(idents, finite, max_size=2),
)

# replacement values that are wrong for some field types and right for others
odd_values = st.sampled_from(
    [
        None,
        True,
        False,
        0,
        1,
        -1,
        1.0,
        2.5,
        "1",
        "",
        "NaN",
        "nan",
        "Infinity",
        "inf",
        "a b",
        "n\n",
        2**63,
        -(2**63) - 1,
        10**400,
        1e308,
        [],
        {},
        [1],
        {"a": 1},
    ]
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _outcome(raw: bytes) -> tuple[str, Any]:
    """("ok", canonical wire form) or ("error", None) from the reference rules."""
    try:
        return "ok", to_wire(_reference(Report, raw))
    except _Reject:
        return "error", None


def _fast_outcome(raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", to_wire(decoder(Report).decode_json(raw))
    except ProtocolError:
        return "error", None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(report=reports)
def test_valid_reports_decode_identically(report: Report) -> None:
    raw = encode_json(report)
    fast = decoder(Report).decode_json(raw)
    assert to_wire(fast) == to_wire(_reference(Report, raw))
    assert to_wire(fast) == to_wire(decode_json(Report, raw)) == to_wire(report)
    assert type(fast.gpus) is tuple
    assert all(type(g) is GpuSample for g in fast.gpus)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(report=reports, data=st.data())
def test_one_mutation_is_accepted_or_rejected_identically(
    report: Report, data: st.DataObject
) -> None:
    wire = to_wire(report)
    paths = _paths(wire)
    mutated = copy.deepcopy(wire)
    action = data.draw(st.sampled_from(["replace", "add_key", "delete_key"]))
    if action == "replace" and paths:
        path = data.draw(st.sampled_from(paths))
        target = mutated
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = data.draw(odd_values)
    else:
        objects = [()] + [p for p in paths if isinstance(_get(mutated, p), dict)]
        where = _get(mutated, data.draw(st.sampled_from(objects)))
        if action == "delete_key" and where:
            del where[data.draw(st.sampled_from(sorted(where)))]
        else:
            where[data.draw(st.sampled_from(["bogus", "node", "uuid", "v", "index"]))] = data.draw(
                odd_values
            )
    raw = json.dumps(mutated).encode()
    ref = _outcome(raw)
    fast = _fast_outcome(raw)
    assert fast == ref, raw


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        pytest.param(b'{"instance":"i","seq":1,"sent_at":1}', "node", id="missing-node"),
        pytest.param(
            b'{"node":"n","instance":"i","seq":true,"sent_at":1}', "seq", id="bool-for-int"
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1.0,"sent_at":1}', "seq", id="float-for-int"
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":"1"}', "sent_at", id="string-for-float"
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":"nan"}', "sent_at", id="lowercase-nan"
        ),
        pytest.param(b'{"node":"n","instance":"i","seq":1,"sent_at":1,"v":2}', "v", id="version"),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":1,"role_hint":"boss"}',
            "role_hint",
            id="literal",
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":1,"gpus":[{"index":0,"uuid":"u","pci_bus_id":"p","name":"x","nvlinks":[{"link":0,"up":1}]}]}',
            "gpus[0].nvlinks[0].up",
            id="nested-bool",
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":1,"ib_ports":[{"device":"d","port":1,"counters":{"a":"1"}}]}',
            "ib_ports[0].counters.a",
            id="mapping-value",
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":1,"zz":1}', "zz", id="unknown-key"
        ),
        pytest.param(
            b'{"node":"n\\n","instance":"i","seq":1,"sent_at":1}', "node", id="name-newline"
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":"Infinity"}', "sent_at", id="time-inf"
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":1,"ranks":[{"job":"j","rank":0,"step":'
            + b"1" * 400
            + b"}]}",
            "ranks[0].step",
            id="int-beyond-int64",
        ),
        pytest.param(
            b'{"node":"n","instance":"i","seq":1,"sent_at":1,"events":[{"id":1,"kind":"nan_loss","ts":1,'
            b'"data":{"a":[9223372036854775808]}}]}',
            "events[0].data.a",
            id="any-beyond-int64",
        ),
        pytest.param(b"[]", "", id="array"),
        pytest.param(b"{", "", id="truncated"),
    ],
)
def test_rejections_name_the_same_field(raw: bytes, field: str) -> None:
    with pytest.raises(_Reject) as ref:
        _reference(Report, raw)
    with pytest.raises(ProtocolError) as fast:
        decoder(Report).decode_json(raw)
    with pytest.raises(ProtocolError) as parsed:
        from_wire(Report, json.loads(raw)) if raw != b"{" else decode_json(Report, raw)
    assert ref.value.path == field
    assert fast.value.field == field
    assert (parsed.value.field, parsed.value.reason) == (field, fast.value.reason)


@pytest.mark.parametrize(
    "msg",
    [
        pytest.param(
            ReportResponse(
                ack_event_id=3, commands=(Command(id="c", kind="checkpoint", args={"job": "j"}),)
            ),
            id="report-response",
        ),
        pytest.param(FaultSpec(kind="dbe", gpu=2, duration_s=30.0), id="fault-spec"),
    ],
)
def test_other_messages_round_trip(msg: Any) -> None:
    raw = encode_json(msg)
    assert to_wire(decoder(type(msg)).decode_json(raw)) == to_wire(_reference(type(msg), raw))
