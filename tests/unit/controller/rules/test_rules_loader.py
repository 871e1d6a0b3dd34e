"""Rule files load strictly: every mistake fails with file, rule name and reason, and nothing
is half-loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.controller.rules.loader import RuleError, default_rules_path, load_rules

GOOD = """
rules:
  - name: gpu_hot
    scope: gpu
    condition: temperature_celsius > 90
    for: 90s
    severity: warning
    actions: [notify]
    cooldown: 1h
    summary: GPU hot
    description: too hot
    labels: {team: infra, tier: 1}
"""


def _rule(**overrides: object) -> str:
    base: dict[str, object] = {
        "name": "r1",
        "scope": "gpu",
        "condition": "lost == 1",
        "severity": "critical",
        "summary": "s",
    }
    base.update(overrides)
    lines = ["rules:", "  - name: " + str(base.pop("name"))]
    for k, v in base.items():
        if v is not None:
            lines.append(f"    {k}: {v}")
    return "\n".join(lines) + "\n"


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_file_loads_every_field(tmp_path: Path) -> None:
    rs = load_rules([_write(tmp_path, GOOD)])
    (r,) = rs.rules
    assert (r.name, r.scope, r.for_s, r.severity, r.cooldown_s) == (
        "gpu_hot",
        "gpu",
        90,
        "warning",
        3600,
    )
    assert r.actions == ("notify",)
    assert r.condition.source == "temperature_celsius > 90"
    assert r.condition.signals() == {"temperature_celsius"}
    assert dict(r.labels) == {"team": "infra", "tier": "1"}
    assert r.summary == "GPU hot" and r.description == "too hot"
    assert rs.sources == (str(tmp_path / "r.yaml"),)


def test_defaults_for_optional_keys(tmp_path: Path) -> None:
    (r,) = load_rules([_write(tmp_path, _rule())]).rules
    assert (r.for_s, r.cooldown_s, r.actions, dict(r.labels)) == (0.0, 0.0, ("notify",), {})


BAD = [
    (
        "unknown-rule-key",
        _rule(severty="warning"),
        "r1",
        "severty: unknown key (did you mean 'severity'?)",
    ),
    ("unknown-top-key", "rule:\n  - name: x\n", None, "rule: unknown key (did you mean 'rules'?)"),
    ("missing-condition", _rule(condition=None), "r1", "missing key 'condition'"),
    ("missing-summary", _rule(summary=None), "r1", "missing key 'summary'"),
    ("bad-scope", _rule(scope="rack"), "r1", "scope: must be one of"),
    (
        "bad-severity",
        _rule(severity="fatal"),
        "r1",
        "severity: must be one of info, warning, critical",
    ),
    ("unknown-action", _rule(actions="[notify, reboot]"), "r1", "actions: unknown action 'reboot'"),
    ("duplicate-action", _rule(actions="[notify, notify]"), "r1", "listed twice"),
    ("bad-for", _rule(**{"for": "5 minutes"}), "r1", "for: invalid duration '5 minutes'"),
    ("unitless-for", _rule(**{"for": 30}), "r1", "for: expected a duration with a unit"),
    ("bad-cooldown", _rule(cooldown="1.5h"), "r1", "cooldown: invalid duration"),
    ("bad-name", _rule(name="Gpu-Hot"), "Gpu-Hot", "name: use lower-case letters"),
    ("bad-condition", _rule(condition="'lost = 1'"), "r1", "condition: column 6"),
    (
        "reserved-label",
        _rule(labels="{severity: low}"),
        "r1",
        "labels: 'severity' is set by trainguard",
    ),
    ("rules-not-list", "rules: {a: 1}\n", None, "rules: expected a list, got mapping"),
    ("rule-not-mapping", "rules:\n  - just text\n", "#1", "expected a mapping, got string"),
    ("empty-file", "", None, "empty file"),
    ("invalid-yaml", "rules: [\n", None, "invalid YAML"),
    (
        "duplicate-in-file",
        _rule() + _rule().replace("rules:\n", ""),
        "r1",
        "duplicate rule name (also defined earlier in this file)",
    ),
]


@pytest.mark.parametrize(("text", "rule", "reason"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_rule_file_names_file_rule_and_reason(
    tmp_path: Path, text: str, rule: str | None, reason: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(RuleError) as exc:
        load_rules([path])
    e = exc.value
    assert e.file == str(path)
    assert e.rule == rule
    assert reason in e.reason
    prefix = f"{path}: rule {rule}: " if rule else f"{path}: "
    assert str(e).startswith(prefix)


def test_condition_error_shows_a_caret_under_the_column(tmp_path: Path) -> None:
    path = _write(tmp_path, _rule(condition="'lost == 1 or bogus > 2'"))
    with pytest.raises(RuleError) as exc:
        load_rules([path])
    lines = str(exc.value).splitlines()
    assert "unknown signal 'bogus'" in lines[0]
    src, caret = lines[1], lines[2]
    assert caret.index("^") == src.index("bogus")


def test_duplicate_rule_names_across_files_are_an_error(tmp_path: Path) -> None:
    a = _write(tmp_path, _rule(), "a.yaml")
    b = _write(tmp_path, _rule(), "b.yaml")
    with pytest.raises(RuleError) as exc:
        load_rules([a, b])
    assert exc.value.file == str(b)
    assert exc.value.rule == "r1"
    assert str(a) in exc.value.reason


def test_directory_loads_yaml_and_yml_sorted_and_skips_other_tables(tmp_path: Path) -> None:
    _write(tmp_path, _rule(name="b_rule"), "b.yml")
    _write(tmp_path, _rule(name="a_rule"), "a.yaml")
    _write(tmp_path, "not: rules\n", "notes.txt")
    _write(tmp_path, "version: 1\nxids: {}\n", "xid_catalog.yaml")
    rs = load_rules([tmp_path])
    assert rs.names() == ["a_rule", "b_rule"]
    assert [Path(s).name for s in rs.sources] == ["a.yaml", "b.yml"]


def test_missing_path_and_empty_directory_are_errors(tmp_path: Path) -> None:
    with pytest.raises(RuleError, match="file not found"):
        load_rules([tmp_path / "nope.yaml"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuleError, match="no rule files"):
        load_rules([empty])


def test_one_bad_file_fails_the_whole_load(tmp_path: Path) -> None:
    _write(tmp_path, _rule(name="fine"), "a.yaml")
    _write(tmp_path, _rule(name="broken", scope="rack"), "b.yaml")
    with pytest.raises(RuleError) as exc:
        load_rules([tmp_path])
    assert exc.value.rule == "broken"


def test_history_needs_lists_windowed_and_age_signals(tmp_path: Path) -> None:
    text = _rule(condition="'increase(xid_total[5m]) > 0 or age(power_watts) > 60 or lost == 1'")
    rs = load_rules([_write(tmp_path, text)])
    assert rs.history_needs() == {"gpu": frozenset({"xid_total", "power_watts"})}


def test_shipped_default_rules_load() -> None:
    path = default_rules_path()
    assert (path / "default.yaml").is_file()
    rs = load_rules([path])
    assert len(rs.rules) >= 15
    assert all(r.summary and r.description for r in rs.rules)


@pytest.mark.parametrize("key", ["for", "cooldown"])
def test_durations_longer_than_a_week_are_refused(tmp_path: Path, key: str) -> None:
    f = tmp_path / "r.yaml"
    f.write_text(
        GOOD.replace("for: 90s", "for: 90s" if key != "for" else "for: 9999w").replace(
            "cooldown: 1h", "cooldown: 1h" if key != "cooldown" else "cooldown: 8d"
        )
    )
    with pytest.raises(RuleError) as e:
        load_rules([f])
    assert str(e.value).startswith(f"{f}: rule gpu_hot: {key}: ")
    assert "longer than 1w" in str(e.value)


def test_a_condition_nested_too_deep_names_file_rule_and_reason(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    deep = "(" * 90 + "temperature_celsius > 90" + ")" * 90
    f.write_text(GOOD.replace("condition: temperature_celsius > 90", f"condition: '{deep}'"))
    with pytest.raises(RuleError) as e:
        load_rules([f])
    assert str(e.value).startswith(f"{f}: rule gpu_hot: ")
    assert "nested more than 16 levels deep" in str(e.value)
