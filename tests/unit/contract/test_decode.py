"""The one decoder: config (`strict.build`) and wire (`protocol`) decode through the same
compiled schemas, run every `__post_init__`, and name the first problem the way a reader of
the input meets it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainguard.decode import DecodeError, Invalid, decoder
from trainguard.protocol import Heartbeat, ProtocolError, decode_json, from_wire
from trainguard.strict import ConfigError, build, load_file


@dataclass(frozen=True)
class Limits:
    low: int = 0
    high: int = 10

    def __post_init__(self) -> None:
        if self.high <= self.low:
            raise Invalid("high", f"must exceed low ({self.low}), got {self.high}")


@dataclass(frozen=True)
class Pool:
    name: str
    limits: Limits = field(default_factory=Limits)
    weights: list[float] = field(default_factory=list)
    sizes: tuple[int, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    ratio: float = 1.0


@dataclass(frozen=True)
class Cluster:
    pools: tuple[Pool, ...] = ()
    default: Pool | None = None


class Oops(ValueError):
    pass


@dataclass(frozen=True)
class Fussy:
    x: int = 0

    def __post_init__(self) -> None:
        if self.x < 0:
            raise Oops("negative")


def test_config_takes_what_yaml_and_python_callers_hand_over() -> None:
    pool = build(Pool, {"name": "p", "weights": (1, 2.5), "sizes": [1, 2], "labels": {7: "x"}})
    assert pool.weights == [1.0, 2.5] and all(type(w) is float for w in pool.weights)
    assert pool.sizes == (1, 2)
    assert pool.labels == {"7": "x"}
    assert type(pool.limits) is Limits


def test_the_wire_takes_only_json_types() -> None:
    with pytest.raises(DecodeError) as e:
        decoder(Pool).decode({"name": "p", "labels": {7: "x"}})
    assert (e.value.path, e.value.reason) == ("labels.7", "expected a string, got integer")


def test_nonfinite_floats_travel_as_strings() -> None:
    pool = build(Pool, {"name": "p", "ratio": "-Infinity", "weights": ["NaN"]})
    assert pool.ratio == -math.inf and math.isnan(pool.weights[0])
    with pytest.raises(ConfigError, match=r"^ratio: expected a number, got string$"):
        build(Pool, {"name": "p", "ratio": "nan"})


@pytest.mark.parametrize(
    ("data", "key", "reason"),
    [
        pytest.param({"name": 1}, "name", "expected a string, got integer", id="int-for-str"),
        pytest.param(
            {"name": "p", "ratio": True},
            "ratio",
            "expected a number, got boolean",
            id="bool-for-float",
        ),
        pytest.param(
            {"name": "p", "sizes": [1.0]},
            "sizes[0]",
            "expected an integer, got number",
            id="float-for-int",
        ),
        pytest.param(
            {"name": "p", "limits": []},
            "limits",
            "expected a mapping, got list",
            id="list-for-object",
        ),
        pytest.param(
            {"name": "p", "weights": {}},
            "weights",
            "expected a list, got dict",
            id="mapping-for-list",
        ),
        pytest.param({}, "name", "required key is missing", id="missing"),
        pytest.param(
            {"name": "p", "limts": {}},
            "limts",
            "unknown key (did you mean 'limits'?)",
            id="near-miss",
        ),
        pytest.param(
            {"name": "p", "limits": {"high": 0}},
            "limits.high",
            "must exceed low (0), got 0",
            id="nested-invariant",
        ),
    ],
)
def test_errors_name_the_dotted_key_and_the_reason(data: dict, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        build(Pool, data, source="pools.yaml", prefix="pools[2]")
    assert (e.value.source, e.value.key, e.value.reason) == (
        "pools.yaml",
        f"pools[2].{key}",
        reason,
    )
    assert str(e.value) == f"pools.yaml: pools[2].{key}: {reason}"


def test_invariants_of_objects_inside_lists_name_their_place() -> None:
    data = {"pools": [{"name": "a"}, {"name": "b", "limits": {"low": 5, "high": 5}}]}
    with pytest.raises(ConfigError, match=r"^c\.yaml: pools\[1\]\.limits\.high: must exceed"):
        build(Cluster, data, source="c.yaml")


def test_an_unknown_key_is_named_before_the_fields_of_its_object() -> None:
    data = {"pools": [{"name": 1, "limits": {"hihg": 3, "low": "x"}}], "defualt": None}
    with pytest.raises(ConfigError) as e:
        build(Cluster, data)
    assert (e.value.key, e.value.reason) == ("defualt", "unknown key (did you mean 'default'?)")
    del data["defualt"]
    with pytest.raises(ConfigError) as e:
        build(Cluster, data)
    assert (e.value.key, e.value.reason) == ("pools[0].name", "expected a string, got integer")
    data["pools"][0]["name"] = "p"
    with pytest.raises(ConfigError) as e:
        build(Cluster, data)
    assert (e.value.key, e.value.reason) == (
        "pools[0].limits.hihg",
        "unknown key (did you mean 'high'?)",
    )


def test_a_post_init_error_other_than_invalid_is_raised_as_the_constructor_raises_it() -> None:
    with pytest.raises(Oops, match="negative"):
        build(Fussy, {"x": -1})
    with pytest.raises(Oops, match="negative"):
        decoder(Fussy).decode_json(b'{"x": -1}')


def test_a_config_file_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("name: p\nlimits:\n  low: 3\n  high: 2\n")
    with pytest.raises(ConfigError) as e:
        load_file(Pool, path)
    assert str(e.value) == f"{path}: limits.high: must exceed low (3), got 2"


def test_the_wire_checks_the_protocol_version_before_anything_else() -> None:
    raw = json.dumps({"job": "j", "rank": 0, "step": 1, "t": 1.0, "v": 2, "new_field": 1})
    with pytest.raises(ProtocolError) as e:
        decode_json(Heartbeat, raw)
    assert (e.value.field, e.value.reason) == ("v", "unsupported protocol version 2")
    with pytest.raises(ProtocolError) as e:
        from_wire(Heartbeat, {"job": "j", "rank": 0, "step": 1, "t": 1.0, "v": "1"})
    assert (e.value.field, e.value.reason) == ("v", "unsupported protocol version '1'")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        pytest.param(b"[1]", "expected a JSON object for Heartbeat", id="array"),
        pytest.param(
            b"{", "invalid JSON: EOF while parsing an object at line 1 column 1", id="truncated"
        ),
    ],
)
def test_the_wire_names_a_message_that_is_not_an_object(raw: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_json(Heartbeat, raw)
    assert (e.value.field, e.value.reason) == ("", reason)


def test_only_optional_unions_decode() -> None:
    @dataclass(frozen=True)
    class Either:
        x: int | str = 0

    with pytest.raises(TypeError, match=r"only X \| None unions"):
        decoder(Either)
